"""Real peers that know only the tracker's URL: they take manifest and bootstrap from it and show up on it."""

from __future__ import annotations

import json
import shutil
import urllib.request

import pytest
from harness import swarm_of, wait_for

from launcher.supervisor import free_port
from swarm.presets import preset

pytestmark = pytest.mark.slow


def get_json(url: str):
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())
    except OSError:
        return None


def test_peers_join_through_the_tracker_and_appear_on_it():
    manifest = preset("tiny", stages=2)
    with swarm_of(manifest, name="via-tracker") as swarm:
        # start the tracker the way `protocol-swarm local` does, then peers with nothing but its URL
        tracker = shutil.which("protocol-tracker")
        port = free_port()
        swarm._spawn("tracker", [tracker, "--manifest", str(swarm.manifest_path), "--host", "127.0.0.1",
                                 "--port", str(port), "--db", str(swarm.workdir / "t.sqlite"),
                                 "--identity", str(swarm.workdir / "t.id"), "--initial-peers", *swarm.bootstrap])
        url = f"http://127.0.0.1:{port}"
        run = wait_for(lambda: get_json(f"{url}/api/v1/run"), 90, "the tracker to answer")
        assert run["run_id"] == manifest.run_id
        peer = shutil.which("protocol-peer")
        for name, stage in (("t0", "0"), ("t1", "1")):
            swarm._spawn(name, [peer, "--tracker", url, "--stage", stage, "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                                "--public-name", name, "--device", "cpu", "--log-interval", "2"])

        def healthy():
            state = get_json(f"{url}/api/v1/swarm")
            return state if state and state["healthy"] else None

        state = wait_for(healthy, 150, "the tracker to see a healthy swarm")
        names = {p["public_name"] for stage in state["stages"] for p in stage["peers"]}
        assert {"t0", "t1"} <= names

        def trained():
            summary = get_json(f"{url}/api/v1/swarm")
            return summary and summary["totals"]["tokens_trained"] > 0

        wait_for(trained, 120, "tokens trained to show on the tracker")
