"""Who may send this peer messages, remembered across DHT reads: the bookkeeping for `peer/trip_server.py`
(trips: the stage before) and `peer/lane_trip.py` (K/V: the other lanes of this stage).

A receive slot is given only to a sender this peer already knows to be upstream (a live record of
the stage before, or a driver for stage 1). The set is built from successive DHT reads by *merging*:
an id stays known until its own record expires, so a failed, partial or empty read (which
`dhtio.records.parse_stage_entries` turns into an empty list) never empties it, and an honest
sender is not refused `unknown_sender` for a moment because one read went wrong.

An unknown sender is refused at once, before a byte of its stream is read; the refusal only *asks*
for a re-read (`StagePeers.refresh_soon`, gated by `RefreshGate`), at most once per interval for all
unknown senders together, so a peer that joined seconds ago is served on its retry while a flood of
fresh identities costs one DHT read per interval and no receive slot. A newcomer needs this as much: the
peers it reads at its join may not all have announced yet (a lane peer that knew none of its lane
partners refused their K/V until its next routine read, 10 s later, and its first trips failed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from hivemind.utils.timed_storage import get_dht_time

logger = logging.getLogger("peer")

MAX_KNOWN = 65536  # ids remembered at most; expired ones are dropped first (records are signed, so this is a guard)
REFRESH_INTERVAL = 2.0  # at most one DHT read per this many seconds on behalf of unknown senders
REFRESH_TIMEOUT = 5.0  # such a read that takes longer is abandoned (the next miss reads again)

ReadStages = Callable[[], Awaitable[dict]]  # a DHT read: stage → its peers' entries


@dataclass
class UpstreamIds:
    """Peer id -> the DHT expiration time of its newest live record of the stage before ours."""

    expires: dict[str, float] = field(default_factory=dict)

    def merge(self, entries: Iterable[tuple[str, float]], now: float) -> None:
        """Add (peer_id, expiration) pairs from one read; an id keeps the later of its expirations."""
        for peer_id, expiration in entries:
            if expiration > now and expiration > self.expires.get(peer_id, -1.0):
                self.expires[peer_id] = expiration
        if len(self.expires) > MAX_KNOWN:
            self.prune(now)

    def prune(self, now: float) -> None:
        self.expires = {p: t for p, t in self.expires.items() if t > now}
        if len(self.expires) > MAX_KNOWN:  # keep the longest-lived
            keep = sorted(self.expires.items(), key=lambda item: -item[1])[:MAX_KNOWN]
            self.expires = dict(keep)

    def known(self, peer_id: str, now: float) -> bool:
        return self.expires.get(peer_id, -1.0) > now

    def clear(self) -> None:
        """The stage changed: the peers before it are others."""
        self.expires = {}


@dataclass
class RefreshGate:
    """At most one background DHT read per `interval` seconds on behalf of unknown senders."""

    interval: float
    last: float = -float("inf")

    def due(self, now: float) -> bool:
        """True (and the read counted as started now) if a read may start."""
        if now - self.last < self.interval:
            return False
        self.last = now
        return True


@dataclass
class StagePeers:
    """The ids of one stage's live peers for the stage this peer serves (`serving`): merged read after read
    (`UpstreamIds`), forgotten when this peer starts serving another stage, whose neighbours are others.
    `admits` is the check both admissions make; a miss asks for a background re-read (`refresh_soon`)."""

    ids: UpstreamIds = field(default_factory=UpstreamIds)
    serving: int | None = None
    gate: RefreshGate = field(default_factory=lambda: RefreshGate(REFRESH_INTERVAL))
    reading: asyncio.Task | None = None  # referenced so it is not collected while running

    def merge(self, serving: int, entries: Iterable, now: float) -> None:
        """Add the router entries (`record.peer_id`, `expiration`) of one read made while serving `serving`."""
        if serving != self.serving:
            self.ids.clear()
            self.serving = serving
        self.ids.merge(((e.record.peer_id, e.expiration) for e in entries), now)

    def known(self, peer_id: str, now: float) -> bool:
        return self.ids.known(peer_id, now)

    def admits(self, serving: int, stage: int, entries: Iterable, peer_id: str, fetch: ReadStages, label: str) -> bool:
        """Whether `peer_id` has a live record of `stage`, after merging `entries` (the router's latest read of it,
        never replacing what earlier reads showed). A miss kicks a background re-read (`refresh_soon`), so a
        peer that announced after this peer's last read is admitted on its retry."""
        now = get_dht_time()
        self.merge(serving, entries, now)
        if self.known(peer_id, now):
            return True
        self.refresh_soon(fetch, serving, stage, label)
        return False

    def refresh_soon(self, fetch: ReadStages, serving: int, stage: int, label: str) -> None:
        """After an unknown sender was refused: read the DHT in the background and merge `stage`'s records if this
        peer still serves `serving` then; at most one read per `REFRESH_INTERVAL`. The refused sender is not kept
        waiting, and a peer that joined a moment ago is known by the time it retries."""
        if not self.gate.due(time.monotonic()):
            return
        self.reading = asyncio.get_running_loop().create_task(self._read(fetch, serving, stage, label))

    async def _read(self, fetch: ReadStages, serving: int, stage: int, label: str) -> None:
        try:
            stages = await asyncio.wait_for(fetch(), REFRESH_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - the sender was refused already; the next miss reads again
            logger.warning("%s could not read the DHT for a sender check: %s", label, exc)
            return
        if self.serving == serving:
            self.merge(serving, stages.get(stage, []), get_dht_time())
