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
"""

from __future__ import annotations

import threading
import time

from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils import ValueWithExpiration, get_dht_time

PROGRESS_INTERVAL = 2.0  # seconds between two progress records of one peer, at most one in between


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


class PacedProgressTracker(ProgressTracker):
    """`ProgressTracker` whose reports are paced by `PacedEvent` (see the module docstring)."""

    def __init__(self, *args, report_interval: float = PROGRESS_INTERVAL, **kwargs):
        self._report_interval = report_interval
        super().__init__(*args, **kwargs)

    def __setattr__(self, name, value):
        # hivemind creates the event in __init__ just before starting the reporter thread: swap it there
        if name == "should_report_progress":
            value = PacedEvent(self._report_interval)
        super().__setattr__(name, value)

    def _parse_swarm_progress_data(self, metadata):
        # our own record in the DHT may be up to an interval old: read our progress from our counters instead,
        # or the stale record would pull the stage's sample count (and so the epoch's end) back
        if isinstance(metadata, dict):
            own = ValueWithExpiration(self.local_progress.dict(), get_dht_time() + self.metadata_expiration)
            metadata = {**metadata, self._local_public_key: own}
        return super()._parse_swarm_progress_data(metadata)

    def shutdown(self, timeout: float | None = None):
        self.shutdown_triggered.set()
        self.should_report_progress.set_now()  # the reporter must see the shutdown now, not an interval later
        super().shutdown(timeout)
