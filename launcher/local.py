"""`protocol-swarm local`: a whole swarm on this machine, the first thing a newcomer runs.

It starts a bootstrap DHT node in this process (which also watches the peers' records), a
tracker, and one `protocol-peer` process per slot, all on loopback; it stops when the slowest
stage has made `--steps` optimizer steps, and always stops every child: upstream first, so the
drivers' last trips come back before the stages after them stop and none is counted as an error,
then whatever is left in their process groups (hivemind's DHT processes, p2pd). A peer that dies
is restarted with `--stage auto` (one log line each; `--no-restart` makes a dead peer end the run
instead), and `--churn SECONDS` kills a random peer that is not the last of its stage every SECONDS,
so the swarm can be watched healing on the status page. The status page is part of what a newcomer
runs this for, so the tracker is checked like a peer: its page and `/api/v1/swarm` are fetched
during the run (the summary reports what was fetched), and a dead tracker fails the run. The
temporary directory is removed after a clean run and kept, with its path printed, whenever a
child failed. The processes themselves are `launcher/supervisor.py`'s; what is watched, `launcher/progress.py`'s.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from launcher.manifest_args import add_manifest_args, manifest_from
from launcher.progress import Progress, TrackerProbe
from launcher.supervisor import ChildFailed, LocalSwarm, LocalSwarmError


def run_local(args: argparse.Namespace) -> dict:
    manifest = manifest_from(args)
    workdir = Path(tempfile.mkdtemp(prefix="protocol-swarm-"))
    swarm = LocalSwarm(manifest, args.peers_per_stage, workdir, args.max_inflight)
    progress = Progress()
    tracker: TrackerProbe | None = None
    bar = None
    keep = args.keep_logs
    try:
        swarm.start()
        tracker = TrackerProbe(swarm.tracker_url, manifest.run_id, manifest.num_stages)
        if not args.json:
            print(f"tracker: {swarm.tracker_url}", flush=True)
            from tqdm import tqdm

            bar = tqdm(total=args.steps, desc=f"local swarm {manifest.compression}", unit="step")
        deadline = time.monotonic() + args.timeout
        epoch, kills, rng = 0, 0, random.Random()
        next_kill = time.monotonic() + args.churn if args.churn > 0 else float("inf")
        while epoch < args.steps:
            if time.monotonic() > deadline:
                raise LocalSwarmError(f"timed out after {args.timeout:.0f}s at step {epoch} of {args.steps}")
            supervise(swarm, args.no_restart)
            time.sleep(1.0)
            stages = swarm.poll()
            if time.monotonic() >= next_kill:
                next_kill += args.churn
                killed = swarm.kill_random_peer(stages, rng)
                kills += killed is not None
                said = (
                    f"killed {killed[0]} (stage {killed[1]})" if killed else "every stage has one peer, nobody killed"
                )
                print(f"protocol-swarm local: churn: {said}", file=sys.stderr, flush=True)
            progress.observe(stages)
            if tracker.due():
                tracker.probe()
            if progress.online_at is None and all(
                any(e.record.state == "online" for e in stages.get(s, [])) for s in range(manifest.num_stages)
            ):
                progress.online_at = time.monotonic()
            new_epoch = progress.slowest_epoch(stages, manifest.num_stages)
            if bar is not None:
                bar.update(max(0, min(new_epoch, args.steps) - epoch))
                if progress.loss_last is not None:
                    bar.set_postfix(loss=f"{progress.loss_last:.3f}", tokens=progress.driver_tokens())
            epoch = max(epoch, new_epoch)
        progress.observe(swarm.poll())
        cp_bytes = swarm.cp_bytes_per_token() if manifest.lanes > 1 else None
        tracker.probe()  # the page and the API once more at the end, with every peer still up
        supervise(swarm, args.no_restart)
        if not tracker.ok:
            raise LocalSwarmError(
                f"the tracker at {swarm.tracker_url} never served its page and /api/v1/swarm "
                f"(last error: {tracker.last_error}); see {workdir / 'tracker.log'}"
            )
        elapsed = time.monotonic() - (progress.online_at or progress.started)
    except ChildFailed:
        keep = True
        raise
    finally:
        if bar is not None:
            bar.close()
        swarm.stop()
        if keep:
            print(f"protocol-swarm local: logs kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    tokens = progress.driver_tokens()
    return {
        "run_id": manifest.run_id,
        "compression": manifest.compression,
        "stages": manifest.num_stages,
        "peers_per_stage": args.peers_per_stage,
        "steps": epoch,
        "tokens": tokens,
        "loss_first": progress.loss_first,
        "loss_last": progress.loss_last,
        "loss_history": progress.loss_history,
        "tokens_per_second": progress.tokens_per_second(),
        "wire_bytes_per_token": progress.wire_bytes_per_token(),
        "dense_wire_bytes_per_token": 2 * manifest.dense_bytes_per_token(),
        # context parallelism: K/V bytes on the wire (both directions, every lane) per token per layer, as the
        # peers' exchanges counted them; the simulator's cp_bytes_per_token forward + backward is the same measure
        "cp_bytes_per_token_per_layer": cp_bytes / manifest.model.n_layers if cp_bytes is not None else None,
        "seconds": elapsed,
        "tracker": swarm.tracker_url,
        "tracker_ok": tracker.ok,
        "tracker_page_fetches": tracker.page_fetches,
        "tracker_api_fetches": tracker.api_fetches,
        "tracker_saw_healthy": tracker.healthy_seen,
        "workdir": str(workdir),
        "kills": kills,
        "restarts": sum(child.restarts for child in swarm.children),
        "peers": [
            {
                "peer_id": e.record.peer_id,
                "name": e.record.public_name,
                "stage": e.record.stage,
                "trips": e.record.trips,
                "errors": e.record.errors,
                "tokens": e.record.tokens,
            }
            for e in sorted(progress.entries.values(), key=lambda e: (e.record.stage, e.record.public_name))
        ],
    }


def supervise(swarm: LocalSwarm, no_restart: bool) -> None:
    """A dead child ends the run (`--no-restart`), or a dead peer is restarted with a line on stderr."""
    if no_restart:
        swarm.check_children()
        return
    for line in swarm.heal():
        print(f"protocol-swarm local: {line}", file=sys.stderr, flush=True)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM takes the same path as Ctrl-C: every child is stopped


def cmd_local(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        summary = run_local(args)
    except LocalSwarmError as exc:
        print(f"protocol-swarm local: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("protocol-swarm local: interrupted; all peers stopped", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"run {summary['run_id']} ({summary['compression']}): {summary['steps']} steps, "
            f"{summary['tokens']} tokens in {summary['seconds']:.0f}s = {summary['tokens_per_second']:.0f} tokens/s"
        )
        if summary["loss_first"] is not None:
            print(f"loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f}")
        print(
            f"wire {summary['wire_bytes_per_token']:.1f} bytes/token per boundary "
            f"(dense would send {summary['dense_wire_bytes_per_token']})"
        )
        if summary["cp_bytes_per_token_per_layer"] is not None:
            print(f"context parallel K/V {summary['cp_bytes_per_token_per_layer']:.1f} bytes/token/layer on the wire")
        print(
            f"tracker {summary['tracker']}: page served {summary['tracker_page_fetches']} times, "
            f"/api/v1/swarm {summary['tracker_api_fetches']} times"
        )
        for peer in summary["peers"]:
            print(f"  stage {peer['stage']} {peer['name']:<16} trips {peer['trips']:>6} errors {peer['errors']}")
    return 0


def add_local_parser(sub) -> None:
    local = sub.add_parser("local", help="run tracker, bootstrap and a peer per stage on this machine")
    add_manifest_args(local, stages=3, context_parallel=True)  # a pipeline to watch (the preset may have fewer stages)
    local.add_argument("--peers-per-stage", type=int, default=1)
    local.add_argument("--steps", type=int, default=60, help="optimizer steps of the slowest stage")
    local.add_argument("--max-inflight", type=int, help="trips each driver keeps in flight (default: the peer's)")
    local.add_argument("--timeout", type=float, default=900.0, help="give up after this many seconds")
    local.add_argument(
        "--keep-logs", action="store_true", help="keep the working directory with peer logs (kept anyway on failure)"
    )
    local.add_argument("--json", action="store_true", help="print one JSON summary as the last line")
    local.add_argument(
        "--no-restart", action="store_true", help="a peer that exits ends the run (default: it is restarted)"
    )
    local.add_argument(
        "--churn",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="every SECONDS, kill a random peer that is not the last of its stage (it is restarted)",
    )
    local.set_defaults(func=cmd_local)
