"""The tracker's run-level counters never go back: not when a driver leaves, not across a tracker restart,
and a restart does not count the peers' counters twice, nor takes over another run's (tracker/counters.py,
tracker/history.py)."""

from __future__ import annotations

import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_tracker_swarm import MANIFEST, FakePeer, Tracker, close_all, free_port, get, get_json, wait_for

from swarm.manifest import save_manifest
from swarm.presets import preset
from tracker.counters import advance, counter_gain, forget_oldest
from tracker.history import History


def test_a_counter_gain_is_growth_or_a_restart_from_zero():
    assert counter_gain(None, 500) == 500
    assert counter_gain(400, 500) == 100
    assert counter_gain(500, 500) == 0
    assert counter_gain(500, 120) == 120  # the peer restarted: its new counter counts from zero
    assert counter_gain(None, -7) == 0


def test_totals_keep_what_departed_peers_counted():
    totals, last = advance({}, {}, {"a": {"tokens_trained": 100}, "b": {"tokens_trained": 50}})
    assert totals["tokens_trained"] == 150
    totals, last = advance(totals, last, {"b": {"tokens_trained": 80}})  # a left
    assert totals["tokens_trained"] == 180 and last["a"] == {"tokens_trained": 100}
    totals, last = advance(totals, last, {"a": {"tokens_trained": 130}, "b": {"tokens_trained": 80}})  # a is back
    assert totals["tokens_trained"] == 210  # its counter kept running: only the growth counts
    totals, last = advance(totals, last, {"a": {"tokens_trained": 10}, "b": {"tokens_trained": 90}})  # a restarted
    assert totals["tokens_trained"] == 230
    assert totals["bytes_sent"] == 0 and totals["dense_equivalent_bytes"] == 0


def test_remembered_peers_are_bounded_oldest_first():
    last = {f"p{i}": {"tokens_trained": i} for i in range(10)}
    seen = {f"p{i}": float(i) for i in range(10)}
    assert forget_oldest(last, seen, keep=7) == ["p0", "p1", "p2"]
    assert sorted(last) == sorted(seen) == [f"p{i}" for i in range(3, 10)]
    assert forget_oldest(last, seen, keep=7) == []


def test_counters_persist_in_the_history_file(tmp_path):
    history = History(tmp_path / "h.sqlite", MANIFEST.run_id)
    history.save_counters({"tokens_trained": 42}, {"a": {"tokens_trained": 40}, "b": {"tokens_trained": 2}}, 5.0, [])
    history.save_counters({"tokens_trained": 50}, {"a": {"tokens_trained": 48}}, 6.0, ["b"])
    history.close()
    totals, last, seen = History(tmp_path / "h.sqlite", MANIFEST.run_id).load_counters()
    assert totals == {"tokens_trained": 50} and last == {"a": {"tokens_trained": 48}} and seen == {"a": 6.0}


def _poll_totals(url: str, stop: threading.Event, into: list[int]) -> None:
    while not stop.is_set():
        try:
            into.append(get_json(url + "/api/v1/swarm")["totals"]["tokens_trained"])
        except Exception:  # noqa: BLE001 - the tracker is restarting
            pass
        stop.wait(0.3)


@pytest.mark.slow
def test_a_real_tracker_never_counts_back_nor_twice(tmp_path):
    save_manifest(MANIFEST, tmp_path / "manifest.json")
    tracker = Tracker(tmp_path, free_port())
    peers: list[FakePeer] = []
    stop, seen = threading.Event(), []
    watcher: threading.Thread | None = None
    try:
        tracker.start()
        bootstrap = get_json(tracker.url + "/api/v1/bootstrap")["initial_peers"]
        leaver, stayer = FakePeer(bootstrap, 0, "leaver", 3.0), FakePeer(bootstrap, 0, "stayer", 3.0)
        peers += [leaver, stayer]
        for peer in peers:
            peer.thread.start()
        watcher = threading.Thread(target=lambda: _poll_totals(tracker.url, stop, seen), daemon=True)
        watcher.start()
        wait_for(lambda: get_json(tracker.url + "/api/v1/swarm")["online"]["tokens_trained"] >= 8 * 1024, 30,
                 "both drivers counted")
        leaver.announcing.clear()  # the driver dies: its record expires within 3 s

        def leaver_gone():
            body = get_json(tracker.url + "/api/v1/swarm")
            return len(body["stages"][0]["peers"]) == 1 and body

        body = wait_for(leaver_gone, 20, "the leaver's record to expire")
        assert body["totals"]["tokens_trained"] > body["online"]["tokens_trained"]  # the leaver's tokens stay
        history = get_json(tracker.url + "/api/v1/swarm?history=2000")["history"]
        assert [h["tokens"] for h in history] == sorted(h["tokens"] for h in history)
        families = {f.name: f for f in text_string_to_metric_families(get(tracker.url + "/metrics")[1].decode())}
        assert families["protocol_swarm_tokens_trained"].type == "counter"

        time.sleep(1.0)  # let the tracker credit the stayer's latest record, then restart it
        before = get_json(tracker.url + "/api/v1/swarm")
        tracker.stop()
        tracker.start()

        def stayer_back():
            body = get_json(tracker.url + "/api/v1/swarm")
            return body["online"]["tokens_trained"] > before["online"]["tokens_trained"] and body

        after = wait_for(stayer_back, 30, "the stayer seen again after the restart")
        grew = after["online"]["tokens_trained"] - before["online"]["tokens_trained"]
        # the stayer's growth is counted, its whole counter (>= 4096 tokens) is not counted again
        assert before["totals"]["tokens_trained"] <= after["totals"]["tokens_trained"]
        assert after["totals"]["tokens_trained"] <= before["totals"]["tokens_trained"] + grew + 2 * 1024
        time.sleep(1.0)
    finally:
        stop.set()
        if watcher is not None:
            watcher.join(timeout=10)
        close_all(peers)
        tracker.stop()
    assert len(seen) > 10 and seen == sorted(seen), "the run's tokens counter went back"


@pytest.mark.slow
def test_a_real_tracker_of_another_run_on_the_same_history_starts_from_zero(tmp_path):
    """A tracker started for a new manifest from the same folder and --db reported the earlier run's tokens at
    its first poll, its loss chart began with that run's and it dialled that run's peers; now it starts from
    zero, and the first run's tracker, started again, resumes its own count."""
    save_manifest(MANIFEST, tmp_path / "manifest.json")
    tracker = Tracker(tmp_path, free_port())
    peers: list[FakePeer] = []
    try:
        tracker.start()
        bootstrap = get_json(tracker.url + "/api/v1/bootstrap")["initial_peers"]
        peers.append(FakePeer(bootstrap, 0, "driver", 3.0))
        peers[0].thread.start()
        first = wait_for(
            lambda: (body := get_json(tracker.url + "/api/v1/swarm"))["totals"]["tokens_trained"] >= 4096 and body,
            30,
            "run A's driver counted",
        )
        tracker.stop()

        other = preset("tiny", stages=2)
        save_manifest(other, tmp_path / "manifest.json")  # another run, started from the same folder
        tracker.start()
        assert get_json(tracker.url + "/api/v1/run")["run_id"] == other.run_id
        body = get_json(tracker.url + "/api/v1/swarm?history=2000")
        assert body["totals"]["tokens_trained"] == 0 and body["totals"]["bytes_sent"] == 0
        assert body["history"] and all(row["tokens"] == 0 and row["loss"] is None for row in body["history"])
        log = tracker.log.read_text()
        assert "the file keeps 1 other run(s) apart" in log and "remembered peer addresses" not in log
        tracker.stop()

        save_manifest(MANIFEST, tmp_path / "manifest.json")
        tracker.start()
        resumed = get_json(tracker.url + "/api/v1/swarm?history=2000")
        assert resumed["totals"]["tokens_trained"] >= first["totals"]["tokens_trained"]
        assert any(row["tokens"] >= 4096 for row in resumed["history"])
    finally:
        close_all(peers)
        tracker.stop()
