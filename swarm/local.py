"""`protocol-swarm local`: a whole swarm on this machine, the first thing a newcomer runs.

It starts a bootstrap DHT node in this process (which also watches the peers' records), a
tracker, and one `protocol-peer` process per slot, all on loopback; it stops when the slowest
stage has made `--steps` optimizer steps, and always stops every child (process groups, so
hivemind's DHT processes and p2pd daemons go too). The status page is part of what a newcomer
runs this for, so the tracker is checked like a peer: its page and `/api/v1/swarm` are fetched
during the run (the summary reports what was fetched), and a dead tracker fails the run. The
temporary directory is removed after a clean run and kept, with its path printed, whenever a
child failed. Peers are separate programs, started as commands: `swarm` never imports `peer`
or `tracker`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from swarm.manifest import Manifest, save_manifest
from swarm.presets import PRESETS, preset
from swarm.records import PeerEntry, fetch_stages, load_or_create_rsa_key, make_validators


class LocalSwarmError(RuntimeError):
    pass


class ChildFailed(LocalSwarmError):
    """A child process exited during the run: its log, and the working directory, are evidence to keep."""


TRACKER_PROBE_INTERVAL = 5.0


@dataclass
class TrackerProbe:
    """What the tracker actually served during the run, fetched over HTTP like a browser would.

    The page counts when it answers 200 and names this run; the API when `/api/v1/swarm` answers
    200 with this run's id and one row per stage; `healthy_seen` when the API once reported every
    stage served. Failures before the first success are the tracker starting up, not errors.
    """

    url: str
    run_id: str
    num_stages: int
    page_fetches: int = 0
    api_fetches: int = 0
    healthy_seen: bool = False
    last_error: str | None = None
    last_probe: float = -float("inf")

    def probe(self, timeout: float = 5.0) -> None:
        import httpx

        self.last_probe = time.monotonic()
        try:
            page = httpx.get(self.url + "/", timeout=timeout)
            if page.status_code == 200 and self.run_id in page.text:
                self.page_fetches += 1
            else:
                self.last_error = f"GET / answered {page.status_code}"
            api = httpx.get(self.url + "/api/v1/swarm", params={"history": 0}, timeout=timeout)
            body = api.json() if api.status_code == 200 else {}
            if body.get("run_id") == self.run_id and len(body.get("stages", [])) == self.num_stages:
                self.api_fetches += 1
                self.healthy_seen = self.healthy_seen or body.get("healthy") is True
            else:
                self.last_error = f"GET /api/v1/swarm answered {api.status_code}"
        except (httpx.HTTPError, ValueError) as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"

    def due(self) -> bool:
        return time.monotonic() - self.last_probe >= TRACKER_PROBE_INTERVAL

    @property
    def ok(self) -> bool:
        return self.page_fetches > 0 and self.api_fetches > 0


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    log: Path


@dataclass
class Progress:
    started: float = field(default_factory=time.monotonic)
    online_at: float | None = None
    loss_first: float | None = None
    loss_last: float | None = None
    loss_history: list[float] = field(default_factory=list)
    entries: dict[str, PeerEntry] = field(default_factory=dict)  # peer_id → latest record
    token_marks: list[tuple[float, int]] = field(default_factory=list)  # (when, driver tokens) at each change

    def observe(self, stages: dict[int, list[PeerEntry]]) -> None:
        for entries in stages.values():
            for entry in entries:
                self.entries[entry.record.peer_id] = entry
        tokens = self.driver_tokens()
        if tokens and (not self.token_marks or tokens != self.token_marks[-1][1]):
            self.token_marks.append((time.monotonic(), tokens))
        losses = [e.record.loss for e in stages.get(0, []) if e.record.loss is not None]
        if losses:
            loss = sum(losses) / len(losses)
            if not self.loss_history or loss != self.loss_history[-1]:
                self.loss_history.append(loss)
            if self.loss_first is None:
                self.loss_first = loss
            self.loss_last = loss

    def slowest_epoch(self, stages: dict[int, list[PeerEntry]], num_stages: int) -> int:
        per_stage = [max((e.record.optimizer_epoch for e in stages.get(s, [])), default=0) for s in range(num_stages)]
        return min(per_stage)

    def driver_tokens(self) -> int:
        return sum(e.record.tokens for e in self.entries.values() if e.record.stage == 0)

    def tokens_per_second(self) -> float:
        """From the first to the last change of the drivers' counters: records are a few seconds stale."""
        if len(self.token_marks) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self.token_marks[0], self.token_marks[-1]
        return (n1 - n0) / max(t1 - t0, 1e-9)

    def wire_bytes_per_token(self) -> float:
        """Bytes through one boundary (both directions) per token, as the drivers counted them."""
        drivers = [e.record for e in self.entries.values() if e.record.stage == 0 and e.record.tokens]
        return sum(r.bytes_in + r.bytes_out for r in drivers) / max(sum(r.tokens for r in drivers), 1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalSwarm:
    def __init__(
        self,
        manifest: Manifest,
        peers_per_stage: int,
        workdir: Path,
        max_inflight: int,
        with_tracker: bool = True,
        extra_peer_args: list[str] | None = None,
    ):
        self.manifest, self.peers_per_stage, self.workdir = manifest, peers_per_stage, workdir
        self.max_inflight, self.with_tracker = max_inflight, with_tracker
        self.extra_peer_args = extra_peer_args or []
        self.children: list[Child] = []
        self.dht = None
        self.tracker_url: str | None = None
        self.manifest_path = workdir / "manifest.json"

    def _spawn(self, name: str, argv: list[str]) -> Child:
        log = self.workdir / f"{name}.log"
        handle = log.open("wb")
        process = subprocess.Popen(
            argv,
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=self._child_env(),
        )
        handle.close()
        child = Child(name, process, log)
        self.children.append(child)
        return child

    @staticmethod
    def _child_env() -> dict[str, str]:
        """Many processes share this machine's cores: one torch thread each avoids oversubscription."""
        return {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1"}

    def start(self) -> None:
        from hivemind.dht import DHT

        save_manifest(self.manifest, self.manifest_path)
        _, validators = make_validators(self.manifest, load_or_create_rsa_key(None))
        self.dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=validators)
        bootstrap = self.bootstrap
        tracker = shutil.which("protocol-tracker")
        if self.with_tracker:
            if tracker is None:
                raise LocalSwarmError("protocol-tracker is not installed (pip install -e .)")
            port = free_port()
            self._spawn(
                "tracker",
                [
                    tracker,
                    "--manifest",
                    str(self.manifest_path),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--db",
                    str(self.workdir / "tracker.sqlite"),
                    "--identity",
                    str(self.workdir / "tracker.id"),
                    "--initial-peers",
                    *bootstrap,
                ],
            )
            self.tracker_url = f"http://127.0.0.1:{port}"
        for stage in range(self.manifest.num_stages):
            for slot in range(self.peers_per_stage):
                self.spawn_peer(f"stage{stage}-peer{slot}", str(stage))

    @property
    def bootstrap(self) -> list[str]:
        return [str(a) for a in self.dht.get_visible_maddrs()]

    def spawn_peer(self, name: str, stage: str, extra_args: list[str] | None = None) -> Child:
        peer = shutil.which("protocol-peer")
        if peer is None:
            raise LocalSwarmError("protocol-peer is not installed (pip install -e .)")
        return self._spawn(
            name,
            [
                peer,
                "--manifest",
                str(self.manifest_path),
                "--initial-peers",
                *self.bootstrap,
                "--stage",
                stage,
                "--host-maddrs",
                "/ip4/127.0.0.1/tcp/0",
                "--public-name",
                name,
                "--max-inflight",
                str(self.max_inflight),
                "--device",
                "cpu",
                "--checkpoint-dir",
                str(self.workdir / "checkpoints" / name),
                *self.extra_peer_args,
                *(extra_args or []),
            ],
        )

    def check_children(self) -> None:
        """Any child that exits before the end fails the run: a dead peer stalls its stage, a dead
        tracker takes the status page with it."""
        for child in self.children:
            code = child.process.poll()
            if code is not None:
                tail = child.log.read_text(errors="replace")[-2000:]
                raise ChildFailed(f"{child.name} exited with code {code}; its log ends:\n{tail}")

    def poll(self) -> dict[int, list[PeerEntry]]:
        return fetch_stages(self.dht, self.manifest)

    def stop(self) -> None:
        for process in stop_process_groups([child.process for child in self.children], grace=20.0):
            print(f"warning: pid {process.pid} did not exit after SIGKILL", file=sys.stderr)
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None


def stop_process_groups(processes: list[subprocess.Popen], grace: float) -> list[subprocess.Popen]:
    """SIGTERM every process group, wait up to `grace` seconds in all, then SIGKILL the groups (hivemind's
    DHT process and p2pd may outlive their parent). Returns the processes still alive after that."""
    for process in processes:  # also when the leader has exited: its group may not have
        _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    survivors = []
    for process in processes:
        _signal_group(process, signal.SIGKILL)
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            survivors.append(process)
    return survivors


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_local(args: argparse.Namespace) -> dict:
    manifest = preset(
        args.preset,
        stages=args.stages,
        compression=args.compression,
        seed=args.seed,
        subspace_update_interval=args.subspace_update_interval,
    )
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
        epoch = 0
        while epoch < args.steps:
            if time.monotonic() > deadline:
                raise LocalSwarmError(f"timed out after {args.timeout:.0f}s at step {epoch} of {args.steps}")
            swarm.check_children()
            time.sleep(1.0)
            stages = swarm.poll()
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
        tracker.probe()  # the page and the API once more at the end, with every peer still up
        swarm.check_children()
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
        "seconds": elapsed,
        "tracker": swarm.tracker_url,
        "tracker_ok": tracker.ok,
        "tracker_page_fetches": tracker.page_fetches,
        "tracker_api_fetches": tracker.api_fetches,
        "tracker_saw_healthy": tracker.healthy_seen,
        "workdir": str(workdir),
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
        print(
            f"tracker {summary['tracker']}: page served {summary['tracker_page_fetches']} times, "
            f"/api/v1/swarm {summary['tracker_api_fetches']} times"
        )
        for peer in summary["peers"]:
            print(f"  stage {peer['stage']} {peer['name']:<16} trips {peer['trips']:>6} errors {peer['errors']}")
    return 0


def add_local_parser(sub) -> None:
    local = sub.add_parser("local", help="run tracker, bootstrap and a peer per stage on this machine")
    local.add_argument("--preset", default="tiny", choices=PRESETS)
    local.add_argument("--stages", type=int, default=3, help="pipeline stages")
    local.add_argument("--peers-per-stage", type=int, default=1)
    local.add_argument("--steps", type=int, default=60, help="optimizer steps of the slowest stage")
    local.add_argument("--compression", choices=("subspace", "boundary", "none"))
    local.add_argument("--seed", type=int, default=0)
    local.add_argument("--subspace-update-interval", type=int, help="optimizer epochs between U updates (0 = never)")
    local.add_argument("--max-inflight", type=int, default=4, help="trips each driver keeps in flight")
    local.add_argument("--timeout", type=float, default=900.0, help="give up after this many seconds")
    local.add_argument(
        "--keep-logs", action="store_true", help="keep the working directory with peer logs (kept anyway on failure)"
    )
    local.add_argument("--json", action="store_true", help="print one JSON summary as the last line")
    local.set_defaults(func=cmd_local)
