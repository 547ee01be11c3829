"""Audit trips: verification of next-hop peers by redundancy.

Measuring service time cannot tell a fast liar from a fast honest peer: a peer that answers every trip at
once with a well-formed fake reply (zero input gradients, a plausible loss) is measured fastest. So a hop
trusts a peer of the next stage only after it has checked that peer's answers against a peer it already
trusts: a candidate it has not verified gets trips only as *duplicates* (the same message, sent at the same
time to it and to the best verified peer of the stage; the verified peer's reply is the one used), and
`VERIFY_AFTER` consecutive matching duplicates make it verified. A mismatch bans it for a long, escalating
time. Verified peers are audited at a low random rate (`AUDIT_RATE` of their trips duplicated to another
verified peer; the message is the same one, so the audited peer cannot tell); on a mismatch the peer with
the shorter verified history loses its status and is banned. Lane trips are audited by forks
(`peer/lane_claim.py`, whose limit says which lane peers can tell a forked trip).

Bootstrapping is trust on first use: when no peer of the stage is verified from this hop's point of view
(a new swarm, or every peer new), the best candidate is used normally and becomes verified after
`VERIFY_AFTER` clean trips. A hostile peer that is first in a stage is therefore trusted until a second
peer appears and audits disagree, and then the longer verified history wins: a liar that got there first
keeps the stage until it is out-audited by a peer verified before it elsewhere, which is a limit of
verification by redundancy without a ground truth (documented in docs/DESIGN.md §4).

A peer's standing lasts as long as its record: when the record expires the router drops the standing
(`Router.update`), so a stage whose verified peers all died falls back to trust on first use instead of
refusing every replacement for want of a verified peer to compare with.

What two replies to one message may differ by was measured on this machine (docs/DESIGN.md §4 has the numbers,
benchmarks/RESULTS.md the runs; `benchmarks/audit_pairs.py` records honest audits, `benchmarks/replay_audits.py`
replays them through these rules). A comparison is judged only where one of the two peers is verified; its rules:

- Replies are not paired at the same weights (no two replicas hold bit-equal weights after hivemind's all-reduce);
  every reply carries the epoch of each hop's weights, and only the next hop's own epoch counts.
- The loss is the discriminator: within `LOSS_RTOL`, plus `LOSS_RTOL_PER_EPOCH` per epoch between the two replies'
  weights where the older weights gave the higher loss (a stale copy early in a run); a lower loss from older
  weights gets no slack. On lane forks, whose losses are a chunk's, within the larger of that and `LANE_LOSS_RTOL`.
  A peer being verified is judged on one comparison; two verified peers' pipeline duplicates on most of their last
  `LOSS_WINDOW` (`Ledger.losses_apart`: an honest replica's single reply can be far off, where a liar forges audit
  after audit), except a gap past `LOSS_GAP_MAX`, judged at once; a gap weighed is neither a match nor a verdict.
- A lag: replies more than `AUDIT_MAX_LAG` epochs apart (losses not compared), or whose losses are apart past the
  slack, by at most `LOSS_GAP_EXCUSED` per epoch between them (never past `LOSS_GAP_MAX`), the way older weights'
  are (the loss falling faster than the slack in a run's first minute, or a loss spike the newer weights recovered
  from; `loss_gap_of_lag`; between two verified peers, once the gap is judged). If the gradients pass, the peer
  blamed is not judged but loses its standing (verified again by `VERIFY_AFTER` matches) while gaps are excused,
  for `LAG_GRACE` from its first, one grace per `LAG_MEMORY` for either kind.
- The gradient alone refuses only what no honest peer sends: all-zero against non-zero, non-finite, or a cosine
  below `COSINE_MIN` (-0.8): at one audit where a peer is being verified (its audits go to whichever verified peer is
  the primary, so windows split among them would let a negating newcomer be verified), over a pair's last
  `FLIP_WINDOW` between verified peers and on lane forks (`Ledger.flip`: honest single cosines reached -0.98).
- Drift (`Ledger.drift`, not on lane forks): one audit cannot tell a scaled or random gradient sent with the honest
  loss, but a forger forges audit after audit, so a pair's median cosine over its last `DRIFT_WINDOW` audits within
  `DRIFT_LAG` epochs below `DRIFT_COSINE`, or median norm ratio over those within `DRIFT_NORM_LAG` above
  `DRIFT_NORM`, is a disagreement.
- One verdict a pair at a time: comparisons in flight when a verdict lands on either peer are not judged
  (`Ledger.verdicts_on`); without it one episode banned an honest lane peer 9 times within 2 s.

Limits (DESIGN §4): a liar that copies a plausible loss and forges its gradient (or, once verified, its loss) on too
few of its audits for any window of a pair to hold a majority of forgeries (at random, a share p is caught later as p
falls: DESIGN §4), claims epochs far from the verified reply's, scales by less than `DRIFT_NORM`, or
answers from weights only a few epochs stale passes; one that claims older weights with a higher loss is excused
once per `LAG_MEMORY` (unused meanwhile); a liar verified before an honest peer wins their disagreements.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import deque
from dataclasses import dataclass, field

import torch

COSINE_MIN = -0.8  # see the measurements above: direction is only checked for a sign flip
LOSS_RTOL = 0.25
# a lane fork's two losses are one chunk's (a lane's share of a sequence), from replicas that average mostly in
# pairs: 10,750 recorded honest lane comparisons within `AUDIT_MAX_LAG` reached 0.599 apart at one audit
# (`benchmarks/replay_audits.py --lanes`)
LANE_LOSS_RTOL = 2 / 3  # one loss 3 times the other
LOSS_RTOL_PER_EPOCH = 0.05  # more loss difference allowed per epoch of lag, where the older weights lost more
LOSS_GAP_EXCUSED = 0.1  # how far past its slack, per epoch of lag, a loss gap of older weights may be excused...
LOSS_GAP_MAX = 0.75  # ...as a lag, up to this (one loss 4 times the other is never a lag)
AUDIT_MAX_LAG = 10  # epochs apart two replies' weights may be and still be compared (see above)
LAG_GRACE = 120.0  # seconds an audited peer's replies may stay too far apart to compare (see above)
LAG_MEMORY = 1800.0  # seconds a peer's grace is remembered: a later gap within it is a disagreement
DRIFT_LAG = 1  # replies at most this many epochs apart count toward a pair's direction drift (see above)
DRIFT_NORM_LAG = 3  # ...and at most this many toward its norm drift
DRIFT_WINDOW = 5  # the last this many such audits of one pair of peers are weighed together
DRIFT_COSINE = 0.1  # their median gradient cosine below this...
DRIFT_NORM = 6.0  # ...or their median gradient norm ratio (either way) above this: not one computation
VERIFY_AFTER = 3  # consecutive matching duplicates (or clean trust-on-first-use trips) to be verified
AUDIT_RATE = 0.02  # share of a verified peer's trips duplicated to another verified peer
# share of lane trips a driver forks for an audit (`peer/lane_claim.py`): every slot's peers are checked only
# through forks, so newcomers need them; each costs the forked stage and those after it one more lane trip
LANE_AUDIT_RATE = 0.1
FLIP_WINDOW = 3  # a pair's last this many cosines: their median is checked against `COSINE_MIN`
LOSS_WINDOW = 3  # between two verified peers a loss gap is a verdict once most of the pair's last this many had one


@dataclass(frozen=True)
class Agreement:
    """How two replies to one message compare: what the tolerances are checked against, and what
    benchmarks/audit_pairs.py measures between honest peers (the drivers log it at DEBUG)."""

    loss_rdiff: float | None  # |a - b| / max(|a|, |b|); None when a loss is missing
    norms: tuple[float, float]
    cosine: float | None  # None when a norm is zero or not finite, or the shapes differ
    shapes_match: bool


def agreement(grad_a: torch.Tensor, loss_a: float | None, grad_b: torch.Tensor, loss_b: float | None) -> Agreement:
    loss_rdiff = None
    if loss_a is not None and loss_b is not None:
        scale = max(abs(loss_a), abs(loss_b))
        loss_rdiff = abs(loss_a - loss_b) / scale if scale > 0 else 0.0
    a, b = grad_a.detach().flatten().double(), grad_b.detach().flatten().double()
    if a.shape != b.shape:
        return Agreement(loss_rdiff, (math.nan, math.nan), None, False)
    norm_a, norm_b = a.norm().item(), b.norm().item()
    usable = norm_a > 0.0 and norm_b > 0.0 and math.isfinite(norm_a) and math.isfinite(norm_b)
    return Agreement(loss_rdiff, (norm_a, norm_b), (a @ b).item() / (norm_a * norm_b) if usable else None, True)


def replies_disagree(
    grad_a: torch.Tensor,
    loss_a: float | None,
    grad_b: torch.Tensor,
    loss_b: float | None,
    cosine_min: float = COSINE_MIN,
    loss_rtol: float = LOSS_RTOL,
    seen: Agreement | None = None,
) -> str | None:
    """Why two replies to the same message cannot both be honest, or None if they agree (`seen`: their
    `agreement`, when the caller has it already).

    Losses are compared when both are present (relative difference against the larger; a loss is compared as
    sent, beyond the plausible bound too, so a liar cannot skip the check with one); gradients by the
    cosine similarity of the flattened tensors. An all-zero gradient agrees only with another all-zero one
    (a tail with a zero loss gradient is honest only if both say so)."""
    seen = seen or agreement(grad_a, loss_a, grad_b, loss_b)
    if seen.loss_rdiff is not None and seen.loss_rdiff > loss_rtol:
        return f"losses {loss_a:.4g} and {loss_b:.4g} differ by more than {loss_rtol:.0%}"
    if not seen.shapes_match:
        return f"gradients of {grad_a.numel()} and {grad_b.numel()} elements"
    norm_a, norm_b = seen.norms
    if norm_a == 0.0 and norm_b == 0.0:
        return None
    if seen.cosine is None:
        return f"gradient norms {norm_a:.3g} and {norm_b:.3g}"
    if seen.cosine < cosine_min:
        return f"gradient cosine {seen.cosine:.3f} below {cosine_min}"
    return None


def epoch_lag(epochs_a: list[int], epochs_b: list[int]) -> int | None:
    """How far apart the next hop's weights behind two replies to one message are (its own epoch is the last of
    each list). None where the replies do not cover the same hops, which no honest pair does."""
    if len(epochs_a) != len(epochs_b) or not epochs_a:
        return None
    return abs(epochs_a[-1] - epochs_b[-1])


def loss_rtol(
    loss_a: float | None, epochs_a: list[int], loss_b: float | None, epochs_b: list[int], lane_fork: bool = False
) -> float:
    """The relative loss difference two honest replies to one message may show (see above): `LOSS_RTOL`, plus
    `LOSS_RTOL_PER_EPOCH` per epoch between the next hop's weights where the older weights gave the higher loss
    (what training does to a stale copy; a lower loss from older weights gets no slack); not compared (infinite)
    past `AUDIT_MAX_LAG`. A lane fork's is at least `LANE_LOSS_RTOL`, not that plus the slack: the epochs are each
    reply's word, and stacked, a liar claiming 7 epochs' lag would pass any loss (no recorded honest lane comparison
    came near `LANE_LOSS_RTOL` at any lag: 0.599 at most)."""
    lag = epoch_lag(epochs_a, epochs_b)
    if lag is None or loss_a is None or loss_b is None:
        rtol = LOSS_RTOL
    elif lag > AUDIT_MAX_LAG:
        return math.inf
    else:
        slack = LOSS_RTOL_PER_EPOCH * lag if older_lost_more(loss_a, epochs_a, loss_b, epochs_b) else 0.0
        rtol = LOSS_RTOL + slack
    return max(rtol, LANE_LOSS_RTOL) if lane_fork else rtol


def older_lost_more(loss_a: float | None, epochs_a: list[int], loss_b: float | None, epochs_b: list[int]) -> bool:
    """Whether the reply from the next hop's older weights (epochs apart) gave the higher loss: what a copy that
    fell behind while the loss falls gives."""
    if loss_a is None or loss_b is None or epoch_lag(epochs_a, epochs_b) in (None, 0):
        return False
    return (epochs_a[-1] < epochs_b[-1]) == (loss_a > loss_b)


def loss_gap_of_lag(
    seen: Agreement, rtol: float, loss_a: float | None, epochs_a: list[int], loss_b: float | None, epochs_b: list[int]
) -> bool:
    """Whether losses apart past their slack `rtol` may be a copy that fell behind rather than a lie, to be excused as
    a lag (`NextHop._compare_later`): the older weights lost more, by at most `LOSS_GAP_EXCUSED` per epoch between
    the two past the slack and never more than `LOSS_GAP_MAX` apart (a loss from the run's initial weights, 0.44
    apart at its first audit, is past it at a lag of 1; an honest loss spike and its recovery, 4.33 against 1.78 at 4
    epochs, 0.59 apart where the slack is 0.45, docs/DESIGN.md §4; the largest honest difference recorded at any lag
    is 0.60), and the gradients pass the one-audit sign check (`COSINE_MIN`)."""
    lag = epoch_lag(epochs_a, epochs_b) or 0
    bound = min(rtol + LOSS_GAP_EXCUSED * lag, LOSS_GAP_MAX)
    return (seen.loss_rdiff is not None and rtol < seen.loss_rdiff <= bound
            and seen.cosine is not None and seen.cosine >= COSINE_MIN
            and older_lost_more(loss_a, epochs_a, loss_b, epochs_b))


@dataclass
class Standing:
    clean: int = 0  # consecutive matching duplicates (or clean trust-on-first-use trips)
    verified_since: float | None = None  # when it became verified; earlier wins a disagreement


@dataclass
class Plan:
    """Where one trip goes: `primary` is the peer whose reply is used, `shadow` (if any) gets a duplicate."""

    primary: str  # verified, or the trust-on-first-use peer: only such replies are used (and their loss published)
    shadow: str | None


def _full_window(store: dict[frozenset[str], deque], pair: frozenset[str], value: object, size: int) -> deque | None:
    """Append `value` to `pair`'s last `size` values in `store`: them once there are `size`, else None."""
    window = store.setdefault(pair, deque(maxlen=size))
    window.append(value)
    return window if len(window) == size else None


@dataclass
class Ledger:
    """Which peers of the next stage this hop has verified. Pure: the caller passes the clock and the
    candidates (best first, from `Router.candidates`)."""

    verify_after: int = VERIFY_AFTER
    audit_rate: float = AUDIT_RATE
    lag_grace: float = LAG_GRACE
    lag_memory: float = LAG_MEMORY
    standings: dict[str, Standing] = field(default_factory=dict)
    # peer -> when its audits first came back too many epochs from the verified reply (kept `lag_memory`, whether
    # its record lives or not: an expired record must not buy a new grace)
    lagging_since: dict[str, float] = field(default_factory=dict)
    # a pair of peers -> the cosines of its last compared audits within `DRIFT_LAG` epochs, and the |log norm ratio|s
    # of those within `DRIFT_NORM_LAG`
    drift_cosines: dict[frozenset[str], deque[float]] = field(default_factory=dict)
    drift_norms: dict[frozenset[str], deque[float]] = field(default_factory=dict)
    # a pair of peers -> its last `FLIP_WINDOW` gradient cosines
    flip_cosines: dict[frozenset[str], deque[float]] = field(default_factory=dict)
    # a pair of peers -> whether each of its last `LOSS_WINDOW` compared losses was apart past its tolerance
    loss_gaps: dict[frozenset[str], deque[bool]] = field(default_factory=dict)
    # peer -> how many times it lost its standing (`distrust`): a comparison sent before the last is not judged
    verdicts: dict[str, int] = field(default_factory=dict)
    rng: random.Random = field(default_factory=random.Random)

    def verified(self, peer_id: str) -> bool:
        standing = self.standings.get(peer_id)
        return standing is not None and standing.verified_since is not None

    def trusted(self, peer_id: str) -> bool:
        """May a reply of `peer_id` be believed (its loss published)? Verified, or nobody is (trust on first use).
        A hop still uses an untrusted peer's gradient when no trusted one is left, to keep trips going."""
        return self.verified(peer_id) or not any(s.verified_since is not None for s in self.standings.values())

    def plan(self, candidates: list[str], busy: set[str] | None = None, now: float | None = None) -> Plan:
        """The primary is the best verified candidate; with none, the best candidate (trust on first use).
        A duplicate goes to the best unverified candidate not already checking a duplicate (`busy`), else,
        at `audit_rate`, to another verified candidate. At `now`, a candidate within its lag grace goes after
        the other unverified ones: its replies cannot verify it, and a liar claiming far epochs would otherwise
        hold the duplicates that newcomers need for the whole grace."""
        busy = busy or set()
        verified = [p for p in candidates if self.verified(p)]
        if not verified:
            return Plan(candidates[0], None)
        primary = verified[0]
        unverified = [p for p in candidates if not self.verified(p) and p not in busy]
        if now is not None:
            unverified.sort(key=lambda p: self._in_lag_grace(p, now))
        if unverified:
            return Plan(primary, unverified[0])
        if len(verified) > 1 and verified[1] not in busy and self.rng.random() < self.audit_rate:
            return Plan(primary, verified[1])
        return Plan(primary, None)

    def clean_trip(self, peer_id: str, now: float, tofu: bool) -> bool:
        """A trust-on-first-use trip answered cleanly (`tofu`) or a duplicate that matched: counts toward
        verification. True when this made the peer verified."""
        standing = self.standings.setdefault(peer_id, Standing())
        if standing.verified_since is not None:
            return False
        if tofu and any(s.verified_since is not None for s in self.standings.values()):
            return False  # trust on first use only while nobody is verified
        standing.clean += 1
        if standing.clean >= self.verify_after:
            standing.verified_since = now
            return True
        return False

    def loser(self, primary: str, shadow: str) -> str:
        """Of two peers whose replies disagree, the one to distrust: the unverified one, else the one with the
        shorter verified history (a tie goes against the shadow, the peer being audited)."""
        a, b = self.standings.get(primary, Standing()), self.standings.get(shadow, Standing())
        if a.verified_since is None:
            return primary if b.verified_since is not None else shadow
        if b.verified_since is None:
            return shadow
        return primary if a.verified_since > b.verified_since else shadow

    def excuse_lag(self, peer_id: str, now: float) -> bool:
        """An audit of `peer_id` came back too many epochs from the reply it is checked against: whether that is
        still excused (within `lag_grace` of its first such audit in the last `lag_memory`)."""
        self.lagging_since = {p: t for p, t in self.lagging_since.items() if now - t <= self.lag_memory}
        self.lagging_since.setdefault(peer_id, now)
        return self._in_lag_grace(peer_id, now)

    def _in_lag_grace(self, peer_id: str, now: float) -> bool:
        return peer_id in self.lagging_since and now - self.lagging_since[peer_id] <= self.lag_grace

    def drift(self, peer_a: str, peer_b: str, seen: Agreement, lag: int | None) -> str | None:
        """Weigh one audit of `peer_a` against `peer_b` that agreed: why their replies are not of one computation, or
        None: the median cosine of the pair's last `DRIFT_WINDOW` audits within `DRIFT_LAG` epochs, or the median norm
        ratio of its last `DRIFT_WINDOW` within `DRIFT_NORM_LAG` (see above). One audit's gradient says little (honest
        pairs reach cosine −0.5 and norm ratios of 20); the median of several at nearly the same weights says whether
        one of them forges its gradient. A verdict starts the pair afresh."""
        if lag is None or lag > DRIFT_NORM_LAG or seen.cosine is None:
            return None
        pair = frozenset((peer_a, peer_b))
        log_ratio = abs(math.log(seen.norms[0]) - math.log(seen.norms[1]))
        ratios = _full_window(self.drift_norms, pair, log_ratio, DRIFT_WINDOW)
        cosines = _full_window(self.drift_cosines, pair, seen.cosine, DRIFT_WINDOW) if lag <= DRIFT_LAG else None
        cosine = statistics.median(cosines) if cosines else math.inf
        ratio = math.exp(statistics.median(ratios)) if ratios else 1.0
        if cosine < DRIFT_COSINE:
            why = (f"over their last {DRIFT_WINDOW} audits within {DRIFT_LAG} epoch the median gradient cosine is "
                   f"{cosine:.2f}, below {DRIFT_COSINE}")
        elif ratio > DRIFT_NORM:
            why = (f"over their last {DRIFT_WINDOW} audits within {DRIFT_NORM_LAG} epochs the median gradient norm "
                   f"ratio is {ratio:.2f}, above {DRIFT_NORM}")
        else:
            return None
        self.drift_cosines.pop(pair, None)
        self.drift_norms.pop(pair, None)
        return why

    def forget_pairs_beyond(self, listed: set[str]) -> None:
        """Drop the drift, flip and loss windows of pairs with a peer not in `listed` (its record expired)."""
        for store in (self.drift_cosines, self.drift_norms, self.flip_cosines, self.loss_gaps):
            for pair in [pair for pair in store if not pair <= listed]:
                del store[pair]

    def flip(self, peer_a: str, peer_b: str, seen: Agreement) -> str | None:
        """Weigh one comparison's cosine: why the pair's last `FLIP_WINDOW` are a sign flip (their median below
        `COSINE_MIN`), or None (module docstring). A verdict starts the pair afresh."""
        if seen.cosine is None:
            return None
        pair = frozenset((peer_a, peer_b))
        window = _full_window(self.flip_cosines, pair, seen.cosine, FLIP_WINDOW)
        cosine = statistics.median(window) if window else math.inf
        if cosine >= COSINE_MIN:
            return None
        del self.flip_cosines[pair]
        return f"the median gradient cosine of their last {FLIP_WINDOW} audits is {cosine:.3f}, below {COSINE_MIN}"

    def losses_apart(self, peer_a: str, peer_b: str, seen: Agreement, rtol: float) -> bool:
        """Weigh one comparison's losses between two verified peers: whether the pair's losses were apart past their
        tolerance `rtol` in most of its last `LOSS_WINDOW` comparisons (a verdict, which starts the pair afresh).
        An honest replica's single reply can be far off: the third long honest run's one ban was a reply with loss
        8.79 (above ln V) and a gradient 81 times smaller than its partner's 5.95, at equal epochs, and every other
        comparison of that run agreed (benchmarks/results/audit-pairs-long-3.json). A liar that forges its
        loss forges it audit after audit, and is judged at its second gap in any `LOSS_WINDOW`; a gap past
        `LOSS_GAP_MAX` (one loss 4 times the other: no honest pair recorded past 0.60) is judged at once."""
        if seen.loss_rdiff is None:
            return False
        pair = frozenset((peer_a, peer_b))
        window = self.loss_gaps.setdefault(pair, deque(maxlen=LOSS_WINDOW))
        window.append(seen.loss_rdiff > rtol)
        if 2 * sum(window) <= LOSS_WINDOW and seen.loss_rdiff <= LOSS_GAP_MAX:
            return False
        del self.loss_gaps[pair]
        return True

    def distrust(self, peer_id: str) -> None:
        self.standings.pop(peer_id, None)
        self.verdicts[peer_id] = self.verdicts.get(peer_id, 0) + 1

    def verdicts_on(self, *peers: str) -> tuple[int, ...]:
        """How many times each of `peers` lost its standing so far: taken when a comparison is sent, a change by the
        time it is back means a verdict on the pair landed meanwhile, and it is not judged (module docstring)."""
        return tuple(self.verdicts.get(peer, 0) for peer in peers)

    def failed(self, peer_id: str) -> None:
        """A duplicate or trust-on-first-use trip that failed: the unverified peer's streak starts again."""
        standing = self.standings.get(peer_id)
        if standing is not None and standing.verified_since is None:
            standing.clean = 0
