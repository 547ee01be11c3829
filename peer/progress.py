"""hivemind's progress tracker, reporting per time interval instead of per microbatch.

hivemind's `ProgressTracker` stores this peer's progress record in the DHT every time the optimizer
reports progress, that is after every microbatch and at every epoch: with fast microbatches that is
several signed DHT stores a second per peer, for a record whose readers extrapolate it anyway (a
record carries samples/s and its time, and `ProgressTracker._parse_swarm_progress_data` estimates
the samples accumulated since). `PacedProgressTracker` lets at most one report start per `interval`
seconds; a report asked for sooner is made when the interval ends, with the latest numbers, so
the record is never more than `interval` late. The tracker reads its own progress from its
counters, not from its (possibly older) record. The cost: other peers of the stage notice this
peer's progress (and a new epoch) up to `interval` later.

Reads are bounded by time too. hivemind reads the stage's progress on a schedule of its estimate of
the epoch's end (every 0.5 s with short epochs; `min_refresh_period`, which the peer sets to the
report interval), even when the read finds no peer but this one, whose own progress it already
knows. While the last read found nobody else, reads and reports are `ALONE_INTERVAL` apart: a peer
alone in its stage reads and stores its progress every 10 s, not every 2. The cost: a newcomer to
the stage is seen by the old peer up to 10 s later, and sees the old peer's progress up to 10 s old
(its epoch comes with the state it downloads), so the first epochs' averaging may start without the
old peer. Each read and store asks as few DHT nodes as the stage records' do (`dhtio.records`
`READ_BEAM`, `STORE_BEAM`): every node asked answers with every peer's signed progress record.

Which reports are stored. hivemind's reporter stores a record only from a peer "in step and reporting
samples", judged at the moment it wakes: samples accumulated then, or at a wake within the last epoch.
A paced wake often comes just after an optimizer step, with 0 samples, so a peer alone in its stage
with sub-second epochs skipped store after store until its record expired, and readers saw the
stage at epoch 0 or not at all (a CI failure: no fresh record for 60 s). Here the test is whether
the peer accumulated samples in its current epoch or the one before, counted when the samples are
reported: an auxiliary peer, which never accumulates any, still never stores a record.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

from hivemind.optim.progress_tracker import GlobalTrainingProgress, ProgressTracker
from hivemind.utils import ValueWithExpiration, get_dht_time

from dhtio.records import READ_BEAM, STORE_BEAM

PROGRESS_INTERVAL = 2.0  # seconds between two progress records of one peer, at most one in between
ALONE_INTERVAL = 10.0  # seconds between progress reads, and between reports, while no other peer is seen


class PacedEvent(threading.Event):
    """A `threading.Event` whose `set` wakes the waiter at most once per `interval` seconds.

    A `set` within the interval after the last one is deferred to the interval's end (one timer at
    a time); `set_now` wakes the waiter at once (shutdown)."""

    def __init__(self, interval: float):
        super().__init__()
        self.interval = interval
        self._last = -float("inf")
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def set(self) -> None:
        with self._lock:
            delay = self._last + self.interval - time.monotonic()
            if delay <= 0:
                self._fire_locked()
            elif self._timer is None:
                self._timer = threading.Timer(delay, self._deferred)
                self._timer.daemon = True
                self._timer.start()

    def set_now(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._fire_locked()

    def _deferred(self) -> None:
        with self._lock:
            self._fire_locked()

    def _fire_locked(self) -> None:
        self._timer, self._last = None, time.monotonic()
        super().set()


def paced_read(progress: GlobalTrainingProgress, now: float, alone_interval: float) -> GlobalTrainingProgress:
    """`progress` as a read parsed it, its next read no sooner than `alone_interval` after `now` when the read
    found no peer but this one (`num_peers` counts this one: its own record is always part of the read)."""
    if progress.num_peers > 1:
        return progress
    return dataclasses.replace(progress, next_fetch_time=max(progress.next_fetch_time, now + alone_interval))


class NarrowDHT:
    """The DHT as the progress tracker uses it, its reads and stores asking as few nodes as stage records do."""

    def __init__(self, dht):
        self._dht = dht

    def __getattr__(self, name: str):
        return getattr(self._dht, name)

    def get(self, key, latest: bool = False, return_future: bool = False, **kwargs):
        return self._dht.get(key, latest=latest, return_future=return_future, **{"beam_size": READ_BEAM, **kwargs})

    def store(self, *args, **kwargs):
        return self._dht.store(*args, **{"beam_size": STORE_BEAM, **kwargs})


class PacedProgressTracker(ProgressTracker):
    """`ProgressTracker` whose reports are paced by `PacedEvent`, and reads by time (see the module docstring)."""

    def __init__(
        self,
        dht,
        *args,
        report_interval: float = PROGRESS_INTERVAL,
        alone_interval: float = ALONE_INTERVAL,
        **kwargs,
    ):
        self._report_interval, self._alone_interval = report_interval, alone_interval
        self._alone = True  # until a read finds another peer
        self._sample_epoch = -float("inf")  # the last local epoch in which this peer reported samples
        super().__init__(NarrowDHT(dht), *args, **kwargs)

    def _current_report_interval(self) -> float:
        return self._alone_interval if self._alone else self._report_interval

    def __setattr__(self, name, value):
        # hivemind creates the event in __init__ just before starting the reporter thread: swap it there
        if name == "should_report_progress":
            value = PacedEvent(self._current_report_interval())
        super().__setattr__(name, value)

    def _parse_swarm_progress_data(self, metadata):
        # our own record in the DHT may be up to an interval old: read our progress from our counters instead,
        # or the stale record would pull the stage's sample count (and so the epoch's end) back
        if isinstance(metadata, dict):
            own = ValueWithExpiration(self.local_progress.dict(), get_dht_time() + self.metadata_expiration)
            metadata = {**metadata, self._local_public_key: own}
        progress = paced_read(super()._parse_swarm_progress_data(metadata), get_dht_time(), self._alone_interval)
        self._alone = progress.num_peers <= 1
        event = self.__dict__.get("should_report_progress")  # absent during hivemind's __init__ (its first read)
        if isinstance(event, PacedEvent):
            event.interval = self._current_report_interval()
        return progress

    def report_local_progress(self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True):
        if samples_accumulated > 0:
            self._sample_epoch = local_epoch
        super().report_local_progress(local_epoch, samples_accumulated, update_global_samples)

    async def _progress_reporter(self) -> None:
        """Store this peer's progress when asked (paced) or half an expiration after the last wake, if it
        accumulated samples this epoch or the last (see the module docstring)."""
        loop = asyncio.get_running_loop()
        last_wake, store = -float("inf"), None
        try:
            while not self.shutdown_triggered.is_set():
                timeout = max(0.0, last_wake + self.metadata_expiration / 2 - get_dht_time())
                await loop.run_in_executor(None, self.should_report_progress.wait, timeout)
                self.should_report_progress.clear()
                progress, last_wake = self.local_progress, get_dht_time()
                if self._sample_epoch >= progress.epoch - 1:
                    store = asyncio.create_task(asyncio.wait_for(
                        self.dht.store(key=self.training_progress_key, subkey=self._local_public_key,
                                       value=progress.dict(), expiration_time=last_wake + self.metadata_expiration,
                                       return_future=True),
                        timeout=self.metadata_expiration))
        finally:
            if store is not None:
                store.cancel()

    def shutdown(self, timeout: float | None = None):
        self.shutdown_triggered.set()
        self.should_report_progress.set_now()  # the reporter must see the shutdown now, not an interval later
        super().shutdown(timeout)
