"""Churn soak (issue 14): a local swarm with a tracker, one random peer SIGKILLed every `--kill-every`
seconds (never the last of its stage) and restarted with `--stage auto`, for `--minutes`.

The processes are `launcher/supervisor.py`'s, like `protocol-swarm local --churn`. Every `--sample`
seconds the soak reads the peers' records (its own DHT node) and the tracker's `/api/v1/swarm`;
per minute it reports: the fraction of samples in which every stage had a live online peer (a record
refreshed within the last 10 s: a dead peer's record lives 30 s and would hide an empty stage),
tokens/s (from the tracker's run counter), the loss, stage moves (the peers' "moving to stage" log
lines), the resident memory of every peer slot (its main process and its whole process group, from
/proc) and orphans (processes of a stopped peer's group still alive). A placement is wrong when a
replacement's first record lands in a stage with more live peers than another stage has. At the end
it checks issue 14's "done when" and prints one JSON summary as the last line.

    python benchmarks/churn.py --stages 2 --peers-per-stage 2 --kill-every 60 --minutes 30 [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
from hivemind.utils.timed_storage import get_dht_time

from launcher.supervisor import LocalSwarm
from peer.placement import LIVENESS_WINDOW  # a record refreshed this recently belongs to a live peer
from swarm.presets import preset
from swarm.records import RECORD_TTL

MOVE = re.compile(r"rebalancing: moving to stage")


def proc_table() -> dict[int, tuple[int, float]]:
    """{pid: (process group, resident MiB)} of every process, from /proc."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            rss_pages = int(fields[21])
            out[int(name)] = (int(fields[2]), rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20)
        except (OSError, IndexError, ValueError):
            continue
    return out


def live_by_stage(stages: dict, now: float) -> dict[int, dict[str, str]]:
    """{stage: {peer id: public name}} of online records refreshed within LIVENESS_WINDOW."""
    return {
        stage: {
            e.record.peer_id: e.record.public_name
            for e in entries
            if e.record.state == "online" and e.expiration - RECORD_TTL >= now - LIVENESS_WINDOW
        }
        for stage, entries in stages.items()
    }


class Soak:
    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args, self.workdir = args, workdir
        manifest = preset(args.preset, stages=args.stages)
        self.swarm = LocalSwarm(manifest, args.peers_per_stage, workdir, args.max_inflight)
        self.rng = random.Random(args.seed)
        self.seen_ids: set[str] = set()
        self.placements, self.wrong_placements, self.kills, self.groups = 0, 0, 0, set()
        self.tokens_series: list[int] = []
        self.rss_by_process: dict[str, list[tuple[float, float]]] = {}  # "slot pid N" -> [(time, main MiB)]
        self.minute: dict = {}

    def place_check(self, live: dict[int, dict[str, str]], all_records: dict) -> None:
        """A peer id seen for the first time after the start is a replacement's placement: compare its stage
        with the live counts of the others (itself not counted)."""
        for stage, entries in all_records.items():
            for e in entries:
                peer_id = e.record.peer_id
                if peer_id in self.seen_ids:
                    continue
                self.seen_ids.add(peer_id)
                if not self.churning:
                    continue
                counts = {s: len([p for p in ids if p != peer_id]) for s, ids in live.items()}
                self.placements += 1
                if counts[stage] > min(counts.values()):
                    self.wrong_placements += 1
                    print(f"wrong placement: {e.record.public_name} -> stage {stage} with live {counts}", flush=True)

    def moves(self) -> int:
        return sum(len(MOVE.findall(p.read_text(errors="replace"))) for p in self.workdir.glob("stage*.log"))

    def memory(self) -> dict[str, dict[str, float]]:
        table = proc_table()
        out = {}
        for child in self.swarm.children:
            pgid = child.process.pid
            self.groups.add(pgid)
            group = [rss for pid, (pg, rss) in table.items() if pg == pgid]
            main = table.get(pgid, (0, 0.0))[1]
            out[child.name] = dict(main=round(main), group=round(sum(group)))
            if main:
                self.rss_by_process.setdefault(f"{child.name} pid {pgid}", []).append((time.monotonic(), main))
        return out

    def run(self) -> dict:
        args, swarm = self.args, self.swarm
        client = httpx.Client(timeout=5.0)
        self.churning = False
        swarm.start()
        started = time.monotonic()
        while True:  # until every stage has all its peers online
            swarm.heal()
            live = live_by_stage(swarm.poll(), get_dht_time())
            if all(len(live.get(s, {})) == args.peers_per_stage for s in range(args.stages)):
                break
            if time.monotonic() - started > 600:
                raise RuntimeError("the swarm did not come up in 10 minutes")
            time.sleep(2.0)
        self.place_check(live, swarm.poll())
        print(f"swarm up after {time.monotonic() - started:.0f}s; tracker {swarm.tracker_url}", flush=True)
        time.sleep(args.warmup)
        self.churning = True
        churn_start = time.monotonic()
        end = churn_start + 60 * args.minutes
        next_kill = churn_start + args.kill_every
        minutes, rows = 0, []
        loss_at_churn_start = self.tracker(client).get("totals", {}).get("loss")
        samples = healthy = 0
        tokens_minute_start = self.tracker_tokens(client)
        moves_before = self.moves()
        while time.monotonic() < end:
            for line in swarm.heal():
                print(f"{time.monotonic() - churn_start:7.0f}s {line}", flush=True)
            now_mono = time.monotonic()
            if now_mono >= next_kill:
                next_kill += args.kill_every
                killed = swarm.kill_random_peer(swarm.poll(), self.rng)
                self.kills += killed is not None
                said = f"killed {killed[0]} (stage {killed[1]})" if killed else "every stage has one live peer"
                print(f"{now_mono - churn_start:7.0f}s churn: {said}", flush=True)
            records = swarm.poll()
            live = live_by_stage(records, get_dht_time())
            self.place_check(live, records)
            samples += 1
            healthy += all(live.get(s) for s in range(args.stages))
            body = self.tracker(client)
            if body:
                self.tokens_series.append(body["totals"]["tokens_trained"])
            if loss_at_churn_start is None and body:  # the first loss the tracker reports once churn began
                loss_at_churn_start = body["totals"]["loss"]
            last_sample = time.monotonic() + args.sample >= end
            if now_mono - churn_start >= 60 * (minutes + 1) or (last_sample and samples):
                minutes += 1
                tokens = self.tracker_tokens(client)
                moves = self.moves()
                row = dict(
                    minute=minutes,
                    healthy=round(healthy / max(samples, 1), 4),
                    tokens_per_s=round((tokens - tokens_minute_start) / 60.0, 1),
                    loss=body.get("totals", {}).get("loss") if body else None,
                    moves=moves - moves_before,
                    kills=self.kills,
                    placements=self.placements,
                    wrong_placements=self.wrong_placements,
                    rss_mib=self.memory(),
                    orphans=self.orphans(),
                    samples=samples,
                    healthy_samples=healthy,
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
                tokens_minute_start, moves_before, samples, healthy = tokens, moves, 0, 0
            time.sleep(max(0.0, args.sample - (time.monotonic() - now_mono)))
        final_loss = self.tracker(client).get("totals", {}).get("loss")
        return self.verdict(rows, loss_at_churn_start, final_loss)

    def tracker(self, client: httpx.Client) -> dict:
        try:
            response = client.get(self.swarm.tracker_url + "/api/v1/swarm")
            return response.json() if response.status_code == 200 else {}
        except httpx.HTTPError:
            return {}

    def tracker_tokens(self, client: httpx.Client) -> int:
        body = self.tracker(client)
        return body["totals"]["tokens_trained"] if body else (self.tokens_series[-1] if self.tokens_series else 0)

    def orphans(self) -> int:
        """Processes left in the group of a peer slot whose leader is gone (a killed peer's DHT child or p2pd)."""
        table = proc_table()
        leaders = {child.process.pid for child in self.swarm.children}
        gone = self.groups - leaders
        return sum(1 for pg, _ in table.values() if pg in gone)

    def verdict(self, rows: list[dict], loss_start: float | None, loss_end: float | None) -> dict:
        drops = sum(1 for a, b in zip(self.tokens_series, self.tokens_series[1:], strict=False) if b < a)
        samples = sum(r["samples"] for r in rows)
        healthy = sum(r["healthy_samples"] for r in rows) / max(samples, 1)
        restarts = sum(c.restarts for c in self.swarm.children)
        growth = {}  # per process that lived past its first 5 minutes: its RSS at its end over its RSS then
        for process, series in self.rss_by_process.items():
            settled = [rss for t, rss in series if t - series[0][0] >= 300]
            if len(settled) >= 2:
                growth[process] = round(series[-1][1] / settled[0] - 1, 3)
        total_moves = sum(r["moves"] for r in rows)
        return dict(
            minutes=len(rows),
            kills=self.kills,
            restarts=restarts,
            placements=self.placements,
            wrong_placements=self.wrong_placements,
            moves=total_moves,
            healthy_fraction=round(healthy, 4),
            tracker_token_drops=drops,
            loss_at_churn_start=loss_start,
            loss_at_end=loss_end,
            rss_growth_after_first_5_min=growth,
            orphans_at_end=rows[-1]["orphans"] if rows else None,
            done_when=dict(
                wrong_placements_le_1=self.wrong_placements <= 1,
                moves_le_1_per_replacement=total_moves <= max(restarts, 0),
                rss_growth_le_10pct=all(g <= 0.10 for g in growth.values()) if growth else None,
                tokens_monotonic=drops == 0,
                healthy_ge_99pct=healthy >= 0.99,
                loss_fell=loss_start is not None and loss_end is not None and loss_end < loss_start,
            ),
        )


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--peers-per-stage", type=int, default=2)
    parser.add_argument("--kill-every", type=float, default=60.0)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds of training before the first kill")
    parser.add_argument("--sample", type=float, default=2.0, help="seconds between samples")
    parser.add_argument("--max-inflight", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the summary here too")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="churn-"))
    soak = Soak(args, workdir)
    signal.signal(signal.SIGTERM, _interrupt)  # stopped from outside: every peer is still stopped
    try:
        summary = soak.run()
    finally:
        soak.swarm.stop()
        leftover = soak.orphans() + sum(1 for pg, _ in proc_table().values() if pg in soak.groups)
        print(f"processes left after stop: {leftover}; logs in {workdir}", file=sys.stderr)
    summary["processes_left_after_stop"] = leftover
    summary["args"] = vars(args)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    shutil.rmtree(workdir / "checkpoints", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
