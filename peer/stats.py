"""The counters a peer announces in its record and logs: one `Stats` per peer, shared by whatever serves its
stage (trips, the next hop, the trip server) and read by its announcer and its log."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from swarm.wire import ErrorCode


@dataclass
class Seconds:
    """Seconds summed over events, and how many events: one place a trip's time goes at this peer (issue 27).
    Sums since the peer started; the progress log shows each interval's share from differences."""

    total: float = 0.0
    count: int = 0

    def add(self, seconds: float) -> None:
        self.total += seconds
        self.count += 1


@dataclass
class Stats:
    """The counters a peer announces in its record and logs."""

    trips: int = 0
    tokens: int = 0
    # a driver counts a trip's boundary bytes with its tokens, when the trip ends: trips in flight and sends
    # that failed do not inflate bytes per token (failures show in `errors`)
    bytes_in: int = 0
    bytes_out: int = 0
    load: int = 0  # trips this peer is serving right now
    kv_bytes: int = 0  # K/V message bytes this peer sent in the lane trips it completed (context parallelism)
    kv_tokens: int = 0  # the tokens of those lane trips (this lane's chunks): kv_bytes / kv_tokens is consistent
    errors: Counter = field(default_factory=Counter)
    # where a trip's time goes here: stage-thread jobs waiting for the thread and running on it (`StageRuntime.run`),
    # a hop waiting for the next stage's reply (the link both ways and every stage after), a lane waiting for the
    # other lanes' K/V (each layer, both directions), and a served trip from decoded to its reply
    stage_queued: Seconds = field(default_factory=Seconds)
    stage_busy: Seconds = field(default_factory=Seconds)
    reply_wait: Seconds = field(default_factory=Seconds)
    kv_wait: Seconds = field(default_factory=Seconds)
    served: Seconds = field(default_factory=Seconds)
    trip_versions: Counter = field(default_factory=Counter)  # drivers: completed trips per U version
    mixed_trips: int = 0
    losses: list[float] = field(default_factory=list)
    last_loss: float | None = None
    # set while the peer leaves its stage (stopped, or moving): a failure then is the leave's doing (its trips
    # cut, p2pd gone under a group signal, trips refused as it is leaving), counted in `leaving_failures`, not `errors`
    leaving: bool = False
    leaving_failures: int = 0

    def error(self, code: ErrorCode) -> None:
        if self.leaving:
            self.leaving_failures += 1
        else:
            self.errors[code.value] += 1
