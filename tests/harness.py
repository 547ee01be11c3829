"""Real multi-process swarms for tests: a bootstrap DHT here, `protocol-peer` processes there."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from launcher.supervisor import Child, LocalSwarm
from swarm.manifest import Manifest
from swarm.records import PeerEntry

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {value!r}")


@contextmanager
def swarm_of(
    manifest: Manifest, peers_per_stage: int = 0, extra_peer_args: list[str] | None = None, name: str = "swarm"
) -> Iterator[LocalSwarm]:
    """A LocalSwarm that is always stopped; peer logs are copied to test-artifacts/ on failure."""
    workdir = Path(tempfile.mkdtemp(prefix="protocol-test-"))
    swarm = LocalSwarm(
        manifest,
        peers_per_stage,
        workdir,
        max_inflight=2,
        with_tracker=False,
        extra_peer_args=["--log-interval", "2", *(extra_peer_args or [])],
    )
    failed = True
    try:
        swarm.start()
        yield swarm
        failed = False
    finally:
        swarm.stop()
        if failed:
            target = ARTIFACTS / name
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(workdir, target, ignore=shutil.ignore_patterns("checkpoints"), dirs_exist_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)


def entries_by_name(swarm: LocalSwarm) -> dict[str, PeerEntry]:
    return {e.record.public_name: e for entries in swarm.poll().values() for e in entries}


def online(swarm: LocalSwarm, names: list[str]) -> dict[str, PeerEntry] | None:
    found = entries_by_name(swarm)
    if all(n in found and found[n].record.state == "online" for n in names):
        return found
    return None


def kill_hard(child: Child) -> None:
    """SIGKILL the peer and its DHT process and p2pd: what a crashed machine looks like."""
    os.killpg(child.process.pid, signal.SIGKILL)
    child.process.wait(timeout=10)
