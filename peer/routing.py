"""Choosing the next hop: which peer of a stage gets a trip.

Like SWARM's balancer: the least expected queue (trips in flight over throughput), random
tie-break. The throughput is what *this* peer measured of each candidate, never what the candidate
claims: an EWMA of the seconds per token of its own trips to it (send to checked reply), halved
for every failure. A claimed throughput is only a prior for a peer not measured yet, and a capped
one: at most `prior_factor` times the best rate measured in the stage (or, with nothing measured,
the stage's plausible bound from the manifest), and an unmeasured peer with a trip in flight is
tried again only when nothing else is left. So a record claiming 1e12 tokens/s buys one probe;
after that its own answers decide. (A peer that answers well-formed lies *faster* than honest
peers compute would still win trips: measuring speed cannot tell such answers from honest ones,
only the checks on the reply can.) A peer that failed is banned for a while (doubling on repeated failures) so a
dead peer costs one timeout, not one per trip. Peers whose `T_fixed` hash differs from ours are
never chosen: they could not decode what we send. The `U` version is not filtered here: records
lag a switch by seconds, and a peer at another version answers at once with the version error,
which the driver resolves by running the trip again. A peer that keeps refusing that way (stuck
at another `U`) is banned once it has refused over several seconds with no trip carried between,
so the trips it turns away go to the stage's other peers; the burst of refusals every switch
causes (all trips in flight at once) counts once. `unknown_sender` (the next hop has not seen our record
yet) and `overloaded` are no fault: the hop backs off and tries another peer, with no ban. Strikes outlive
the ban they caused, so bans escalate; they are forgotten `strike_memory` × the longest ban of their kind after
the last one (`max_ban`; `max_audit_ban` for a lie, whose first ban alone outlasts 4 × `max_ban`).

A peer reached through a relay (its record names one, `peer/relay.py`) is ranked by the same measured rate,
which includes the relay's detour: it wins trips only where it is faster, a direct peer wins a tie (and two
unmeasured peers with the same claim), and it stays a candidate, so a stage served only through a relay is served.

Which peer's reply may be *used* is a second question, answered by audit trips (`peer/audit.py`, the
`ledger`): a peer not yet verified only gets duplicates of trips a verified peer carries.
"""

from __future__ import annotations

import enum
import random
import time
from dataclasses import dataclass, field

from peer.audit import Ledger
from swarm.manifest import Manifest
from swarm.records import PeerEntry, usable_peer
from swarm.wire import ErrorCode

ONLY_PEER_RETRIES = 3  # tries of the stage's only peer before it is banned like any other
# A peer re-reads the records of `routed_stages` this often. A live record read then is at least
# RECORD_TTL - ANNOUNCE_INTERVAL (20 s) from expiring, so admission keeps knowing a live upstream peer across a
# missed read. A peer of the next stage that came online gets trips within this time; one that died is banned by
# its first failed trip, not by a read; the failure paths read at once (no candidate left, an unknown sender).
REFRESH_INTERVAL = 10.0


def routed_stages(manifest: Manifest, index: int) -> list[int]:
    """The stages whose records a peer of stage `index` keeps: the one before (whose peers may send it trips,
    `TripServer` admission) and the one after (where its trips go). Every stage when the run updates U:
    `SubspaceSync` counts the online peers of all of them in the router's records."""
    if manifest.updates_u:
        return list(range(manifest.num_stages))
    return [s for s in (index - 1, index + 1) if 0 <= s < manifest.num_stages]


class Failover(enum.Enum):
    """What a hop does after a next hop failed a trip."""

    GIVE_UP = "give up"  # raise: the stage behind is empty or U is switching, the driver runs the trip again
    RETRY = "retry"  # the stage's only peer: try it again shortly rather than empty the stage for a ban
    NEXT = "next"  # ban it and try another peer of the stage
    BACKOFF = "back off"  # no fault (it does not know us yet, or is busy): try another peer, or it shortly


def failover(code: ErrorCode, candidates: int, failures: int) -> Failover:
    """The policy, given the failure's code, how many peers the stage offered and how often this one
    failed this trip (counting this failure)."""
    if code in (ErrorCode.NO_PEER, ErrorCode.WRONG_VERSION):
        return Failover.GIVE_UP
    if code in (ErrorCode.UNKNOWN_SENDER, ErrorCode.OVERLOADED):
        return Failover.BACKOFF
    if candidates == 1 and failures < ONLY_PEER_RETRIES:
        # a transient failure (a stream reset at first contact) should not empty the stage
        return Failover.RETRY
    return Failover.NEXT


def counts_as_stuck(code: ErrorCode, hops: int, candidates: int) -> bool:
    """A version refusal from the next hop itself (not relayed from further down), in a stage with other
    peers: evidence that it keeps its own U apart from ours. The stage's only peer is never banned for it."""
    return code == ErrorCode.WRONG_VERSION and hops == 1 and candidates > 1


@dataclass
class Ban:
    until: float
    strikes: int
    struck: float = 0.0  # when the last strike was given
    lied: bool = False  # banned for a reply an audit refuted; a later ban keeps it while this one lasts
    last_lie: float | None = None  # when an audit last refuted it: its strikes are kept longer from then


@dataclass
class Measure:
    seconds_per_token: float | None = None  # EWMA over answered trips; None: never answered yet
    samples: int = 0
    failures: int = 0  # since the last answer
    answered_at: float = 0.0  # time.monotonic() of the last answer
    ahead: float | None = None  # EWMA of our trips already in flight there when we sent one (None: none sent)


@dataclass
class Router:
    t_fixed_sha256: str
    own_peer_id: str
    claim_bounds: dict[int, float] = field(default_factory=dict)  # stage -> most tokens/s a claim may say
    lanes: int = 1  # the run's P: a record claiming a lane the run does not have serves nothing
    prior_factor: float = 2.0  # an unmeasured peer's claim counts for at most this times the best measured
    # a measured peer that got none of our trips for this long counts as unmeasured again: one probe, whose
    # answer replaces the old measure. A peer measured slow once (its first trips waited for a state download,
    # or a busy moment) would otherwise get no trip, hence no new measure, for as long as a faster one is there
    remeasure_after: float = 10.0
    ewma_alpha: float = 0.3
    base_ban: float = 5.0
    max_ban: float = 60.0
    refusals_before_ban: int = 3
    refusal_spacing: float = 2.0  # refusals closer together than this are one burst
    strike_memory: float = 4.0  # strikes are forgotten this many longest bans of their kind after the last one
    audit_ban: float = 300.0  # first ban for a reply that disagreed with a verified peer's; doubles per strike
    max_audit_ban: float = 3600.0
    stages: dict[int, list[PeerEntry]] = field(default_factory=dict)
    bans: dict[str, Ban] = field(default_factory=dict)
    inflight: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, tuple[int, float]] = field(default_factory=dict)  # peer -> (count, last counted)
    measures: dict[str, Measure] = field(default_factory=dict)
    rng: random.Random = field(default_factory=random.Random)
    ledger: Ledger = field(default_factory=Ledger)

    def update(self, stages: dict[int, list[PeerEntry]], now: float | None = None) -> None:
        """New records from the DHT. A ban that ran out keeps its strikes (so the next one is longer) until
        `strike_memory` × the longest ban of its kind passed without a new strike; then it is forgotten so the
        table stays small.
        What this peer measured or verified of a peer whose record expired is forgotten."""
        now = time.monotonic() if now is None else now
        self.stages = stages
        self.bans = {peer: ban for peer, ban in self.bans.items() if ban.until > now or self._remembered(ban, now)}
        listed = {e.record.peer_id for entries in stages.values() for e in entries}
        self.refusals = {peer: n for peer, n in self.refusals.items() if peer in listed}
        self.measures = {peer: m for peer, m in self.measures.items() if peer in listed}
        # a verified peer whose record is gone no longer vouches for anyone: kept, it would leave the stage with
        # "a verified peer" that never answers, so no newcomer could ever be verified (no primary to duplicate)
        # nor trusted on first use, and no loss would be published again (churn, issue 14). Distrust is a ban.
        self.ledger.standings = {peer: s for peer, s in self.ledger.standings.items() if peer in listed}
        self.ledger.forget_pairs_beyond(listed)

    def observe(self, peer_id: str, seconds: float, tokens: int, now: float | None = None) -> None:
        """A trip to `peer_id` came back checked after `seconds`. The first answer after `remeasure_after`
        without one replaces the old measure: that is what the peer is now."""
        now = time.monotonic() if now is None else now
        sample = max(seconds, 1e-6) / max(tokens, 1)
        m = self.measures.setdefault(peer_id, Measure())
        if m.seconds_per_token is None or now - m.answered_at > self.remeasure_after:
            m.seconds_per_token = sample
        else:
            m.seconds_per_token += self.ewma_alpha * (sample - m.seconds_per_token)
        m.samples += 1
        m.failures = 0
        m.answered_at = now

    def failed(self, peer_id: str) -> None:
        """A trip to `peer_id` failed (no answer, or one that did not pass the checks)."""
        self.measures.setdefault(peer_id, Measure()).failures += 1

    def rate(self, entry: PeerEntry, stage: int, best_measured: float | None, now: float | None = None) -> float:
        """Tokens/s we expect of `entry`: measured if we can, else its claim capped as described above."""
        return self._rate(entry, stage, self.measured_rate(entry.record.peer_id, now), best_measured)

    def _rate(self, entry: PeerEntry, stage: int, measured: float | None, best_measured: float | None) -> float:
        """`rate`, given the entry's `measured_rate`."""
        if measured is not None:
            rate = measured
        else:
            rate = min(entry.record.throughput, self.claim_bounds.get(stage, float("inf")))
            if best_measured is not None:
                rate = min(rate, best_measured * self.prior_factor)
        return max(rate, 1e-3) * 0.5 ** min(self.measures.get(entry.record.peer_id, Measure()).failures, 30)

    def measured_rate(self, peer_id: str, now: float | None = None) -> float | None:
        """Tokens/s measured of `peer_id`; None if never measured, or if the measure is out of date: no trip of
        ours in flight there and no answer for `remeasure_after` (it is probed again as an unmeasured peer)."""
        m = self.measures.get(peer_id)
        if m is None or m.seconds_per_token is None:
            return None
        now = time.monotonic() if now is None else now
        if not self.inflight.get(peer_id) and now - m.answered_at > self.remeasure_after:
            return None
        return 1.0 / m.seconds_per_token

    def compatible(self, entry: PeerEntry) -> bool:
        return entry.record.lane < self.lanes and usable_peer(entry.record, self.t_fixed_sha256, self.own_peer_id)

    def candidates(self, stage: int, now: float | None = None) -> list[PeerEntry]:
        """Compatible, unbanned peers of `stage`, best first."""
        now = time.monotonic() if now is None else now
        usable = [
            e
            for e in self.stages.get(stage, [])
            if self.compatible(e) and self.bans.get(e.record.peer_id, Ban(0, 0)).until <= now
        ]

        measured = {e.record.peer_id: self.measured_rate(e.record.peer_id, now) for e in usable}
        best = max((r for r in measured.values() if r is not None), default=None)

        def expected_wait(entry: PeerEntry) -> tuple[bool, float, bool, float]:
            peer_id = entry.record.peer_id
            ours = self.inflight.get(peer_id, 0)
            unmeasured = measured[peer_id] is None
            # a measured peer's service times already include the queue other senders make there, and ours as
            # it was when measured: a new trip waits (ours + 1) / (ahead + 1) times that long. An unmeasured one
            # gets one probe at a time, its claimed queue counted
            if unmeasured:
                queue = ours + 1 + entry.record.load
            else:
                queue = (ours + 1) / ((self.measures[peer_id].ahead or 0.0) + 1)
            wait = queue / self._rate(entry, stage, measured[peer_id], best)
            return unmeasured and ours > 0, wait, bool(entry.record.relay), self.rng.random()

        return sorted(usable, key=expected_wait)

    def relay_of(self, peer_id: str) -> str:
        """The relay `peer_id`'s record names ("" when it is directly reachable or not listed)."""
        return next((e.record.relay for es in self.stages.values() for e in es if e.record.peer_id == peer_id), "")

    def unreachable(self, now: float | None = None) -> set[str]:
        """Peers banned now: this peer failed to reach them (or caught them lying), so placement does not count
        them as serving their stage."""
        now = time.monotonic() if now is None else now
        return {peer for peer, ban in self.bans.items() if ban.until > now}

    def liars(self, now: float | None = None) -> set[str]:
        """Peers banned now for a reply an audit refuted."""
        now = time.monotonic() if now is None else now
        return {peer for peer, ban in self.bans.items() if ban.lied and ban.until > now}

    def _remembered(self, ban: Ban, now: float) -> bool:
        """Strikes are kept `strike_memory` × `max_ban` after the last one, and × `max_audit_ban` after the last
        lie (whatever banned the peer since: a failure after a lie must not wipe the lie's record)."""
        return now - ban.struck < self.strike_memory * self.max_ban or (
            ban.last_lie is not None and now - ban.last_lie < self.strike_memory * self.max_audit_ban)

    def ban(self, peer_id: str, now: float | None = None, lied: bool = False) -> float:
        """Ban `peer_id`, doubling with its strikes; a peer caught lying by an audit (`lied`) for far longer.
        Returns the ban in seconds."""
        now = time.monotonic() if now is None else now
        previous = self.bans.get(peer_id)
        strikes = previous.strikes + 1 if previous else 1
        base, cap = (self.audit_ban, self.max_audit_ban) if lied else (self.base_ban, self.max_ban)
        seconds = min(base * 2 ** (strikes - 1), cap)
        self.bans[peer_id] = Ban(until=max(now + seconds, previous.until if previous else 0.0), strikes=strikes,
                                 struck=now, lied=lied or bool(previous and previous.lied and previous.until > now),
                                 last_lie=now if lied else previous.last_lie if previous else None)
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

    def forgive(self, peer_id: str, now: float | None = None) -> None:
        """`peer_id` carried a trip: a ban for failures is lifted, its refusal count starts over. A ban for a lie
        stands (the liar's trips still in flight when an audit refuted it come back answered: before, the first of
        them lifted the ban and wiped its strikes), and a lie's strikes stay remembered (`_remembered`), so that
        the next lie's ban is longer."""
        now = time.monotonic() if now is None else now
        ban = self.bans.get(peer_id)
        if ban is not None and not (ban.lied and ban.until > now):
            if ban.last_lie is None:
                del self.bans[peer_id]
            else:
                ban.until = min(ban.until, now)
        self.refusals.pop(peer_id, None)

    def sending(self, peer_id: str) -> None:
        """A trip to `peer_id` is under way (counts in its expected queue)."""
        ahead = self.inflight.get(peer_id, 0)
        m = self.measures.setdefault(peer_id, Measure())
        m.ahead = ahead if m.ahead is None else m.ahead + self.ewma_alpha * (ahead - m.ahead)
        self.inflight[peer_id] = ahead + 1

    def done_sending(self, peer_id: str) -> None:
        self.inflight[peer_id] -= 1
        if self.inflight[peer_id] <= 0:
            del self.inflight[peer_id]

    def answered(self, peer_id: str, seconds: float, tokens: int) -> None:
        """A trip to `peer_id` came back checked: what we measured of it, not what it claims, decides how
        many trips it gets, and a ban for failures or a refusal count it had is lifted (`forgive`)."""
        self.observe(peer_id, seconds, tokens)
        self.forgive(peer_id)

    def after_failure(
        self, peer_id: str, code: ErrorCode, hops: int, candidates: int, failures: int, now: float | None = None
    ) -> tuple[Failover, float]:
        """Apply the failover policy to a failed trip to `peer_id`: what to do next, and the ban it got
        in seconds (0 for none)."""
        action = failover(code, candidates, failures)
        if action is Failover.GIVE_UP:
            return action, self.refused(peer_id, now) if counts_as_stuck(code, hops, candidates) else 0.0
        if action in (Failover.RETRY, Failover.BACKOFF):
            return action, 0.0
        self.failed(peer_id)
        return action, self.ban(peer_id, now)
