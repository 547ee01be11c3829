"""The supervisor of a swarm on this machine: a bootstrap DHT node here, tracker and peers as processes.

Peers and the tracker are separate programs, started as commands (`protocol-peer`,
`protocol-tracker`) in process groups of their own, so whatever a child leaves below it (hivemind's
DHT and averager processes, p2pd) can be killed with it. Stopping is upstream first (`LocalSwarm.stop`):
a signal to a peer's whole group would reach its p2pd too, which exits at once, so the peer's trips
still in flight, its last announce and its averagers' shutdown would all fail; only the peer itself is
signalled, and it stops what runs below it in order. Every child's $TMPDIR is a directory of the swarm's
own, removed when it stops, so the hivemind sockets of a peer that was killed (`p2pio/sockets.py`) go
too. Used by `protocol-swarm local` (`launcher/local.py`), the multi-process tests (`tests/harness.py`) and
the benchmarks.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hivemind.utils.timed_storage import get_dht_time

from dhtio.identity import load_or_create_rsa_key
from dhtio.records import fetch_stages
from dhtio.validators import make_validators
from p2pio.sockets import make_socket_dir, sockets_in
from swarm.context_parallel import kv_bytes_per_token
from swarm.manifest import Manifest, save_manifest
from swarm.records import ANNOUNCE_INTERVAL, RECORD_TTL, PeerEntry

MAX_RESTARTS = 100  # a peer restarted this often is broken, not unlucky
# a peer told to stop exits within 25 s whatever hangs (peer/daemon.py HARD_EXIT_AFTER): the wait for each wave
EXIT_GRACE = 30.0


class LocalSwarmError(RuntimeError):
    pass


class ChildFailed(LocalSwarmError):
    """A child process exited during the run: its log, and the working directory, are evidence to keep."""


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    log: Path
    argv: list[str] = field(default_factory=list)
    restarts: int = 0


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
        max_inflight: int | None,
        with_tracker: bool = True,
        extra_peer_args: list[str] | None = None,
    ):
        self.manifest, self.peers_per_stage, self.workdir = manifest, peers_per_stage, workdir
        self.max_inflight, self.with_tracker = max_inflight, with_tracker
        self.extra_peer_args = extra_peer_args or []
        self.children: list[Child] = []
        self.dht = None
        self.tmpdir: Path | None = None  # the children's $TMPDIR and the bootstrap DHT's sockets (`private_dir`)
        self.tracker_url: str | None = None
        self.manifest_path = workdir / "manifest.json"

    def _spawn(self, name: str, argv: list[str]) -> Child:
        log = self.workdir / f"{name}.log"
        child = Child(name, self._popen(argv, log, "wb"), log, argv)
        self.children.append(child)
        return child

    def _popen(self, argv: list[str], log: Path, mode: str) -> subprocess.Popen:
        with log.open(mode) as handle:
            return subprocess.Popen(
                argv,
                stdout=handle,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=self._child_env(),
            )

    def _child_env(self) -> dict[str, str]:
        """Many processes share this machine's cores: one torch thread each avoids oversubscription. The
        temporary files of every child (its hivemind sockets, a peer's throwaway identity) go in the swarm's
        private directory, so what a killed child could not remove is removed when the swarm stops."""
        tmpdir = str(self.private_dir())
        return {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": tmpdir}

    def private_dir(self) -> Path:
        """The swarm's private temporary directory (made on first use, removed by `stop`), short enough that
        each child's own socket directory inside it still makes valid unix socket paths."""
        if self.tmpdir is None:
            self.tmpdir = make_socket_dir(nested=1)
        return self.tmpdir

    def start(self) -> None:
        from hivemind.dht import DHT

        save_manifest(self.manifest, self.manifest_path)
        _, validators = make_validators(self.manifest, load_or_create_rsa_key(None))
        with sockets_in(self.private_dir()):  # the DHT process forked here keeps it; this one (a test's) does not
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
                    "--db",  # in the run's working directory: a throwaway run leaves no file in the user's data dir
                    str(self.workdir / "tracker.sqlite"),
                    "--identity",
                    str(self.workdir / "tracker.id"),
                    "--initial-peers",
                    *bootstrap,
                ],
            )
            self.tracker_url = f"http://127.0.0.1:{port}"
        lanes = self.manifest.lanes  # with context parallelism, peers_per_stage peers on every lane of a stage
        for stage in range(self.manifest.num_stages):
            for slot in range(self.peers_per_stage * lanes):
                lane = ["--lane", str(slot % lanes)] if lanes > 1 else []
                self.spawn_peer(f"stage{stage}-peer{slot}", str(stage), lane)

    @property
    def bootstrap(self) -> list[str]:
        return [str(a) for a in self.dht.get_visible_maddrs()]

    def spawn_peer(self, name: str, stage: str, extra_args: list[str] | None = None,
                   program: list[str] | None = None) -> Child:
        """A peer of this swarm: `protocol-peer`, or `program` taking its arguments (a test's hostile peer)."""
        peer = shutil.which("protocol-peer")
        if program is None and peer is None:
            raise LocalSwarmError("protocol-peer is not installed (pip install -e .)")
        return self._spawn(
            name,
            [
                *(program or [peer]),
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
                *(["--max-inflight", str(self.max_inflight)] if self.max_inflight is not None else []),
                "--device",
                "cpu",
                "--checkpoint-dir",
                str(self.workdir / "checkpoints" / name),
                *self.extra_peer_args,
                *(["--heartbeat-file", str(self.heartbeat(name))] if self.manifest.lanes > 1 else []),
                *(extra_args or []),
            ],
        )

    def heartbeat(self, name: str) -> Path:
        """The heartbeat file of peer `name` (context parallelism only: it carries the peer's K/V bytes)."""
        return self.workdir / f"{name}.heartbeat.json"

    def cp_bytes_per_token(self) -> float | None:
        """K/V bytes per token of the whole sequence, from the peers' heartbeats (`kv_bytes_per_token`): None
        until every lane has finished a trip; a restarted peer's counts start over."""
        beats = []
        for child in self.children:
            try:
                beats.append(json.loads(self.heartbeat(child.name).read_text()))
            except (OSError, ValueError):
                continue  # the tracker, or a peer that has not written one yet
        return kv_bytes_per_token(beats, self.manifest.lanes)

    def check_children(self) -> None:
        """Any child that exits before the end fails the run: a dead peer stalls its stage, a dead
        tracker takes the status page with it."""
        for child in self.children:
            code = child.process.poll()
            if code is not None:
                tail = child.log.read_text(errors="replace")[-2000:]
                raise ChildFailed(f"{child.name} exited with code {code}; its log ends:\n{tail}")

    def heal(self) -> list[str]:
        """Restart every peer that exited, with `--stage auto` (placement sends it where a peer is missing),
        its log appended to; returns one line per restart. A dead tracker still fails the run (the status
        page is what a newcomer watches), and so does a peer that keeps dying (`MAX_RESTARTS`)."""
        lines = []
        for child in self.children:
            code = child.process.poll()
            if code is None:
                continue
            tail = child.log.read_text(errors="replace")[-2000:]
            if child.name == "tracker" or child.restarts >= MAX_RESTARTS:
                raise ChildFailed(
                    f"{child.name} exited with code {code} (restarts {child.restarts}); its log ends:\n{tail}"
                )
            _signal_group(child.process, signal.SIGKILL)  # whatever it left in its group (DHT child, p2pd) goes too
            argv = with_stage(child.argv, "auto")
            child.process, child.argv, child.restarts = self._popen(argv, child.log, "ab"), argv, child.restarts + 1
            lines.append(
                f"{child.name} exited with code {code}; restarted it with --stage auto (pid {child.process.pid})"
            )
        return lines

    def kill_random_peer(self, stages: dict[int, list[PeerEntry]], rng: random.Random) -> tuple[str, int] | None:
        """SIGKILL (the whole process group of) a random running peer whose stage has another online peer,
        as a volunteer's machine vanishes; returns its name and stage, or None when every stage has one peer."""
        # announced within two announce periods: a killed peer's record stops being refreshed, though it lives on
        fresh = get_dht_time() + RECORD_TTL - 2 * ANNOUNCE_INTERVAL
        online = {
            e.record.public_name: stage
            for stage, entries in stages.items()
            for e in entries
            if e.record.state == "online" and e.expiration >= fresh
        }
        per_stage = {stage: list(online.values()).count(stage) for stage in set(online.values())}
        victims = [
            c
            for c in self.children
            if c.name != "tracker" and c.process.poll() is None and per_stage.get(online.get(c.name, -1), 0) > 1
        ]
        if not victims:
            return None
        victim = rng.choice(victims)
        _signal_group(victim.process, signal.SIGKILL)
        victim.process.wait(timeout=10)
        return victim.name, online[victim.name]

    def poll(self) -> dict[int, list[PeerEntry]]:
        return fetch_stages(self.dht, self.manifest)

    def stop(self) -> None:
        """Stop every child upstream first (`stop_waves`), then the bootstrap DHT, and remove the private directory
        with whatever a killed child left there."""
        for process in stop_in_waves(self.stop_waves(), grace=EXIT_GRACE):
            print(f"warning: pid {process.pid} did not exit after SIGKILL", file=sys.stderr)
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None

    def stop_waves(self) -> list[list[subprocess.Popen]]:
        """The children in the order they are stopped: the peers of stage 0 (the drivers, which stop starting
        trips and wait for theirs to come back), then each stage after, then the tracker. A peer is stopped
        only when every peer upstream of it has exited, so no trip is in flight through it any more: none is cut
        by the stop and counted as an error, and none is refused because its next hop is leaving. A peer's stage
        is the one its freshest record names (a peer restarted with `--stage auto` may serve another), else its
        `--stage` flag; one that never joined a stage goes first, with the drivers."""
        announced: dict[str, int] = {}
        if self.dht is not None:
            try:
                entries = [e for stage in self.poll().values() for e in stage]
            except Exception as exc:  # noqa: BLE001 - hivemind raises bare errors; the flags still give an order
                print(f"warning: could not read the stages to stop upstream first: {exc}", file=sys.stderr)
                entries = []
            for entry in sorted(entries, key=lambda e: e.expiration):  # the freshest record wins
                announced[entry.record.public_name] = entry.record.stage
        waves: dict[int, list[subprocess.Popen]] = {}
        tracker = []
        for child in self.children:
            if child.name == "tracker":
                tracker.append(child.process)
                continue
            flag = child.argv[child.argv.index("--stage") + 1] if "--stage" in child.argv else ""
            stage = announced.get(child.name, int(flag) if flag.isdigit() else 0)
            waves.setdefault(stage, []).append(child.process)
        return [waves[stage] for stage in sorted(waves)] + [tracker]


def with_stage(argv: list[str], stage: str) -> list[str]:
    """`argv` with the value of its `--stage` flag replaced by `stage`."""
    out = list(argv)
    out[out.index("--stage") + 1] = stage
    return out


def stop_process_groups(processes: list[subprocess.Popen], grace: float) -> list[subprocess.Popen]:
    """Stop `processes` all at once (`stop_in_waves` with one wave)."""
    return stop_in_waves([processes], grace)


def stop_in_waves(waves: list[list[subprocess.Popen]], grace: float) -> list[subprocess.Popen]:
    """Wave after wave: SIGTERM the processes of the wave and wait up to `grace` seconds for them to exit. Then
    SIGKILL every process group (hivemind's DHT process and p2pd may outlive their parent). Returns the
    processes still alive after that.

    SIGTERM goes to the process alone, not its group: p2pd exits at once on a signal, so a peer signalled with
    its group would lose its libp2p daemon while it still drains its trips, announces it is leaving and shuts
    its averagers down; signalled alone, it stops them in order itself (peer/processes.py)."""
    for wave in waves:
        for process in wave:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)  # a no-op for a process already reaped
        deadline = time.monotonic() + grace
        for process in wave:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    survivors = []
    for process in (process for wave in waves for process in wave):
        _signal_group(process, signal.SIGKILL)  # also when the leader has exited: its group may not have
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
