"""Which stage a peer should serve (`--stage auto`), as pure functions of what the DHT shows.

The swarm is as fast as its weakest stage, so a newcomer joins an empty stage first, else the
stage with the least total throughput (within the move threshold, the one with fewest peers). A serving
peer moves only when the move clearly raises
the swarm's bottleneck and does not empty the stage it leaves (hysteresis against flapping).

Only live peers count. A record lives `RECORD_TTL` (30 s) after its last announcement, so a peer
killed a second ago still has one for half a minute; counting it sent replacements to the stage
that only looked full. A record counts when it was refreshed within `LIVENESS_WINDOW` (its announce
interval plus slack) and its peer is not one this peer failed to reach (the router's bans). A
newcomer reads the swarm only after it has itself been up for that window, so every record it
counts was refreshed after it started: a peer that died before it came up never counts. Joining
peers count (they are on their way), leaving ones do not.

Moves have real hysteresis (`Hysteresis`, after Petals' block selection): a minimum dwell on a
stage, a required gain of the simulated move, and a random delay followed by a re-check, so that
of several peers who see the same hole only the first moves; the others see its `leaving` record
at the re-check, and the simulated move no longer gains.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

from swarm.records import ANNOUNCE_INTERVAL, RECORD_TTL, PeerEntry, StagePeerRecord, speaks_our_wire

StageLoads = Mapping[int, Sequence[float]]  # stage → throughputs (tokens/s) of its live peers

# A live peer re-announces every ANNOUNCE_INTERVAL (10 s); the slack covers a store that took long on a busy
# machine. A record older than this is from a peer that stopped announcing (dead, or stuck): a peer that died
# stops counting 15 s after its last announce at most, and a newcomer waits this long before placing itself.
LIVENESS_SLACK = 5.0
LIVENESS_WINDOW = ANNOUNCE_INTERVAL + LIVENESS_SLACK


@dataclass(frozen=True)
class Hysteresis:
    """When a serving peer may move: after `min_dwell` seconds online on its stage, for a simulated gain of
    the bottleneck above `min_gain`, still there after a random `recheck_delay` (a fraction 0.2-1 of it)."""

    min_dwell: float = 300.0
    min_gain: float = 0.2
    recheck_delay: float = 30.0


def record_age(expiration: float, now: float, ttl: float = RECORD_TTL) -> float:
    """Seconds since the record was announced (it was stored to expire `ttl` later)."""
    return max(0.0, now - (expiration - ttl))


def counts_for_placement(
    entry: PeerEntry, now: float, t_fixed_sha256: str, own_peer_id: str, unreachable: Set[str] = frozenset()
) -> bool:
    """Another peer of our function and wire (one that cannot carry our trips covers no slot for us), online or
    joining, refreshed within `LIVENESS_WINDOW`, and not one this peer failed to reach."""
    record: StagePeerRecord = entry.record
    return (
        record.state in ("online", "joining")
        and record.t_fixed_sha256 == t_fixed_sha256
        and speaks_our_wire(record.software_version)
        and record.peer_id != own_peer_id
        and record.peer_id not in unreachable
        and record_age(entry.expiration, now) <= LIVENESS_WINDOW
    )


def placement_wait(up_for: float) -> float:
    """How long a newcomer that has been up `up_for` seconds waits before reading the swarm, so that any
    record it counts was refreshed after it came up."""
    return max(0.0, LIVENESS_WINDOW - up_for)


def stage_totals(loads: StageLoads, num_stages: int) -> list[float]:
    return [float(sum(loads.get(stage, ()))) for stage in range(num_stages)]


def choose_stage(
    loads: StageLoads, num_stages: int, rng: random.Random | None = None, margin: float = Hysteresis.min_gain
) -> int:
    """Where a newcomer goes among `num_stages` stages of `loads`: `pick_weakest` of their totals and peer counts."""
    counts = [len(loads.get(stage, ())) for stage in range(num_stages)]
    return pick_weakest(stage_totals(loads, num_stages), counts, rng, margin)


def pick_weakest(
    totals: Sequence[float], peers: Sequence[int], rng: random.Random | None = None,
    margin: float = Hysteresis.min_gain,
) -> int:
    """The index of a stage with no `peers` if there is one, else of the weakest of `totals`; ties broken by fewest
    peers, then by the lower total, then at random (no herd).

    Totals within `margin` of the weakest count as tied: a peer would not move for a gain that small
    (`should_move`), and one throughput probe at start-up, taken while other processes load the machine, is
    that noisy (a local swarm measured one peer faster than two peers of the other stage together). Among tied
    stages, the one with fewer peers is the one a single crash leaves empty; among those, the weakest (a stage a
    newcomer wrongly chose within the margin would stay: moving back never gains more than the margin)."""
    rng = rng or random.Random()
    empty = [stage for stage, count in enumerate(peers) if not count]
    if empty:
        return rng.choice(empty)
    weakest = min(totals)
    tied = [stage for stage, total in enumerate(totals) if total <= weakest * (1 + margin) + 1e-12]
    fewest = min(peers[stage] for stage in tied)
    thinnest = [stage for stage in tied if peers[stage] == fewest]
    lowest = min(totals[stage] for stage in thinnest)
    return rng.choice([stage for stage in thinnest if totals[stage] <= lowest * (1 + 1e-9)])


def bottleneck(totals: Sequence[float]) -> float:
    return min(totals) if totals else 0.0


def should_move(
    loads: StageLoads,
    num_stages: int,
    current: int,
    own_throughput: float,
    min_gain: float = Hysteresis.min_gain,
    served_for: float | None = None,
    min_dwell: float = 0.0,
) -> int | None:
    """The stage to move to, or None.

    `loads` includes this peer in `current`. A peer that has served `current` for less than `min_dwell`
    seconds (`served_for`) stays. Moving is simulated: take our throughput out of
    `current`, add it to the weakest other stage, and move only if the bottleneck rises by more
    than `min_gain` (relative) and `current` keeps at least one other peer.
    """
    if len(loads.get(current, ())) <= 1 or (served_for is not None and served_for < min_dwell):
        return None
    totals = stage_totals(loads, num_stages)
    before = bottleneck(totals)
    without_us = list(totals)
    without_us[current] -= own_throughput
    candidates = [stage for stage in range(num_stages) if stage != current]
    if not candidates:
        return None
    target = min(candidates, key=lambda stage: without_us[stage])
    after_totals = list(without_us)
    after_totals[target] += own_throughput
    after = bottleneck(after_totals)
    if before <= 0:
        return target if after > 0 else None
    return target if after > before * (1 + min_gain) else None
