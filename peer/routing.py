"""Choosing the next hop: which peer of a stage gets a trip.

Like SWARM's balancer: the least expected queue (trips in flight over throughput), random
tie-break, and a peer that failed is banned for a while (doubling on repeated failures) so a
dead peer costs one timeout, not one per trip. Peers whose `T_fixed` hash differs from ours are
never chosen: they could not decode what we send. The `U` version is not filtered here: records
lag a switch by seconds, and a peer at another version answers at once with the version error,
which the driver resolves by running the trip again. A peer that keeps refusing that way (stuck
at another `U`) is banned once it has refused over several seconds with no trip carried between,
so the trips it turns away go to the stage's other peers; the burst of refusals every switch
causes (all trips in flight at once) counts once.
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
    refusal_spacing: float = 2.0  # refusals closer together than this are one burst
    stages: dict[int, list[PeerEntry]] = field(default_factory=dict)
    bans: dict[str, Ban] = field(default_factory=dict)
    inflight: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, tuple[int, float]] = field(default_factory=dict)  # peer -> (count, last counted)
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
        """A version refusal is no fault while a switch is in progress: count it (one per burst),
        and ban the peer once it has refused that way several times without carrying a trip in
        between. Returns the ban in seconds, 0 while the peer keeps the benefit of the doubt."""
        now = time.monotonic() if now is None else now
        count, last = self.refusals.get(peer_id, (0, -float("inf")))
        if now - last < self.refusal_spacing:
            return 0.0
        if count + 1 < self.refusals_before_ban:
            self.refusals[peer_id] = (count + 1, now)
            return 0.0
        del self.refusals[peer_id]
        return self.ban(peer_id, now)

    def forgive(self, peer_id: str) -> None:
        self.bans.pop(peer_id, None)
        self.refusals.pop(peer_id, None)
