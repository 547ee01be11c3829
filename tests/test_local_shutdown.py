"""`protocol-swarm local` ends clean: stopped upstream first, no trip counted as an error by the stop itself, and
no hivemind socket left in /tmp by any process of the run (launcher/supervisor.py, peer/processes.py,
p2pio/sockets.py)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from builders import stage_record
from harness import wait_for
from hivemind.p2p import P2P

import peer.driver as driver_module
from launcher.supervisor import LocalSwarm
from p2pio.sockets import remove_own_socket_dir, use_own_socket_dir
from peer.driver import Driver
from peer.processes import exit_now
from peer.routing import Router
from peer.trip import Stats
from swarm.manifest import save_manifest
from swarm.presets import preset
from swarm.records import PeerEntry
from swarm.wire import ErrorCode

# a child that notes (name, what, monotonic time) when it is ready, gets SIGTERM and exits; its forked
# grandchild, in the same process group, notes a SIGTERM if one ever reaches it
_CHILD = """
import os, signal, sys, time
log, name = sys.argv[1], sys.argv[2]
def note(what):
    with open(log, "a") as out:
        out.write(f"{name} {what} {time.monotonic()}\\n")
if os.fork() == 0:
    signal.signal(signal.SIGTERM, lambda *_: note("grandchild-got-SIGTERM"))
    note("grandchild-ready")
    while True:
        time.sleep(1)
def leave(*_):
    note("SIGTERM")
    time.sleep(0.3)
    note("exit")
    os._exit(0)
signal.signal(signal.SIGTERM, leave)
note("ready")
while True:
    time.sleep(1)
"""


def test_children_are_stopped_upstream_first_and_alone(tmp_path: Path):
    """Stage 0 (and a peer that never joined a stage) first, each stage only once the one before has exited,
    the tracker last; SIGTERM reaches the child alone, never what runs in its process group (a peer's p2pd),
    which is SIGKILLed at the end."""
    swarm = LocalSwarm(preset("tiny", stages=2), 0, tmp_path, max_inflight=1, with_tracker=False)
    log = tmp_path / "events"
    for name, stage in (("tracker", None), ("stage1-peer0", "1"), ("stage0-peer0", "0"), ("newcomer", "auto")):
        flags = ["--stage", stage] if stage is not None else []
        swarm._spawn(name, [sys.executable, "-c", _CHILD, str(log), name, *flags])
    groups = [child.process.pid for child in swarm.children]
    wait_for(lambda: log.exists() and log.read_text().count("ready") == 8, 30, "every child and grandchild ready")
    swarm.stop()
    events = [line.split() for line in log.read_text().splitlines()]
    assert not [e for e in events if e[1] == "grandchild-got-SIGTERM"], events
    at = {(name, what): float(when) for name, what, when in events}
    for first in ("stage0-peer0", "newcomer"):
        assert at[(first, "exit")] <= at[("stage1-peer0", "SIGTERM")], events
    assert at[("stage1-peer0", "exit")] <= at[("tracker", "SIGTERM")], events
    wait_for(lambda: not any(map(_group_alive, groups)), 10, "the grandchildren to go with their groups")


def _group_alive(group: int) -> bool:
    """Whether process group `group` still has a member (a SIGKILLed orphan lasts until init reaps it)."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def _hivemind_sockets() -> set[Path]:
    return set(Path("/tmp").glob("hivemind-p2p*"))


def _listening(path: Path) -> bool:
    """Whether a process still accepts connections on the unix socket `path` (then it is not a leftover)."""
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def _left_behind(before: set[Path]) -> set[Path]:
    """hivemind socket files in /tmp that appeared since `before` and that nobody listens on: leftovers. One a live
    process listens on belongs to something else running on this machine (every process of the run is gone)."""
    return {path for path in _hivemind_sockets() - before if not _listening(path)}


@pytest.fixture
def short_tmpdir() -> Iterator[Path]:
    """A $TMPDIR for the processes a test starts, short enough for unix socket paths under it."""
    path = Path(tempfile.mkdtemp(prefix="pst-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _sockets_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.name.startswith("hivemind-") or p.name.startswith("protocol-p2p-")]


@pytest.mark.slow
def test_a_local_run_counts_no_errors_and_leaves_no_socket(short_tmpdir: Path):
    before = _hivemind_sockets()
    result = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "local", "--stages", "2", "--steps", "10", "--json", "--keep-logs",
         "--timeout", "600"],
        capture_output=True, text=True, timeout=700, env={**os.environ, "TMPDIR": str(short_tmpdir)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["steps"] >= 10 and {p["stage"] for p in summary["peers"]} == {0, 1}
    workdir = Path(summary["workdir"])
    logs = {name: (workdir / f"{name}.log").read_text(errors="replace") for name in ("stage0-peer0", "stage1-peer0")}
    warnings = [line for text in logs.values() for line in text.splitlines() if " WARN " in line or "ERROR" in line]
    # a clean run: no trip refused at start-up (every hop knew the one before it when the first trip came) ...
    assert [p["errors"] for p in summary["peers"]] == [0, 0], (summary["peers"], warnings[-20:])
    # ... nor cut at the end: the driver stopped first and its trips came back before the tail was stopped
    left = {
        name: re.findall(r"left the stage \(trips \d+, tokens \d+, errors (\S+), failed while leaving (\d+)\)", text)
        for name, text in logs.items()
    }
    both = "\n".join(text[-2500:] for text in logs.values())
    assert [found[0][0] for found in left.values() if len(found) == 1] == ["0", "0"], both  # errors up to the exit
    # the tail was stopped once the driver had exited: nothing reached it, nothing failed, while it left
    assert left["stage1-peer0"] == [("0", "0")], both
    # the driver's last trips came back: its own p2pd was up (no FileNotFoundError on its socket, no listener closed
    # under its averagers) and its next hop was not leaving. (A trip may still meet the odd libp2p stream reset
    # while it drains, retried, as at any time: counted as failed while leaving, not as an error.)
    for symptom in ("FileNotFoundError", "(leaving:", "error accepting connection", "Traceback"):
        assert symptom not in both, both
    # every process of the run removed its own hivemind sockets: none in /tmp, none under the run's $TMPDIR
    assert _left_behind(before) == set()
    assert _sockets_under(short_tmpdir) == []


def _peer(manifest: Path, tmpdir: Path, log: Path, *args: str) -> subprocess.Popen:
    """`protocol-peer` on loopback with `tmpdir` as its $TMPDIR, its output in `log`."""
    with log.open("wb") as out:
        return subprocess.Popen(
            ["protocol-peer", "--manifest", str(manifest), "--device", "cpu", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
             *args],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmpdir)},
        )


@pytest.mark.slow
def test_a_peer_removes_its_sockets_when_it_cannot_join_and_when_it_is_stopped(short_tmpdir: Path):
    manifest, log = short_tmpdir / "manifest.json", short_tmpdir / "peer.log"
    save_manifest(preset("tiny", stages=1), manifest)
    before = _hivemind_sockets()
    # an exception during start: the DHT cannot bootstrap (nothing listens there)
    lonely = _peer(manifest, short_tmpdir, log, "--initial-peers",
                   "/ip4/127.0.0.1/tcp/9/p2p/QmTNf8ZjWrRkjtKvDecdpnNxr4FQXDAEmdyqj31kDQmcCt")
    assert lonely.wait(timeout=120) == 2 and "could not join the DHT" in log.read_text(), log.read_text()[-2000:]
    assert _sockets_under(short_tmpdir) == []
    # a stop signal to a peer that serves (alone, its one stage: it drives and trains)
    peer = _peer(manifest, short_tmpdir, log, "--new-swarm", "--stage", "0")
    try:
        wait_for(lambda: " online: " in log.read_text(errors="replace"), 180, "the peer online")
        assert [p.name for p in short_tmpdir.iterdir() if p.name.startswith("protocol-p2p-")], "no socket directory"
        peer.send_signal(signal.SIGTERM)
        peer.wait(timeout=60)
    finally:
        if peer.poll() is None:
            os.killpg(peer.pid, signal.SIGKILL)
    text = log.read_text(errors="replace")
    assert peer.returncode == 0 and "left the stage" in text, text[-3000:]
    assert _sockets_under(short_tmpdir) == []
    assert _left_behind(before) == set()


def _forked(child) -> int:
    """Run `child()` in a forked process (it must end the process itself); its exit status."""
    pid = os.fork()
    if pid == 0:
        try:
            child()
        finally:
            os._exit(99)  # reached only if `child` did not end the process
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_hard_exit_with_a_live_daemon_removes_its_sockets(tmp_path: Path):
    """The exit without leaving in order (a second Ctrl-C, the hard-exit timer) kills the p2pd still running
    below and removes the directory of its sockets, which hivemind itself would have left in /tmp."""
    found = tmp_path / "found"

    def child() -> None:
        directory = use_own_socket_dir()

        async def start() -> None:
            p2p = await P2P.create()
            await (await P2P.replicate(p2p.daemon_listen_maddr)).add_binary_stream_handler("x", lambda *_: None)
            found.write_text(json.dumps([str(directory), sorted(p.name for p in directory.iterdir())]))

        asyncio.new_event_loop().run_until_complete(start())
        exit_now(3)

    assert _forked(child) == 3
    directory, names = json.loads(found.read_text())
    assert {n.split("-")[1] for n in names} == {"p2pd", "p2pclient"}, names  # hivemind put them in ours
    assert not Path(directory).exists()


def test_the_socket_directory_is_removed_only_by_its_maker(tmp_path: Path):
    """A process forked from the one that made the directory (hivemind's DHT and averagers) cannot remove it,
    and removing it in the maker puts hivemind's own prefix back."""
    default = P2P._UNIX_SOCKET_PREFIX
    directory = use_own_socket_dir()
    try:
        assert use_own_socket_dir() == directory and P2P._UNIX_SOCKET_PREFIX == f"/unix{directory}/hivemind-"

        def child() -> None:
            remove_own_socket_dir()
            os._exit(0 if directory.exists() else 1)

        assert _forked(child) == 0 and directory.exists()
    finally:
        remove_own_socket_dir()
    assert not directory.exists() and P2P._UNIX_SOCKET_PREFIX == default


def test_the_first_trip_waits_for_a_whole_pipeline_that_stopped_growing(monkeypatch):
    """The driver's first trip waits for a peer in every stage after it, then for `SETTLE` seconds without a new
    one, so each hop has read the hop before it (no `unknown_sender` refusal of the first trips)."""
    monkeypatch.setattr(driver_module, "SETTLE", 1.5)
    manifest = preset("tiny", stages=3)
    started = time.monotonic()

    async def fetch_all() -> dict:
        elapsed = time.monotonic() - started

        def peer(stage: int, name: str) -> PeerEntry:
            return PeerEntry(stage_record(stage, name, manifest), 0.0, b"")

        stages = {1: [peer(1, "a1")], 2: []}
        if elapsed > 0.5:  # stage 2 gets its peer at the second read (1 s in), a second stage-1 peer 3 s in
            stages[2].append(peer(2, "a2"))
        if elapsed > 2.5:
            stages[1].append(peer(1, "b1"))
        return stages

    hop = SimpleNamespace(
        label="[test]",
        manifest=manifest,
        router=Router(manifest.t_fixed_sha256, "self"),
        fetch=fetch_all,
        runtime=SimpleNamespace(stage=SimpleNamespace(is_tail=False)),
    )
    asyncio.run(Driver(hop, "self", None, 1, 1.0, fetch_all)._wait_for_pipeline())
    waited = time.monotonic() - started
    assert 3.0 + 1.5 <= waited < 3.0 + 1.5 + 2.5  # from the last new peer on, not from the first whole pipeline
    assert {e.record.public_name for e in hop.router.stages[1]} == {"a1", "b1"}  # the router starts from a fresh read


def test_what_fails_while_a_peer_leaves_is_not_an_error():
    stats = Stats()
    stats.error(ErrorCode.UNREACHABLE)
    stats.leaving = True  # `PeerDaemon.leave`: the trips it cuts, and those its dead p2pd fails, are the stop's doing
    stats.error(ErrorCode.UNREACHABLE)
    stats.error(ErrorCode.LEAVING)
    assert dict(stats.errors) == {"unreachable": 1} and stats.leaving_failures == 2
