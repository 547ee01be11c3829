"""The driver's adaptive in-flight window (issue 27, `peer/inflight.py`): on simulated pipes, in simulated time,
it settles at the pipe's bandwidth-delay product, finds a faster link, and never leaves [1, --max-inflight];
the driver never has more trips out than the window. No wall-clock thresholds anywhere."""

from __future__ import annotations

import asyncio
import heapq
import random
from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace

import pydantic.v1 as pydantic
import pytest
import torch
from builders import stage_record

import peer.driver as driver_module
from peer.driver import Driver
from peer.inflight import InflightWindow, worth_one_more
from peer.stats import Stats
from peer.status_log import driving
from swarm.presets import preset
from swarm.records import StagePeerRecord

TOKENS = 1024


def run_pipe(
    controller: InflightWindow, trips: int, service: Callable[[float], float], delay: Callable[[], float]
) -> list[int]:
    """A driver on a pipe: each trip spends `delay()` seconds on links and idle stages, then queues for the
    slowest stage, which serves one trip at a time for `service(now)` seconds. With constant delay D and
    service c, the pipe saturates at (D + c) / c trips in flight. Returns the window after each completion."""
    now = free = 0.0
    out: list[tuple[float, float]] = []  # (ends, started) of the trips in flight
    windows = []
    for _ in range(trips):
        while len(out) < controller.window:  # a window that shrank leaves the trips already out alone
            free = max(now + delay(), free) + service(now)
            heapq.heappush(out, (free, now))
        ended, started = heapq.heappop(out)
        now = ended
        windows.append(controller.finished(started, ended, TOKENS))
    return windows


def settled(windows: list[int]) -> int:
    """The window most of these completions saw."""
    return Counter(windows).most_common(1)[0][0]


@pytest.mark.parametrize("k", [1, 2, 3, 5, 7])
def test_the_window_settles_at_the_bandwidth_delay_product(k: int):
    """Delay k - 1 and a 1 s bottleneck: k trips fill the pipe. The window climbs there, stays (probing one
    either side now and then: the neighbour is tried, then left), and never leaves [1, max]."""
    controller = InflightWindow(max_window=10)
    windows = run_pipe(controller, 3000, service=lambda now: 1.0, delay=lambda: k - 1.0)
    assert all(1 <= w <= 10 for w in windows)
    late = windows[1000:]
    assert settled(late) == k
    assert set(late) <= {k - 1, k, k + 1}


def test_the_bound_holds_when_the_pipe_wants_more():
    controller = InflightWindow(max_window=3)
    windows = run_pipe(controller, 2000, service=lambda now: 1.0, delay=lambda: 7.0)  # 8 would fill it
    assert all(1 <= w <= 3 for w in windows) and settled(windows[500:]) == 3


def test_a_bound_of_one_is_one_trip_at_a_time():
    controller = InflightWindow(max_window=1)
    assert controller.window == 1
    assert set(run_pipe(controller, 500, service=lambda now: 1.0, delay=lambda: 4.0)) == {1}


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("max_window", [1, 2, 4, 16])
def test_noisy_trips_never_push_the_window_out_of_bounds(seed: int, max_window: int):
    """Service times anywhere in 0.1-6 s (the bottleneck slows and recovers every 50 s), delays in 0-6 s, and then
    completions in any order and at any times (even one before its own start): within bounds throughout."""
    rng = random.Random(seed)
    controller = InflightWindow(max_window=max_window)
    windows = run_pipe(
        controller,
        3000,
        service=lambda now: rng.uniform(0.1, 2.0) * (1 + int(now / 50) % 3),
        delay=lambda: rng.uniform(0.0, 6.0),
    )
    for _ in range(3000):
        started = rng.uniform(0, 1e4)
        windows.append(controller.finished(started, started + rng.uniform(-1.0, 100.0), rng.randrange(1, 5000)))
    assert all(1 <= w <= max_window for w in windows)


def test_a_link_that_got_faster_is_found_by_probing_up():
    """The bottleneck (a link's transfer) drops from 1 s to 0.4 s per trip from the 2000th trip on: with 2 s of
    delay the pipe then fills at 6 trips in flight instead of 3, and the periodic up-probe takes the window there."""
    controller = InflightWindow(max_window=10)
    sent = iter(range(10**6))
    windows = run_pipe(controller, 6000, service=lambda now: 1.0 if next(sent) < 2000 else 0.4, delay=lambda: 2.0)
    assert settled(windows[1000:2000]) == 3 and settled(windows[4000:]) == 6
    assert all(1 <= w <= 10 for w in windows)


def test_a_shorter_pipe_is_found_by_probing_down():
    """The reverse: the delay falls from 5 s to 0 from the 2000th trip on (6 trips fill the pipe, then 1); the
    window comes down, so trips stop holding activations in a queue in front of the bottleneck."""
    controller = InflightWindow(max_window=8)
    sent = iter(range(10**6))
    windows = run_pipe(controller, 6000, service=lambda now: 1.0, delay=lambda: 5.0 if next(sent) < 2000 else 0.0)
    assert settled(windows[1000:2000]) == 6 and settled(windows[4000:]) == 1


def test_one_more_trip_must_carry_half_a_trip_of_throughput():
    assert worth_one_more(2.0, 3.0, 2)  # below the bottleneck a third trip adds a third: kept
    assert not worth_one_more(3.0, 3.0, 3)  # past it, nothing: the fourth trip only queues
    assert not worth_one_more(4.0, 4.4, 4)  # +10% at 4: under the half share (12.5%)
    with pytest.raises(ValueError):
        InflightWindow(max_window=0)


def test_trips_sent_before_a_change_do_not_count_for_the_new_window():
    controller = InflightWindow(max_window=4, start=2, min_trips=2, rounds=1)
    assert controller.finished(0.0, 1.0, TOKENS) == 2 and controller.finished(0.0, 2.0, TOKENS) == 3  # probe up
    for end in (3.0, 4.0, 5.0):  # sent before the probe began: nothing changes however they came back
        assert controller.finished(1.5, end, TOKENS) == 3
    assert controller.origin == (2, TOKENS / 1.0)


class FakeHop:
    """A stage-0 hop whose trips end when the test says so: it records how many were out at each start."""

    def __init__(self):
        self.manifest = preset("tiny", stages=2)
        self.stats, self.label = Stats(), "[test]"
        self.runtime = SimpleNamespace(stage=SimpleNamespace(is_tail=True))  # no pipeline to wait for
        self.out: list[asyncio.Future] = []
        self.at_start: list[tuple[int, int]] = []  # (trips out, the window) as each trip began
        self.driver: Driver | None = None

    async def drive(self, tokens: torch.Tensor) -> None:
        done = asyncio.get_running_loop().create_future()
        self.out.append(done)
        self.at_start.append((len([f for f in self.out if not f.done()]), self.driver.controller.window))
        await done


class Scripted(InflightWindow):
    """A controller whose window follows a script, one value per completed trip (growing and shrinking)."""

    def __init__(self, script: list[int]):
        super().__init__(max_window=max(script))
        self.script = iter(script)

    def finished(self, started: float, ended: float, tokens: int) -> int:
        self.window = next(self.script, self.window)
        return self.window


def test_the_driver_never_has_more_trips_out_than_the_window(monkeypatch):
    """Trips end one at a time, the oldest first, while the window moves up and down: the driver starts a trip
    only below the window, cancels none when it shrinks, and tells `Stats` its window and trips out."""
    batches = SimpleNamespace(batch=lambda n: torch.zeros((n, 8), dtype=torch.long))
    monkeypatch.setattr(driver_module, "load_splits", lambda manifest, data, seed: (batches, batches))
    hop = FakeHop()
    driver = hop.driver = Driver(hop, "self", None, 5, 1.0, fetch_all=None)
    script = [4, 5, 1, 1, 3, 2, 5, 5, 5, 1, 2]
    driver.controller = Scripted(script)
    seen = []

    def out() -> int:
        return len([f for f in hop.out if not f.done()])

    async def scenario() -> None:
        run = asyncio.create_task(driver.run())
        for _ in range(len(script) + 5):
            for _ in range(20):  # turns of the event loop for the driver to catch up, not seconds
                await asyncio.sleep(0)
            seen.append((out(), driver.controller.window, hop.stats.driver_inflight, hop.stats.driver_window))
            next(f for f in hop.out if not f.done()).set_result(None)  # the oldest trip comes back
            await asyncio.sleep(0)
        driver.stop()
        for f in hop.out:
            if not f.done():
                f.set_result(None)
        await run

    asyncio.run(scenario())
    assert all(n <= window for n, window in hop.at_start)
    assert all(n >= window and (n, window) == (told, told_window) for n, window, told, told_window in seen)
    assert any(n > window for n, window, _, _ in seen)  # the window shrank under trips still out: none cancelled
    assert hop.stats.driver_trips == len(hop.out) and driver.inflight == hop.stats.driver_inflight == 0
    assert hop.stats.driver_window == 0  # no longer driving


def test_the_driver_figures_are_announced_and_validated():
    stats = Stats(driver_window=3, driver_inflight=2, driver_trips=4, driver_trip_seconds=6.0)
    assert driving(stats, 2, 3.0) == ", driving 2 of window 3, 1.50 s/trip"
    assert driving(Stats(), 0, 0.0) == ""
    older = stage_record(0).dict()
    for name in ("driver_window", "driver_inflight", "driver_trip_seconds"):
        del older[name]  # a record of a peer from before the fields
    record = StagePeerRecord.parse_obj(older)
    assert (record.driver_window, record.driver_inflight, record.driver_trip_seconds) == (0, 0, 0.0)
    assert StagePeerRecord.parse_obj({**older, "driver_window": 4, "driver_trip_seconds": 1.5}).driver_window == 4
    for bad in (
        {"driver_window": -1},
        {"driver_inflight": 2.0},
        {"driver_trip_seconds": float("inf")},
        {"driver_trip_seconds": -0.5},
        {"driver_window": "4"},
    ):
        with pytest.raises(pydantic.ValidationError):
            StagePeerRecord.parse_obj({**older, **bad})
