"""The quiet swarm's cuts (issue 13): paced progress records, one DHT traversal for the stage records a reader
needs, and a peer that needs only its neighbouring stages reads only those."""

from __future__ import annotations

import threading
import time

from builders import dht_with_record, tiny_manifest

from peer.progress import PacedEvent


def _wake_times(event: PacedEvent, sets: int, every: float, until: float) -> list[float]:
    """`set` the event `sets` times `every` seconds apart; the times (from the start) a waiter woke up."""
    woke, start, done = [], time.monotonic(), threading.Event()

    def waiter() -> None:
        while not done.is_set():
            if event.wait(0.05):
                event.clear()
                woke.append(time.monotonic() - start)

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    for _ in range(sets):
        event.set()
        time.sleep(every)
    time.sleep(max(0.0, until - (time.monotonic() - start)))
    done.set()
    thread.join()
    return woke


def test_paced_event_wakes_at_most_once_per_interval_and_delivers_the_last_set():
    woke = _wake_times(PacedEvent(0.5), sets=20, every=0.05, until=1.6)
    # 20 sets over 1 s: the first at once, then one per interval (0.5, 1.0), none after the last set's deferral
    assert woke[0] < 0.1
    assert 2 <= len(woke) <= 4, woke
    assert all(b - a >= 0.45 for a, b in zip(woke, woke[1:], strict=False)), woke
    assert woke[-1] >= 0.95  # the sets after the last wake-up were delivered, not dropped


def test_paced_event_set_now_is_immediate():
    event = PacedEvent(60.0)
    event.set()
    event.clear()
    event.set()  # deferred by a minute
    assert not event.wait(0.1)
    event.set_now()
    assert event.wait(0.1)


def test_fetch_stages_reads_every_stage_in_one_traversal_from_any_node(tmp_path):
    """Seven nodes, more than the READ_BEAM nearest asked and the STORE_BEAM asked by a store (b and c store
    last): every node still reads every record."""
    from dhtio.records import READ_BEAM, STORE_BEAM, fetch_stages

    manifest = tiny_manifest(n_layers=3, stages=3)
    first = dht_with_record([], manifest, 0, tmp_path, name="a")
    others = []
    try:
        peers = [str(a) for a in first.get_visible_maddrs()]
        others = [dht_with_record(peers, manifest, None, tmp_path, name=name) for name in ("w", "x", "y", "z")]
        others += [dht_with_record(peers, manifest, 2, tmp_path, name=name) for name in ("b", "c")]
        assert 1 + len(others) > max(READ_BEAM, STORE_BEAM)
        for reader in [first, *others]:
            stages = fetch_stages(reader, manifest)
            assert sorted(stages) == [0, 1, 2]
            assert [e.record.public_name for e in stages[0]] == ["a"]
            assert stages[1] == []
            assert {e.record.public_name for e in stages[2]} == {"b", "c"}
        only = fetch_stages(others[0], manifest, [2, 0])  # a peer of stage 1 reads its neighbours only
        assert sorted(only) == [0, 2] and {e.record.public_name for e in only[2]} == {"b", "c"}
        assert fetch_stages(first, manifest, []) == {}
    finally:
        for dht in [first, *others]:
            dht.shutdown()


def test_a_peer_reads_only_the_stages_next_to_its_own_unless_u_moves():
    from peer.routing import routed_stages

    manifest = tiny_manifest("boundary", n_layers=4, stages=4)
    assert [routed_stages(manifest, i) for i in range(4)] == [[1], [0, 2], [1, 3], [2]]
    moving = tiny_manifest("boundary", n_layers=4, stages=4, subspace_update_interval=5)
    assert routed_stages(moving, 0) == [0, 1, 2, 3]  # the subspace agreement counts every stage's peers


def test_paced_tracker_reports_through_a_paced_event_and_shuts_down_at_once():
    from hivemind.dht import DHT
    from hivemind.optim.progress_tracker import LocalTrainingProgress
    from hivemind.utils import ValueWithExpiration, get_dht_time

    from peer.progress import ALONE_INTERVAL, PacedProgressTracker

    dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        tracker = PacedProgressTracker(dht, "quiet", target_batch_size=64, report_interval=30.0, start=True)
        assert isinstance(tracker.should_report_progress, PacedEvent)
        # its first read (through the narrow DHT view, as every read and store) found nobody: the next read and
        # the reports wait the alone interval
        assert tracker.global_progress.next_fetch_time - get_dht_time() > ALONE_INTERVAL - 2.0
        assert tracker.should_report_progress.interval == ALONE_INTERVAL
        # a read that finds another peer's record: reports every report interval, reads on hivemind's schedule
        other = LocalTrainingProgress(peer_id=b"other", epoch=0, samples_accumulated=3, samples_per_second=1.0,
                                      time=get_dht_time(), client_mode=False)
        found = tracker._parse_swarm_progress_data({b"other": ValueWithExpiration(other.dict(), get_dht_time() + 60)})
        assert found.num_peers == 2 and tracker.should_report_progress.interval == 30.0
        assert tracker._parse_swarm_progress_data({}).num_peers == 1  # alone again
        assert tracker.should_report_progress.interval == ALONE_INTERVAL
        for samples in range(1, 6):
            tracker.report_local_progress(0, samples)
        assert tracker.local_progress.samples_accumulated == 5  # local counters are never delayed
        started = time.monotonic()
        tracker.shutdown(timeout=10.0)
        assert tracker.shutdown_complete.is_set() and time.monotonic() - started < 5.0
    finally:
        dht.shutdown()


def test_a_lone_peer_with_short_epochs_keeps_its_progress_record_fresh_and_a_peer_without_samples_stores_none():
    """A paced report wakes just after an optimizer step (0 samples) nearly every time when epochs are shorter
    than the report interval: the record must still be stored (hivemind's own test skipped it, and a lone tail's
    record went stale for a minute in CI). A peer that steps without ever accumulating samples stores nothing."""
    from hivemind.dht import DHT

    from peer.progress import PacedProgressTracker

    dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    trackers = []
    try:
        for prefix in ("trainer", "idle"):  # one by one, so that the first is shut down if the second fails
            trackers.append(PacedProgressTracker(dht, prefix, target_batch_size=8, report_interval=0.3,
                                                 alone_interval=0.3, metadata_expiration=30.0, start=True))
        trainer = trackers[0]
        for epoch in range(30):  # 10 epochs a second, each ending in a step that reports 0 samples
            trainer.report_local_progress(epoch, 8)
            for tracker in trackers:
                with tracker.pause_updates():
                    tracker.update_epoch(epoch + 1)
            time.sleep(0.1)
        time.sleep(1.0)  # the last paced report, and its store
        found = dht.get("trainer_progress", latest=True)
        epochs = [entry.value["epoch"] for entry in found.value.values()] if found is not None else []
        assert epochs and max(epochs) >= 27, epochs
        assert dht.get("idle_progress", latest=True) is None
    finally:
        for tracker in trackers:
            tracker.shutdown(timeout=10.0)
        dht.shutdown()


def test_a_progress_read_that_finds_no_other_peer_waits_the_alone_interval():
    from hivemind.optim.progress_tracker import GlobalTrainingProgress

    from peer.progress import paced_read

    def read(num_peers: int, next_fetch_time: float) -> GlobalTrainingProgress:
        return GlobalTrainingProgress(3, 40, 64, num_peers, 0, eta_next_epoch=105.0, next_fetch_time=next_fetch_time)

    assert paced_read(read(2, 100.5), 100.0, 10.0).next_fetch_time == 100.5  # others: hivemind's schedule
    assert paced_read(read(1, 100.5), 100.0, 10.0) == read(1, 110.0)  # only itself: not before the interval
    assert paced_read(read(0, 100.5), 100.0, 10.0).next_fetch_time == 110.0  # nothing found
    assert paced_read(read(1, 125.0), 100.0, 10.0).next_fetch_time == 125.0  # hivemind's later read stands


def test_state_donor_declarations_are_paced(monkeypatch):
    """Epochs every 10 ms ask hivemind to re-declare the donor 30 times: one declaration at once, then at most one
    per interval, the last after the last epoch (so its epoch is declared)."""
    import asyncio

    from peer import stage_averagers
    from peer.stage_averagers import SnapshotStateAverager

    monkeypatch.setattr(stage_averagers, "DECLARE_INTERVAL", 0.2)
    averager = SnapshotStateAverager.__new__(SnapshotStateAverager)  # only the pacing, no averager process
    averager._declared_at, averager._declare_pending = -float("inf"), False
    averager._parent_pid = None  # hivemind's __del__ asks whether this process started it

    async def epochs() -> list[float]:
        averager._state_updated, declared, start = asyncio.Event(), [], time.monotonic()

        async def watch() -> None:
            while True:
                await averager._state_updated.wait()
                averager._state_updated.clear()
                declared.append(time.monotonic() - start)

        watcher = asyncio.create_task(watch())
        triggers = []
        for _ in range(30):
            triggers.append(asyncio.create_task(averager._trigger_declare_load_state()))
            await asyncio.sleep(0.01)
        last_epoch = time.monotonic() - start
        await asyncio.gather(*triggers)
        await asyncio.sleep(0.05)
        watcher.cancel()
        return declared, last_epoch

    declared, last_epoch = asyncio.run(epochs())
    assert declared[0] < 0.05 and declared[-1] >= last_epoch, declared
    assert all(b - a >= 0.19 for a, b in zip(declared, declared[1:], strict=False)), declared
