"""Which stage a peer should serve (`--stage auto`), as pure functions of what the DHT shows.

The swarm is as fast as its weakest stage, so a newcomer joins an empty stage first, else the
stage with the least total throughput. A serving peer moves only when the move clearly raises
the swarm's bottleneck and does not empty the stage it leaves (hysteresis against flapping).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from swarm.manifest import Manifest
from swarm.records import PeerEntry, claimed_throughput, usable_peer

StageLoads = Mapping[int, Sequence[float]]  # stage → throughputs (tokens/s) of its online peers


def online_loads(
    stages: Mapping[int, Sequence[PeerEntry]], manifest: Manifest, t_fixed_sha256: str, own_peer_id: str
) -> dict[int, list[float]]:
    """Claimed throughputs of the other usable peers per stage, each clamped to the stage's plausible bound."""
    return {
        stage: [
            claimed_throughput(e.record, manifest)
            for e in entries
            if usable_peer(e.record, t_fixed_sha256, own_peer_id)
        ]
        for stage, entries in stages.items()
    }


def stage_totals(loads: StageLoads, num_stages: int) -> list[float]:
    return [float(sum(loads.get(stage, ()))) for stage in range(num_stages)]


def choose_stage(loads: StageLoads, num_stages: int, rng: random.Random | None = None) -> int:
    """An empty stage if there is one, else the weakest; ties broken at random (no herd)."""
    rng = rng or random.Random()
    empty = [stage for stage in range(num_stages) if not loads.get(stage)]
    if empty:
        return rng.choice(empty)
    totals = stage_totals(loads, num_stages)
    weakest = min(totals)
    return rng.choice([stage for stage, total in enumerate(totals) if total <= weakest * (1 + 1e-9)])


def bottleneck(totals: Sequence[float]) -> float:
    return min(totals) if totals else 0.0


def should_move(
    loads: StageLoads, num_stages: int, current: int, own_throughput: float, min_gain: float = 0.2
) -> int | None:
    """The stage to move to, or None.

    `loads` includes this peer in `current`. Moving is simulated: take our throughput out of
    `current`, add it to the weakest other stage, and move only if the bottleneck rises by more
    than `min_gain` (relative) and `current` keeps at least one other peer.
    """
    if len(loads.get(current, ())) <= 1:
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
