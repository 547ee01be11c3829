"""Averaging that one hostile peer of a stage cannot stop or bend: the math, as pure functions.

The peers of a stage average their gradients and their state with hivemind's butterfly all-reduce: each tensor
is cut into parts, each peer reduces a run of parts for everyone (every peer sends its part j to j's reducer,
which reduces what it received and sends the result back). A plain weighted mean lets one sender move a part
anywhere (a huge or NaN part, or a huge claimed weight), and lets a reducer return anything for its parts. Two
rules bound both:

**Contributions** (what a reducer does with the parts it receives, `robust_average`):
- a part that is not finite, of the wrong shape, or sent with a weight that is not a finite non-negative
  number is refused; weights are capped at the median weight of the part's senders (`weight_cap`), so no one
  buys the average with a claimed batch size (an honest peer that did accumulate more samples then counts like
  the median one: the average stays unbiased, only a little noisier);
- the rest are combined by CenteredClip (Karimireddy, He and Jaggi, 2021; the rule BTARD builds on): start
  at the coordinate-wise median, then repeatedly move by the weighted mean of every part's difference to the
  current centre, each difference clipped to norm `tau`. `tau` is twice the median distance of the parts to
  that median, the upper one for an even count (an honest majority sets it; honest parts of one scale are then
  not clipped, so with no hostile part the result is their weighted mean; the upper median: `centered_clip`),
  floored at `tau_floor` of the median's norm so that honest parts that agree almost exactly (parameters right
  after an averaging round) do not make every other part an outlier;
- a part further than `accuse_factor` × tau from the result is a `Finding` against its sender, but only where
  tau is the parts' own spread: where a floor set it, most parts agree exactly and a part apart from them may be
  honest (an embedding table's rows for bytes only one replica saw are zero in every other replica's gradient;
  clipping still bounds such a part, to its weight's share of the floor), and only for parts of at least
  `judged_values` values (hivemind cuts a 2-value bias into a part of its own, whose distances are noise), and
  among the senders whose part is not all zeros, at least three of them: a zero part is a sender whose graph never
  reached the slice (the θ head on a stage's last lane), not a vote on where honest parts lie.

**Reduced parts** (what comes back from another reducer, `check_reduced`): the result must be finite and its
change to this peer's own part no larger than what honest reducers produce. This peer reduced parts itself, so
it knows how far the honest average moved its own parts, relative to their norm; a part from another reducer
that moves this peer's part more than `reduced_factor` times as far and more than `reduced_floor` of its norm is
refused (this peer keeps its own values for that slice) and is a `Finding` against the reducer. Regions of a
model differ (an embedding's rows this peer saw few of, attention's query weights early in training), so a part
is judged against the larger of that change and the one this peer's own reductions made to that same part in
its recent rounds (`PartChanges`).

A reducer that returns the negated average (or zeros, or noise of the honest norm) stays inside that bound
wherever honest averages move a part about as far as its own norm (gradients of other microbatches later in
training). What it cannot hide is the direction: an honest average holds this peer's own part with its weight
(clipped at most to the radius), so over all the parts one reducer returned in a round it points along them,
⟨average, own⟩ ≥ `aligned_floor` × ‖own‖² (`Alignment`), the floor scaled down by this peer's weight share when
its weight is below an equal share (an honest average holds its parts only that much). One part alone is too
noisy to judge that way (3 to 6 % of honest parts pointed away, benchmarks/honest_accusations.py), so
`swarm/evidence.py` weighs rounds of alignment, not parts (docs/DESIGN.md §4).

A sender of −g (its gradient negated) lies as near the others as their own noise does, so CenteredClip averages it
in, and the average of a group of four holds half the expected gradient (×1.07 in loss, benchmarks/robust_stage.py).
Its direction gives it away too: the reducer judges each sender's parts of a round against the others' parts
clipped as CenteredClip clips them (`clip_rows`, `others_mean`), by each part's cosine averaged over the round,
weighted by the part's values and its pull, in full against them, at most a typical sender's along them
(`SenderDirection`): an honest gradient shares the expected gradient with them, −g points away. A round's lowest
cosine is a finding when it is below `sender_floor` and `sender_apart` below the next lowest (why only the lowest,
and apart: `direction_findings`). Scale buys a sender nothing (a part scaled up along its gradient counts as an
honest one; one scaled up against it counts by the size CenteredClip lets it pull with); −g/10 is judged as −g is;
zeros point nowhere and are not judged, neither for their direction nor for their distance (they do not vote).

A refusal is something no honest peer sends; a finding is a part past a statistical bound, which honest peers
also reach now and then (benchmarks/honest_accusations.py), so `swarm/evidence.py` decides when findings add
up to an accusation.

Guarantee, for a group of N senders of which f are hostile and f < N/2, each round: a hostile contribution
moves the average by at most about f·w·tau/W (w its capped weight, W the total), that is, no more than an
honest part a clip radius away; a NaN, inf or wrong-shaped contribution, or an absurd weight, changes nothing;
a hostile reducer moves no honest peer's tensors by more than `reduced_factor` × that peer's honest reference
for the part (its own reductions, in groups of three or more, where a hostile sender's pull on them is clipped).
Limits: with N = 2 there is no majority (the median of two is their mean) and nobody is judged; a hostile reducer
can bend its parts within that bound and along this peer's parts (shrink them, say); a contribution inside the clip
radius (a plausible but wrong gradient) is averaged in with its weight, and is judged for its direction only where
honest gradients share one (a sender of −g late in training, where they share little, is found in fewer rounds),
and over the round as a whole: a sender that negates a share of its parts small enough to keep its round's cosine
above zero (or within `sender_apart` of the next lowest) is not found; its pull along the others' average is then
not negative, but the negated parts are still pulled the wrong way, by at most the clip radius each (docs/DESIGN.md
§4). A sender of all zeros is never judged: it pulls the average toward zero by its weight share, within the clip
radius (it shrinks the step, or rides free). With lanes, a sender is judged only among the voters of its own lane
(`camps`; which lane is its: `peer/averaging_lanes.py`), at least three of them: one lane's gradients are not drawn
like another's (it sees other chunks of every sequence), and judged across lanes honest peers were accused
(docs/DESIGN.md §4). So with two replicas a lane nobody is judged, only clipped. A single nonzero value makes a sender
a voter.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class RobustRule:
    """The knobs of both rules; the defaults are what the peers use (module docstring)."""

    iterations: int = 3  # CenteredClip steps; each is one pass over the parts
    tau_scale: float = 2.0  # the clip radius in median distances: honest parts, alike in scale, go unclipped
    weight_cap: float = 1.0  # a sender's weight counts at most this many times the part's median weight
    tau_floor: float = 1e-3  # the clip radius is at least this share of the median's norm
    accuse_factor: float = 8.0  # a part further than this many clip radii from the result is accused
    reduced_factor: float = 8.0  # a reduced part may move this peer's part this many times the honest change
    reduced_floor: float = 1e-2  # ...and always by this share of its norm (honest parts that already agree)
    reduced_memory: int = 8  # a part's own reference is the largest change of this peer's last reductions of it
    aligned_floor: float = 0.1  # a reducer's averages of a round hold at least this share of this peer's parts
    typical_floor: float = 0.1  # a part's norm counts as at least this share of a typical part's of the same size
    judged_values: int = 16  # a part of fewer values (a bias of 2) is clipped, not judged: its distances are noise
    sender_floor: float = 0.0  # the lowest cosine of a round's senders to the others' clipped average below this...
    sender_apart: float = 0.2  # ...and this far below the next lowest is a finding


@dataclass(frozen=True)
class Finding:
    """A part past a statistical bound: why, and how many times past it (∞ for what no honest peer sends)."""

    why: str
    excess: float


@dataclass
class Aggregate:
    """The robust average of one part, its clip radius, the senders (by index) refused with why, each sender the
    radius judged: its `Finding` if it lay too far, else None, how each of those pointed along the others, and the
    capped weight of each sender averaged."""

    average: torch.Tensor
    tau: float
    refused: dict[int, str] = field(default_factory=dict)
    judged: dict[int, Finding | None] = field(default_factory=dict)
    directions: dict[int, SenderDirection] = field(default_factory=dict)
    weights: dict[int, float] = field(default_factory=dict)  # each averaged sender's weight, capped


def refusal(part: torch.Tensor, weight: float, shape: torch.Size) -> str | None:
    """Why a contribution cannot be averaged at all (None if it can)."""
    if part.shape != shape:
        return f"a part of shape {tuple(part.shape)}, expected {tuple(shape)}"
    if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight >= 0):
        return f"weight {weight!r} is not a finite non-negative number"
    if not torch.isfinite(part).all():
        return "a part with NaN or inf"
    return None


def capped_weights(weights: Sequence[float], cap: float) -> list[float]:
    """Each weight capped at `cap` × the median of the positive ones (all zero stays all zero)."""
    positive = [w for w in weights if w > 0]
    if not positive:
        return [0.0 for _ in weights]
    limit = cap * statistics.median(positive)
    return [min(float(w), limit) for w in weights]


def centered_clip(
    parts: torch.Tensor, weights: torch.Tensor, rule: RobustRule
) -> tuple[torch.Tensor, float, bool]:
    """CenteredClip of the rows of `parts` (n × m, float32) with `weights` (n, positive sum), from the
    coordinate-wise median; returns the centre, the clip radius used, and whether that radius is the parts'
    spread (`tau_scale` median distances) rather than a floor."""
    centre = parts.median(dim=0).values if parts.shape[0] > 2 else parts.mean(dim=0)
    # the distance within which half the parts lie, counted from the far side for an even count (the upper median):
    # f < N/2 hostile parts cannot set it beyond the honest distances (for an even N, up to the largest), and where
    # the parts fall in two honest camps of N/2 (a stage's lanes, whose gradients differ: module docstring) the nearer
    # camp's spread does not make the other one outliers
    distances = (parts - centre).norm(dim=1)
    spread = rule.tau_scale * float(distances.sort().values[parts.shape[0] // 2])
    tau = max(spread, rule.tau_floor * float(centre.norm()), 1e-12)
    total = weights.sum()
    for _ in range(rule.iterations):
        diffs = parts - centre
        scale = (tau / diffs.norm(dim=1).clamp_min(1e-30)).clamp(max=1.0)
        centre = centre + (weights * scale) @ diffs / total
    return centre, tau, spread >= tau


def robust_average(
    parts: Sequence[torch.Tensor],
    weights: Sequence[float],
    shape: torch.Size,
    rule: RobustRule = RobustRule(),
    camps: Sequence[Hashable] | None = None,
) -> Aggregate | None:
    """The part as a reducer returns it to every sender: refused contributions out, weights capped, CenteredClip
    of the rest, as float32 of `shape`. None when no contribution is usable. `camps` (one per part: each sender's
    lane) judges each sender only among the senders of its camp; the average is over all of them."""
    refused, usable = {}, []
    for index, (part, weight) in enumerate(zip(parts, weights, strict=True)):
        reason = refusal(part, weight, shape)
        if reason:
            refused[index] = reason
        else:
            usable.append(index)
    capped = capped_weights([float(weights[i]) for i in usable], rule.weight_cap)
    kept = [(i, w) for i, w in zip(usable, capped, strict=True) if w > 0]
    if not kept:
        return None
    stacked = torch.stack([parts[i].detach().reshape(-1).float() for i, _ in kept])
    kept_weights = torch.tensor([w for _, w in kept], dtype=torch.float32)
    centre, tau, spread = centered_clip(stacked, kept_weights, rule)
    judged: dict[int, Finding | None] = {}
    directions: dict[int, SenderDirection] = {}
    # a floor's radius judges nobody (module docstring), nor does the centre of two parts (their mean), nor a part of a
    # handful of values; an all-zero part does not vote on where honest parts lie (a sender whose graph never reached
    # the slice: the θ head on a stage's last lane), so the others are judged among themselves, and only among the
    # voters of their own camp (a stage's lanes see different chunks of every sequence: module docstring)
    voters = stacked.any(dim=1).nonzero().flatten().tolist()
    by_camp: dict[Hashable, list[int]] = {}
    for voter in voters:
        by_camp.setdefault(None if camps is None else camps[kept[voter][0]], []).append(voter)
    for members in by_camp.values() if stacked.shape[1] >= rule.judged_values else ():
        if len(members) < 3:
            continue
        rows, row_weights = stacked[members], kept_weights[members]
        centre_v, tau_v, spread_v = (centered_clip(rows, row_weights, rule) if len(members) < len(kept)
                                     else (centre, tau, spread))
        if spread_v:
            for row, finding, direction in _judgements(rows, row_weights, centre_v, tau_v, rule):
                judged[kept[members[row]][0]], directions[kept[members[row]][0]] = finding, direction
    return Aggregate(average=centre.reshape(shape), tau=tau, refused=refused, judged=judged, directions=directions,
                     weights=dict(kept))


def _judgements(rows: torch.Tensor, weights: torch.Tensor, centre: torch.Tensor, tau: float, rule: RobustRule):
    """Each row's `Finding` (None within `accuse_factor` clip radii of `centre`) and its `SenderDirection` against the
    others' clipped rows, as (row, finding, direction)."""
    distances = (rows - centre).norm(dim=1)
    clipped = clip_rows(rows, centre, tau)
    toward, sizes = others_mean(clipped, weights), clipped.norm(dim=1)
    typical = float(sizes.median())
    for row in range(rows.shape[0]):
        radii = float(distances[row]) / tau
        why = f"a part {radii:.1f} clip radii from the robust average"
        direction = SenderDirection()
        direction.add(rows[row], toward[row], float(sizes[row]) / typical if typical > 0 else 1.0)
        yield row, (Finding(why, radii / rule.accuse_factor) if radii > rule.accuse_factor else None), direction


def clip_rows(parts: torch.Tensor, centre: torch.Tensor, tau: float) -> torch.Tensor:
    """Each row of `parts` clipped to within `tau` of `centre`: about what CenteredClip (which clips around each
    step's centre) lets each of them pull."""
    diffs = parts - centre
    return centre + diffs * (tau / diffs.norm(dim=1, keepdim=True).clamp_min(1e-30)).clamp(max=1.0)


def others_mean(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Row i: the `weights`-weighted (float32) mean of the other rows. Applied to `clip_rows`, it is the reference
    sender i's part is judged against for its direction, which a hostile sender moves by no more than its clipped
    pull."""
    total = weights @ rows
    rest = (weights.sum() - weights).clamp_min(1e-30)
    return (total - weights[:, None] * rows) / rest[:, None]


def relative_change(before: torch.Tensor, after: torch.Tensor) -> float:
    """‖after − before‖ / ‖before‖ (∞ when `after` is not finite; the change itself when `before` is zero)."""
    if not torch.isfinite(after).all():
        return math.inf
    change = float((after.float() - before.float()).norm())
    norm = float(before.float().norm())
    return change / norm if norm > 0 else change


class PartChanges:
    """The relative change this peer's own reductions made to each part (keyed by tensor and part index), over its
    last `memory` reductions of that part: the honest change of *that* slice, which `check_reduced` compares a
    reduced part from another peer with. hivemind's leader shuffles the group's order every round, so the peers
    take turns at each part and a peer soon holds a reference for most of them."""

    def __init__(self, memory: int):
        self.memory = memory
        self._changes: dict[Hashable, deque[float]] = {}

    def record(self, key: Hashable, change: float) -> None:
        if math.isfinite(change):
            self._changes.setdefault(key, deque(maxlen=self.memory)).append(change)

    def reference(self, key: Hashable) -> float | None:
        """The largest remembered change of the part, or None if this peer never reduced it."""
        changes = self._changes.get(key)
        return max(changes) if changes else None


def check_reduced(
    own_part: torch.Tensor,
    delta: torch.Tensor,
    honest_change: float,
    rule: RobustRule,
    reference: float | None = None,
    typical_rms: float | None = None,
) -> Finding | None:
    """Why a reduced part from another peer is refused (None if it is used). `delta` is what it says to add to
    `own_part`; `honest_change` the relative change this peer's own reduction made to the part it reduced this round,
    `reference` the largest it made to this very part in earlier rounds (`PartChanges`), if it ever reduced it.
    The bound is `reduced_factor` times the larger of the two. `typical_rms`, the per-value RMS of the parts this peer
    reduced this round, floors the part's norm at `typical_floor` of a typical part of its size: an honest average
    moves a part of this peer's that is nearly zero (an embedding's rows it saw none of) thousands of times its norm
    (2.4e3 on real peers, an honest reducer accused at once)."""
    if delta.shape != own_part.shape:
        return Finding(f"a reduced part of shape {tuple(delta.shape)}, expected {tuple(own_part.shape)}", math.inf)
    if not torch.isfinite(delta).all():
        return Finding("a reduced part with NaN or inf", math.inf)
    norm = float(own_part.float().norm())
    if typical_rms:
        norm = max(norm, rule.typical_floor * typical_rms * own_part.numel() ** 0.5)
    moved = float(delta.float().norm())
    change = moved / norm if norm > 0 else moved
    bound = max(rule.reduced_factor * max(honest_change, reference or 0.0), rule.reduced_floor)
    if change > bound:
        return Finding(f"a reduced part that moves this peer's part by {change:.3g} of its norm (bound {bound:.3g})",
                       change / bound)
    return None


@dataclass
class Alignment:
    """How far the averages one reducer returned in a round point along this peer's own parts: Σ⟨average, own⟩
    over Σ‖own‖², summed over every part of the round that was used (module docstring)."""

    dot: float = 0.0
    norm_sq: float = 0.0

    def add(self, own: torch.Tensor, average: torch.Tensor) -> None:
        own, average = own.detach().reshape(-1).float(), average.detach().reshape(-1).float()
        self.dot += float(own @ average)
        self.norm_sq += float(own @ own)

    def finding(self, rule: RobustRule, weight_share: float = 1.0) -> Finding | None:
        """A `Finding` if the averages held less than `aligned_floor` of this peer's parts, times `weight_share`
        where that is below 1 (None if they held enough, or there was nothing of this peer's to hold: then nothing
        was judged, see `judged`). `weight_share` is this peer's capped weight against an equal share, N × w / W:
        an honest average holds about w / W of this peer's own parts, so a peer of fewer samples than the others
        (weight 1 among peers of 4: 1/13 of the average) finds honest averages under the floor whenever the others'
        gradients share little with its own (benchmarks/honest_accusations.py `--samples 1 4 4 4`)."""
        if not self.judged:
            return None
        share = self.dot / self.norm_sq
        floor = rule.aligned_floor * min(1.0, max(weight_share, 0.0))
        if share >= floor:
            return None
        return Finding(f"averages that hold {share:.2f} of this peer's parts (floor {floor:.3g})", 1.0)

    @property
    def judged(self) -> bool:
        return self.norm_sq > 0 and math.isfinite(self.dot)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """cos(a, b) of two parts, flattened; None when either is zero or the result is not finite."""
    a, b = a.detach().reshape(-1).float(), b.detach().reshape(-1).float()
    norm = float(a.norm()) * float(b.norm())
    cosine = float(a @ b) / norm if norm > 0 else math.nan
    return cosine if math.isfinite(cosine) else None


@dataclass
class SenderDirection:
    """How far the parts one sender sent a reducer in a round point along the others' (`others_mean` of `clip_rows`):
    each part's cosine with theirs, averaged over the round's parts, each weighted by its number of values times its
    *pull*: the size of its clipped row over the median of the senders' clipped rows of that part, counted in full
    for a part pointing away and at most 1 for a part pointing along. An honest gradient shares with the others'
    average the direction of the expected gradient; a sender of −g points away from it. Weighted so, scale buys a
    sender nothing: a part scaled up along its gradient cannot outweigh parts that point away (joined end to end,
    one part ×8 hid −g on three), and a part of −2g (inside the radius, twice −g's pull) counts twice (by values
    alone, a cleaner gradient on the other parts hid −2g on six of ten)."""

    weighted: float = 0.0  # Σ values × weight × cosine over the parts judged
    weight: float = 0.0  # Σ values × weight of those parts

    def add(self, own: torch.Tensor, others: torch.Tensor, pull: float = 1.0) -> None:
        """One part, the others' reference for it, and its pull; a part with nothing to judge (zeros) does not
        count."""
        cosine = _cosine(own, others)
        if cosine is None or not math.isfinite(pull) or pull <= 0:
            return
        weight = own.numel() * (pull if cosine < 0 else min(pull, 1.0))
        self.weighted += weight * cosine
        self.weight += weight

    def merge(self, other: SenderDirection) -> None:
        self.weighted += other.weighted
        self.weight += other.weight

    @property
    def cosine(self) -> float | None:
        """None when no part had anything to judge."""
        return self.weighted / self.weight if self.weight > 0 else None


def direction_findings(directions: dict[Hashable, SenderDirection], rule: RobustRule) -> dict[Hashable, Finding | None]:
    """Each sender's verdict on its round's direction: a `Finding` for the one with the lowest cosine if that is below
    `sender_floor` and `sender_apart` below the next lowest, None for the other judged ones; nothing with fewer than
    three senders to judge. Only the lowest, because a hostile sender can bend the others' clipped average against
    every honest one a little (by its clipped pull); it cannot choose which honest sender's own noise points further
    away, while its own −g stays furthest. Apart from the next, because in a round where the gradients of other
    microbatches share little, some honest sender is lowest and below zero by chance, near the next one
    (benchmarks/honest_accusations.py)."""
    cosines = {sender: d.cosine for sender, d in directions.items() if d.cosine is not None}
    if len(cosines) < 3:
        return {}
    lowest, second = sorted(cosines, key=cosines.__getitem__)[:2]
    findings: dict[Hashable, Finding | None] = dict.fromkeys(cosines)
    if cosines[lowest] < min(rule.sender_floor, cosines[second] - rule.sender_apart):
        why = (f"parts at cosine {cosines[lowest]:.2f} to the others' average (floor {rule.sender_floor}, next lowest "
               f"{cosines[second]:.2f})")
        findings[lowest] = Finding(why, 1.0)
    return findings
