"""Where a trip's time goes at a peer (issue 27): the stage thread's counters and the progress log's split."""

from __future__ import annotations

import asyncio
import time

import torch

from peer.stats import Seconds, Stats
from peer.status_log import time_split, time_sums


def test_the_split_gives_the_thread_share_and_each_wait_per_event():
    before = {"queued": (1.0, 10), "busy": (5.0, 10), "reply": (2.0, 4), "kv": (0.0, 0), "served": (3.0, 4)}
    after = {"queued": (1.2, 14), "busy": (6.5, 14), "reply": (2.8, 6), "kv": (0.0, 0), "served": (4.0, 6)}
    assert time_split(before, after, 3.0) == (
        "stage thread busy 50%, queued 50 ms/job; reply wait 400 ms/trip; K/V wait -; served 500 ms/trip"
    )


def test_an_interval_with_nothing_run_says_nothing():
    sums = time_sums(Stats())
    assert time_split(sums, sums, 2.0) == ""


def test_seconds_sum_their_events():
    spent = Seconds()
    for seconds in (0.25, 0.5):
        spent.add(seconds)
    assert (spent.total, spent.count) == (0.75, 2)


def test_every_stage_thread_job_is_counted_waiting_and_running(tail_runtime):
    """Two jobs at once on the one stage thread: each counted once, the second waits while the first sleeps (its
    wait at least what is left of the first's sleep), and the run time holds both sleeps."""
    runtime = tail_runtime
    queued, busy = (runtime.queued.total, runtime.queued.count), (runtime.busy.total, runtime.busy.count)

    async def both():
        first = asyncio.ensure_future(runtime.run(time.sleep, 0.2))
        await asyncio.sleep(0)  # the first is submitted before the second
        await asyncio.gather(first, runtime.run(time.sleep, 0.1))

    asyncio.run(both())
    assert runtime.queued.count - queued[1] == 2 and runtime.busy.count - busy[1] == 2
    assert runtime.busy.total - busy[0] >= 0.3
    assert runtime.queued.total - queued[0] > 0.0


def test_a_runtime_adds_its_times_to_the_peers_stats():
    from hivemind.dht import DHT

    from peer.runtime import StageRuntime
    from swarm.presets import preset

    stats, dht = Stats(), DHT(start=True)
    runtime = StageRuntime(preset("tiny", stages=2), 1, dht, torch.device("cpu"), "[test stage 1]", stats=stats)
    try:
        asyncio.run(runtime.run(lambda: None))
        assert stats.stage_busy.count == 1 and stats.stage_queued.count == 1
    finally:
        runtime.shutdown()
        dht.shutdown()
