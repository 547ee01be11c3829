"""Choosing the next hop: which peer of a stage gets a trip.

Like SWARM's balancer: the least expected queue (trips in flight over throughput), random
tie-break, and a peer that failed is banned for a while (doubling on repeated failures) so a
dead peer costs one timeout, not one per trip. Peers whose `T_fixed` hash differs from ours are
never chosen: they could not decode what we send. The `U` version is not filtered here: records
lag a switch by seconds, and a peer at another version answers at once with the version error,
which the driver resolves by running the trip again. A peer that keeps refusing that way (stuck
at an old `U`, or claiming the stage after it is empty when it is not) is banned after a few
refusals in a row, so the trips it turns away go to the stage's other peers.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from swarm.records import PeerEntry


@dataclass
class Ban:
    until: float
    strikes: int


@dataclass
class Router:
    t_fixed_sha256: str
    own_peer_id: str
    base_ban: float = 5.0
    max_ban: float = 60.0
    refusals_before_ban: int = 3
    stages: dict[int, list[PeerEntry]] = field(default_factory=dict)
    bans: dict[str, Ban] = field(default_factory=dict)
    inflight: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)
    rng: random.Random = field(default_factory=random.Random)

    def update(self, stages: dict[int, list[PeerEntry]], now: float | None = None) -> None:
        """New records from the DHT; bans that ran out are forgotten so the table stays small."""
        now = time.monotonic() if now is None else now
        self.stages = stages
        self.bans = {peer: ban for peer, ban in self.bans.items() if ban.until > now}
        listed = {e.record.peer_id for entries in stages.values() for e in entries}
        self.refusals = {peer: n for peer, n in self.refusals.items() if peer in listed}

    def compatible(self, entry: PeerEntry) -> bool:
        record = entry.record
        return (
            record.state == "online"
            and record.t_fixed_sha256 == self.t_fixed_sha256
            and record.peer_id != self.own_peer_id
        )

    def candidates(self, stage: int, now: float | None = None) -> list[PeerEntry]:
        """Compatible, unbanned peers of `stage`, best first."""
        now = time.monotonic() if now is None else now
        usable = [
            e
            for e in self.stages.get(stage, [])
            if self.compatible(e) and self.bans.get(e.record.peer_id, Ban(0, 0)).until <= now
        ]

        def expected_wait(entry: PeerEntry) -> tuple[float, float]:
            load = entry.record.load + self.inflight.get(entry.record.peer_id, 0) + 1
            return load / max(entry.record.throughput, 1e-3), self.rng.random()

        return sorted(usable, key=expected_wait)

    def ban(self, peer_id: str, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        previous = self.bans.get(peer_id)
        strikes = previous.strikes + 1 if previous else 1
        seconds = min(self.base_ban * 2 ** (strikes - 1), self.max_ban)
        self.bans[peer_id] = Ban(until=now + seconds, strikes=strikes)
        return seconds

    def refused(self, peer_id: str, now: float | None = None) -> float:
        """A refusal that is no fault when it happens once (a `U` switch in progress, a record that
        lags): count it, and ban the peer once it refuses several trips in a row. Returns the ban in
        seconds, 0 while the peer is still given the benefit of the doubt."""
        self.refusals[peer_id] = self.refusals.get(peer_id, 0) + 1
        if self.refusals[peer_id] < self.refusals_before_ban:
            return 0.0
        del self.refusals[peer_id]
        return self.ban(peer_id, now)

    def forgive(self, peer_id: str) -> None:
        self.bans.pop(peer_id, None)
        self.refusals.pop(peer_id, None)
