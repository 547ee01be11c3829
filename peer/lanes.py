"""Lanes (issue 17): which chunk of every sequence a peer holds when its stage is context-parallel, as pure
functions of what the DHT shows.

A run with `context_parallel.size` P > 1 splits every sequence into P chunks; lane c of a stage holds chunk c.
A trip needs one peer of every lane of every stage, so a stage serves at most what its weakest lane serves, and
the swarm at most what its weakest (stage, lane) *slot* serves: the swarm's bottleneck is the minimum over all
slots of the summed throughput of the slot's peers. With P = 1 there is one slot per stage (lane 0) and every
rule below is the stage rule of `peer/placement.py` unchanged.

Placement reuses placement's policy rather than a second one: `pick_weakest` picks the stage (a stage with an
empty lane counts as empty: it cannot carry a trip), then, applied to the stage's lanes, the lane (an empty one
first, else the one with the least throughput, within the move threshold the one with fewest peers). Moves reuse
`should_move` on the flat list of slots the peer may take, so the simulated move measures the real bottleneck,
never empties the lane it leaves, and keeps the hysteresis (dwell, gain, re-check) of stage moves.

A lane is a claim like any other: a record whose lane is not below P (with context parallelism off: any lane
but 0) is dropped wherever lanes are counted, so it gets no trips and fills no lane.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from peer.placement import Hysteresis, choose_stage, pick_weakest, should_move
from peer.routing import Router
from swarm.manifest import Manifest
from swarm.records import PeerEntry, StagePeerRecord, claimed_throughput

LaneLoads = Mapping[int, Mapping[int, Sequence[float]]]  # stage → lane → throughputs (tokens/s) of its live peers
Slot = tuple[int, int]  # (stage, lane)


def valid_lane(record: StagePeerRecord, lanes: int) -> bool:
    """Whether the record's lane exists in a run with `lanes` lanes (the schema already refuses a negative one)."""
    return record.lane < lanes


def lane_loads(
    stages: Mapping[int, Sequence[PeerEntry]], manifest: Manifest, counts: Callable[[PeerEntry], bool]
) -> dict[int, dict[int, list[float]]]:
    """Claimed throughputs (clamped, `claimed_throughput`) of the peers that count for placement (`counts`:
    `counts_for_placement` with the reader's clock, hashes and bans) per stage and lane; every lane of a listed
    stage is present, an empty one as []."""
    lanes = manifest.lanes
    out: dict[int, dict[int, list[float]]] = {}
    for stage, entries in stages.items():
        per_lane: dict[int, list[float]] = {lane: [] for lane in range(lanes)}
        for e in entries:
            if valid_lane(e.record, lanes) and counts(e):
                per_lane[e.record.lane].append(claimed_throughput(e.record, manifest))
        out[stage] = per_lane
    return out


def lane_totals(stage_lanes: Mapping[int, Sequence[float]], lanes: int) -> list[float]:
    return [float(sum(stage_lanes.get(lane, ()))) for lane in range(lanes)]


def stage_capacity(stage_lanes: Mapping[int, Sequence[float]], lanes: int) -> float:
    """What a stage serves: a trip needs every lane, so its weakest lane's summed throughput (0 if one is empty)."""
    return min(lane_totals(stage_lanes, lanes))


def choose_slot(
    loads: LaneLoads,
    num_stages: int,
    lanes: int,
    rng: random.Random | None = None,
    stage: int | None = None,
    lane: int | None = None,
) -> Slot:
    """Where a newcomer goes. `stage` / `lane` pin what `--stage N` / `--lane N` fixed. The stage: `pick_weakest`
    of each stage's capacity, a stage with an empty lane counting as empty (with a pinned lane: `choose_stage` on
    that lane's peers of each stage). Then the lane: `choose_stage` on the chosen stage's lanes."""
    rng = rng or random.Random()
    if stage is None:
        if lane is not None:
            stage = choose_stage({s: list(loads.get(s, {}).get(lane, ())) for s in range(num_stages)}, num_stages, rng)
        else:  # a stage counts as many peers as its thinnest lane holds (the count a single crash can empty it from)
            thinnest = [min(len(loads.get(s, {}).get(c, ())) for c in range(lanes)) for s in range(num_stages)]
            stage = pick_weakest([stage_capacity(loads.get(s, {}), lanes) for s in range(num_stages)], thinnest, rng)
    if lane is None:
        lane = choose_stage(loads.get(stage, {}), lanes, rng)
    return stage, lane


def allowed_slots(num_stages: int, lanes: int, stage: int | None = None, lane: int | None = None) -> list[Slot]:
    """The slots a peer may serve: every (stage, lane), less what `--stage` / `--lane` pinned."""
    return [
        (s, c)
        for s in range(num_stages)
        for c in range(lanes)
        if (stage is None or s == stage) and (lane is None or c == lane)
    ]


def move_target(
    loads: LaneLoads,
    slots: Sequence[Slot],
    current: Slot,
    own_throughput: float,
    policy: Hysteresis,
    served_for: float | None = None,
) -> Slot | None:
    """The slot to move to, or None: `should_move` over `slots` (`allowed_slots`, which include `current`), each
    slot a "stage" of its own. `loads` includes this peer in `current`. Over all slots the simulated bottleneck
    is the swarm's; over a pinned subset, the subset's."""
    flat = {i: list(loads.get(s, {}).get(c, ())) for i, (s, c) in enumerate(slots)}
    target = should_move(
        flat,
        len(slots),
        slots.index(current),
        own_throughput,
        policy.min_gain,
        served_for=served_for,
        min_dwell=policy.min_dwell,
    )
    return None if target is None else slots[target]


@dataclass(frozen=True)
class LaneGroup:
    """The peers a trip uses in one stage: `peers[c]` holds lane c."""

    stage: int
    peers: tuple[str, ...]


@dataclass(frozen=True)
class EmptyLane:
    """No usable peer holds `lane` of `stage`: no trip can start until one does."""

    stage: int
    lane: int

    def __str__(self) -> str:
        return f"lane {self.lane} of stage {self.stage} is empty"


STRIKE_MEMORY = 30.0  # seconds after its last strike that a peer's strikes are forgotten


@dataclass
class Strikes:
    """Failed trips of a peer's groups since its last good one, as one driver counts them (`pick_group` prefers
    fewer). Which lane peer made a group fail cannot always be told, so every peer of the group gets one and an
    honest one loses them at its next good trip. A peer that is never picked has no good trip to clear them,
    so they are forgotten `memory` seconds after the last: a peer struck for a passing cause (a lane partner
    that had not announced yet when it checked) is tried again, and one with a standing fault costs each driver
    one failed group per `memory` seconds rather than being tried on every trip."""

    memory: float = STRIKE_MEMORY
    struck: dict[str, tuple[int, float]] = field(default_factory=dict)  # peer → (strikes, when the last came)

    def strike(self, peers: Iterable[str], now: float) -> None:
        for peer in peers:
            self.struck[peer] = (self.struck.get(peer, (0, now))[0] + 1, now)

    def clear(self, peers: Iterable[str]) -> None:
        for peer in peers:
            self.struck.pop(peer, None)

    def current(self, listed: Container[str], now: float) -> dict[str, int]:
        """The strikes that count now, forgetting those of unlisted peers and those older than `memory`."""
        self.struck = {p: (n, t) for p, (n, t) in self.struck.items() if p in listed and now - t < self.memory}
        return {p: n for p, (n, _) in self.struck.items()}


def pick_group(
    router: Router,
    stage: int,
    lanes: int,
    now: float | None = None,
    taken: Mapping[int, str] | None = None,
    strikes: Mapping[str, int] | None = None,
) -> LaneGroup | EmptyLane:
    """One peer per lane of `stage` for a trip, or the first empty lane. Lanes in `taken` are already held
    (the driver's own lane of stage 0); the others get, among the peers claiming that lane, the one with the
    fewest `strikes` (failed trips since its last good one, as the driver counts them) and of those the best
    of `router.candidates` (compatible, unbanned, least expected wait on what this peer measured)."""
    now = time.monotonic() if now is None else now
    chosen: dict[int, str] = dict(taken or {})
    strikes = strikes or {}
    candidates = router.candidates(stage, now)
    for entry in sorted(candidates, key=lambda e: strikes.get(e.record.peer_id, 0)):  # stable: best first on ties
        lane = entry.record.lane
        if valid_lane(entry.record, lanes) and lane not in chosen:
            chosen[lane] = entry.record.peer_id
    for lane in range(lanes):
        if lane not in chosen:
            return EmptyLane(stage, lane)
    return LaneGroup(stage, tuple(chosen[lane] for lane in range(lanes)))


def pick_audit(
    router: Router,
    group: Sequence[Sequence[str]],
    rate: float,
    rng: random.Random,
    now: float | None = None,
    strikes: Mapping[str, int] | None = None,
) -> tuple[int, tuple[str, ...]] | None:
    """With probability `rate`, where an audit fork of a trip over `group` goes (`peer/lane_claim.py`): a stage
    s >= 1, at random among those where some lane has a candidate the group does not use, and for each of its
    lanes such a peer (at random among the fewest `strikes`, so every peer of a slot is audited in turn) or, where
    the lane has none, the group's own (it serves both trips, and that lane compares nothing). None: no fork (or
    nobody to fork to, so a swarm with one peer per slot is never audited)."""
    if rng.random() >= rate:
        return None
    now = time.monotonic() if now is None else now
    strikes = strikes or {}
    lanes, forks = len(group[0]), []
    for stage in range(1, len(group)):
        others: dict[int, list[str]] = {}
        for entry in router.candidates(stage, now):
            lane, peer = entry.record.lane, entry.record.peer_id
            if valid_lane(entry.record, lanes) and peer not in group[stage]:
                others.setdefault(lane, []).append(peer)
        if others:
            forks.append((stage, others))
    if not forks:
        return None
    stage, others = rng.choice(forks)
    peers = []
    for lane in range(lanes):
        pool = others.get(lane)
        if not pool:
            peers.append(group[stage][lane])
            continue
        fewest = min(strikes.get(p, 0) for p in pool)
        peers.append(rng.choice([p for p in pool if strikes.get(p, 0) == fewest]))
    return stage, tuple(peers)


def lane_refusal(lane: int, lanes: int) -> str | None:
    """Why `--lane lane` cannot serve a run with `lanes` lanes, or None if it can."""
    if lanes == 1 and lane != 0:
        return f"--lane {lane}: this run has no context parallelism, its only lane is 0"
    if not 0 <= lane < lanes:
        return f"--lane {lane} is out of range: this run's stages have lanes 0..{lanes - 1} (context_parallel.size)"
    return None
