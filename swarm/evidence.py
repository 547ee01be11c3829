"""When parts past a statistical bound add up to an accusation: the policy, as a pure object.

`swarm/robust.py` finds parts past a bound: a contribution far from the robust average, a reduced part that moves
this peer's values too far. Honest peers reach those bounds too. benchmarks/honest_accusations.py (four honest
replicas of the tiny preset, hivemind's parts, 60 rounds of training) found about one honest part in 400 past a
bound, most of them in the first rounds (attention's query and key weights, norms), and the peers banned an honest
peer for each: 13 to 15 averaging bans in 6 minutes of an all-honest lane swarm (benchmarks/RESULTS.md). A
hostile peer that spoils its parts is past the bound on many of them, round after round. So a finding accuses at
once only where it is `flagrant` times past its bound (honest parts reached at most 24 times); otherwise a peer is
accused when, over its last `rounds` rounds with this peer, at least `flags` of its judged parts were findings
and they were at least `share` of them. In those 60 rounds no honest peer came within 2× of that share (at most
7.4 % of its parts over 8 rounds), while a reducer returning noise of 10× the average's norm was past the bound
on about half its parts and a sender sending 10× its gradient on about 40 %.

What a finding costs a peer before it is accused is only the part itself: a far contribution is clipped, a
refused reduced part replaced by the receiver's own values. What it cannot catch: a peer that spoils fewer parts
than `share` of its judged ones stays unaccused (each of those parts is still clipped or refused).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

from swarm.robust import Finding


@dataclass(frozen=True)
class EvidenceRule:
    """The knobs; the defaults are what the peers use (module docstring)."""

    rounds: int = 8  # the rounds with a peer that its judged parts are counted over
    flags: int = 3  # at least this many findings in them...
    share: float = 0.15  # ...and at least this share of its judged parts
    flagrant: float = 100.0  # a finding this many times past its bound accuses at once


@dataclass
class _Round:
    key: Hashable
    judged: int = 0
    findings: int = 0
    last: str = ""


class Evidence:
    """Each peer's judged parts and findings over its last rounds with this peer (module docstring)."""

    def __init__(self, rule: EvidenceRule = EvidenceRule()):
        self.rule = rule
        self._rounds: dict[Hashable, deque[_Round]] = {}

    def judge(self, peer: Hashable, round_key: Hashable, finding: Finding | None) -> str | None:
        """Count one judged part of `peer` in round `round_key`; why the peer stands accused now, or None. An
        accusation spends the evidence behind it (after a ban ends, the peer starts from nothing)."""
        if finding is not None and finding.excess >= self.rule.flagrant:
            self._rounds.pop(peer, None)
            return finding.why
        rounds = self._rounds.setdefault(peer, deque(maxlen=self.rule.rounds))
        if not rounds or rounds[-1].key != round_key:
            rounds.append(_Round(round_key))
        current = rounds[-1]
        current.judged += 1
        if finding is None:
            return None
        current.findings, current.last = current.findings + 1, finding.why
        judged = sum(r.judged for r in rounds)
        findings = sum(r.findings for r in rounds)
        if findings < self.rule.flags or findings < self.rule.share * judged:
            return None
        del self._rounds[peer]
        return f"{findings} of its last {judged} parts past their bounds in {len(rounds)} rounds (last: {finding.why})"
