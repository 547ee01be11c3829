"""`protocol-swarm local`'s supervision: a dead child fails the run, the tracker is checked by fetching."""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from hivemind.utils.timed_storage import get_dht_time

from launcher.progress import TrackerProbe
from launcher.supervisor import ChildFailed, LocalSwarm, with_stage
from peer.placement import LIVENESS_WINDOW
from swarm.presets import preset
from swarm.records import RECORD_TTL


def test_a_dead_tracker_fails_the_run_with_its_log(tmp_path: Path):
    swarm = LocalSwarm(preset("tiny", stages=2), 0, tmp_path, max_inflight=1, with_tracker=False)
    child = swarm._spawn(
        "tracker", [sys.executable, "-c", "import sys; print('tracker: cannot import something'); sys.exit(1)"]
    )
    child.process.wait(timeout=30)
    with pytest.raises(ChildFailed, match="tracker exited with code 1") as failure:
        swarm.check_children()
    assert "cannot import something" in str(failure.value)
    swarm.stop()


class _FakeTrackerHandler(BaseHTTPRequestHandler):
    """Serves what a tracker serves, or errors, from the server's `behaviour`."""

    def do_GET(self):  # noqa: N802 - http.server's naming
        behaviour = self.server.behaviour
        if behaviour == "broken":
            self.send_response(500)
            self.end_headers()
            return
        if self.path.startswith("/api/v1/swarm"):
            stages = [{"stage": i} for i in range(self.server.num_stages)]
            body = json.dumps({"run_id": self.server.run_id, "healthy": True, "stages": stages}).encode()
            kind = "application/json"
        else:
            body = f"<html><code id='run-id'>{self.server.run_id}</code></html>".encode()
            kind = "text/html"
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def http_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeTrackerHandler)
    server.run_id, server.num_stages, server.behaviour = "abc123", 3, "ok"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_the_probe_counts_only_what_was_served(http_server):
    url = f"http://127.0.0.1:{http_server.server_address[1]}"
    probe = TrackerProbe(url, "abc123", 3)
    probe.probe()
    assert probe.ok and probe.page_fetches == 1 and probe.api_fetches == 1 and probe.healthy_seen

    other_run = TrackerProbe(url, "another", 3)
    other_run.probe()
    assert not other_run.ok and "answered 200" in other_run.last_error

    http_server.behaviour = "broken"
    broken = TrackerProbe(url, "abc123", 3)
    broken.probe()
    assert not broken.ok and "500" in broken.last_error


def test_the_probe_survives_a_tracker_that_is_not_listening():
    probe = TrackerProbe("http://127.0.0.1:9", "abc123", 3)  # the discard port: nothing listens on loopback
    started = time.monotonic()
    probe.probe(timeout=2.0)
    assert not probe.ok and probe.last_error and time.monotonic() - started < 10


def test_with_stage_replaces_only_the_stage_flag():
    argv = ["protocol-peer", "--stage", "1", "--public-name", "x"]
    assert with_stage(argv, "auto") == ["protocol-peer", "--stage", "auto", "--public-name", "x"]
    assert argv[2] == "1"


def _fresh_online(swarm: LocalSwarm) -> dict[str, tuple[int, str]]:
    """{public name: (stage, peer id)} of the online records refreshed within placement's liveness window."""
    now = get_dht_time()
    return {
        e.record.public_name: (stage, e.record.peer_id)
        for stage, entries in swarm.poll().items()
        for e in entries
        if e.record.state == "online" and e.expiration - RECORD_TTL >= now - LIVENESS_WINDOW
    }


def _wait(what: str, seconds: float, check):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_a_killed_peer_is_restarted_and_placed_where_it_is_missing(tmp_path: Path):
    swarm = LocalSwarm(preset("tiny", stages=2), 2, tmp_path, max_inflight=1, with_tracker=False)
    groups: list[int] = []
    try:
        swarm.start()
        groups = [child.process.pid for child in swarm.children]
        before = _wait("two online peers per stage", 240, lambda: len(online := _fresh_online(swarm)) == 4 and online)
        name, stage = swarm.kill_random_peer(swarm.poll(), random.Random(0))
        assert before[name][0] == stage
        lines = _wait("the restart", 30, swarm.heal)
        child = next(c for c in swarm.children if c.name == name)
        assert lines == [f"{name} exited with code -9; restarted it with --stage auto (pid {child.process.pid})"]
        groups.append(child.process.pid)

        def replaced():
            online = _fresh_online(swarm)
            return name in online and online[name][1] != before[name][1] and online[name]

        # --stage auto counts only live records: the killed peer's (alive for 30 s more) must not fill its stage
        assert _wait("the replacement online", 240, replaced)[0] == stage
        assert swarm.heal() == [] and all(c.restarts == (c.name == name) for c in swarm.children)
    finally:
        swarm.stop()
    for group in groups:  # nothing the swarm started outlives it: no peer, DHT process or p2pd
        with pytest.raises(ProcessLookupError):
            os.killpg(group, 0)
