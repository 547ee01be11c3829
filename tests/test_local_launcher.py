"""`protocol-swarm local`'s supervision: a dead child fails the run, the tracker is checked by fetching."""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from launcher.progress import TrackerProbe
from launcher.supervisor import ChildFailed, LocalSwarm
from swarm.presets import preset


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
