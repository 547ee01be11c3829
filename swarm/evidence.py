"""When parts past a statistical bound add up to an accusation, and how long an accusation bans: the policy.

`swarm/robust.py` finds parts past a bound: a contribution far from the robust average, a reduced part that moves
this peer's values too far. Honest peers reach those bounds too. benchmarks/honest_accusations.py (four honest
replicas of the tiny preset, hivemind's parts, 60 rounds of training, 2 seeds) found 40 honest contributions and
95 honest reduced parts past a bound (31 once reduced parts are also judged against their own recent change),
most in the first rounds (attention's query and key weights, norms), and the peers banned an honest peer for
each: 13 to 15 averaging bans in 6 minutes of an all-honest lane swarm (benchmarks/RESULTS.md). A hostile peer
that spoils its parts is past the bound on many of them, round after round. So a finding accuses at once only
where it is `flagrant` times past its bound (in an exploratory pass over the same rounds, seed 0, the largest
honest finding was 23 times past; not kept); otherwise a peer is accused when, over its last `rounds` rounds with
this peer, at least `flags` of its judged parts were findings and they were at least `share` of them. In those
runs no honest peer was accused, while a reducer returning noise of 10× the average's norm was past the bound on
24–32 % of its parts and a sender sending 10× its gradient on 19–33 %, and both were accused in round 0 or 1.

A part weighs as evidence in proportion to its values, up to `full_values` (16,384: between the presets' widest
vector, 8B's 4,096-value norm gains, and their smallest d-wide matrix, tiny's 32,768-value K and V projections): such
a matrix's part counts as one judgement, tiny's 256-value norm gain as 1/64 of one, the θ head of the
context-parallel presets (a d × 2 matrix, 512 to 8,192 values, and its 2-value bias) like the vectors. The bounds
come from what the round's large matrices did (the reduced-part check: this peer's own reduction, dominated by
them), and the small tensors do not follow them: every honest reduced part refused in session 26's kept lane-run
logs was one of them (the θ head's weight and bias 43× and 48× their bound, a layer's `attn_norm` 8.9×), and
session 25's one honest reducer ban was for `attn_norm` parts. A spoiled small part is still refused or clipped,
part by part, and one `flagrant` times past its bound still accuses at once; what weighing by values gives up is an
accusation of a peer that spoils small parts alone (benchmarks/RESULTS.md, "Evidence weighed by values"). A peer
cannot make its share small parts alone: its share is an equal one whatever bandwidth it claims
(peer/group_members.py), a run of about 1/N of the values (a hostile leader may choose where in the order it
stands, not how much it reduces).

What a finding costs a peer before it is accused is only the part itself: a far contribution is clipped, a
refused reduced part replaced by the receiver's own values. What it cannot catch: a peer that spoils fewer parts
than `share` of its judged ones stays unaccused (each of those parts is still clipped or refused).

The direction of a reducer's averages (`swarm/robust.py` `Alignment`) is judged once per round, not per part,
and by its own evidence (`ALIGNMENT`): a reducer is accused when its averages pointed away from this peer's parts
in `flags` = 5 of its last 8 rounds with it. Honest reducers did so in at most 3 of any 8 consecutive rounds over
2 seeds × 2 stages × 60 rounds of benchmarks/honest_accusations.py; a reducer that negates its averages does so
in nearly every round, and was accused after its 5th. A sender's direction (`direction_findings`) is weighed the
same way, by its own `Evidence(ALIGNMENT)` at each reducer: over 2 seeds × 2 stages × 60 rounds of the same benchmark
an honest sender was a round's lowest-and-apart at most 3 times in any 8 consecutive rounds with one reducer
(28 Nov 2026), while a sender of −g was accused by every honest replica by round 5 (counted from 0); with the clip
radius from the upper median distance (`swarm/robust.py`), at most 4 times, and −g by round 6 (benchmarks/RESULTS.md).

An accusation bans the peer from that averager (`AveragingBans`) for `BAN_SECONDS`, doubling with each new
accusation of the same peer up to `MAX_BAN_SECONDS`, so that an honest peer accused by chance rejoins its stage's
averaging, while a hostile one is accused again once it spoils enough parts, and banned twice as long.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from swarm.robust import Finding


@dataclass(frozen=True)
class EvidenceRule:
    """The knobs; the defaults are what the peers use (module docstring)."""

    rounds: int = 8  # the rounds with a peer that its judged parts are counted over
    flags: int = 3  # at least this many findings in them (weighed by values)...
    share: float = 0.15  # ...and at least this share of its judged parts
    flagrant: float = 100.0  # a finding this many times past its bound accuses at once
    unit: str = "parts"  # what one judgement is, for the accusation's text
    full_values: int = 16384  # a judged part of this many values or more weighs 1, a smaller one its share of it

    def __post_init__(self) -> None:
        if self.full_values < 1:
            raise ValueError(f"full_values must be at least 1, not {self.full_values}")

    def weight(self, values: int | None) -> float:
        """What one judged part of `values` values weighs as evidence (None: a judgement of its own, 1)."""
        return 1.0 if values is None else min(1.0, values / self.full_values)


# one judgement per reducer and round (module docstring)
ALIGNMENT = EvidenceRule(rounds=8, flags=5, share=0.5, unit="rounds")


@dataclass
class _Round:
    key: Hashable
    judged: float = 0.0  # judged parts, each weighed by its values (`Evidence.judge`)
    findings: float = 0.0


class Evidence:
    """Each peer's judged parts and findings over its last rounds with this peer (module docstring)."""

    def __init__(self, rule: EvidenceRule = EvidenceRule()):
        self.rule = rule
        self._rounds: dict[Hashable, deque[_Round]] = {}

    def judge(
        self, peer: Hashable, round_key: Hashable, finding: Finding | None, values: int | None = None
    ) -> str | None:
        """Count one judged part of `peer` in round `round_key`, of `values` values (None: a judgement of its own,
        weighing 1, as a round's direction is); why the peer stands accused now, or None. An accusation spends the
        evidence behind it (after a ban ends, the peer starts from nothing)."""
        if finding is not None and finding.excess >= self.rule.flagrant:
            self._rounds.pop(peer, None)
            return finding.why
        rounds = self._rounds.setdefault(peer, deque(maxlen=self.rule.rounds))
        if not rounds or rounds[-1].key != round_key:
            rounds.append(_Round(round_key))
        current = rounds[-1]
        weight = self.rule.weight(values)
        current.judged += weight
        if finding is None:
            return None
        current.findings += weight
        judged = sum(r.judged for r in rounds)
        findings = sum(r.findings for r in rounds)
        if findings < self.rule.flags or findings < self.rule.share * judged:
            return None
        del self._rounds[peer]
        return (f"{round(findings, 2):g} of its last {round(judged, 2):g} {self.rule.unit} past their bounds in "
                f"{len(rounds)} rounds (last: {finding.why})")


class AveragingBans:
    """The peers an averager bans, each until a time (`clock`: seconds), and the first reason: a peer accused
    again after its ban ended is banned twice as long as the last time (peer/robust_averaging.py). `in` and `current`
    forget ended bans; the strikes are kept, so a peer accused often stays out for long."""

    BAN_SECONDS = 600.0
    MAX_BAN_SECONDS = 4 * 3600.0

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.reasons: dict[Hashable, str] = {}
        self.until: dict[Hashable, float] = {}
        self.strikes: dict[Hashable, int] = {}

    def ban(self, peer_id: Hashable, why: str) -> float | None:
        """Ban `peer_id` unless it is banned now; the ban's length in seconds, or None if it already was."""
        if peer_id in self:
            return None
        self.strikes[peer_id] = self.strikes.get(peer_id, 0) + 1
        seconds = min(self.BAN_SECONDS * 2 ** (self.strikes[peer_id] - 1), self.MAX_BAN_SECONDS)
        self.reasons[peer_id], self.until[peer_id] = why, self.clock() + seconds
        return seconds

    def __contains__(self, peer_id: object) -> bool:
        if peer_id in self.until and self.until[peer_id] <= self.clock():
            del self.until[peer_id], self.reasons[peer_id]
        return peer_id in self.until

    def current(self) -> dict[Hashable, str]:
        """The peers banned now, with why."""
        return {peer: why for peer, why in list(self.reasons.items()) if peer in self}
