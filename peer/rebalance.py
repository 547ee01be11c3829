"""Where a peer serves: the (stage, lane) it joins and, while it serves, whether a move would pay.

The policy is `peer/lanes.py`'s, on `peer/placement.py`'s rules; this is the part that reads the DHT
for it, waits before the first choice, and logs what it decided. `PeerDaemon` asks and moves.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable

from hivemind.utils.timed_storage import get_dht_time

from peer.lanes import Slot, allowed_slots, choose_slot, lane_loads, move_target
from peer.options import PeerOptions
from peer.placement import counts_for_placement, placement_wait
from swarm.manifest import Manifest

logger = logging.getLogger("peer")


class StageMove(Exception):
    """Raised out of serving a stage: the peer leaves it and serves `target` instead."""

    def __init__(self, target: Slot):
        super().__init__(f"moving to stage {target[0]} lane {target[1]}")
        self.target = target


class Placement:
    """This peer's placement policy, with what it reads: the manifest, --stage / --lane, and the DHT (`fetch`)."""

    def __init__(
        self,
        manifest: Manifest,
        options: PeerOptions,
        pinned_lane: int | None,
        fetch: Callable[[], Awaitable[dict]],
        peer_id: Callable[[], str],
        label: Callable[[], str],
        rng: random.Random,
    ):
        self.manifest, self.options, self.fetch, self.pinned_lane = manifest, options, fetch, pinned_lane
        self.peer_id, self.label, self.rng = peer_id, label, rng

    @property
    def pinned_stage(self) -> int | None:
        return None if self.options.stage == "auto" else int(self.options.stage)

    @property
    def pinned(self) -> bool:
        """--stage and --lane leave nothing to choose: no rebalancing."""
        return self.pinned_stage is not None and self.pinned_lane is not None

    async def first_slot(self, up_for: float) -> Slot:
        """Wait until every record we would count was refreshed after we came up `up_for` seconds ago
        (`placement_wait`), plus a random delay against a herd of newcomers, then the stage (and lane) that
        needs us most."""
        stage, lane = self.pinned_stage, self.pinned_lane
        if stage is not None and lane is not None:
            return stage, lane
        await asyncio.sleep(placement_wait(up_for) + self.rng.uniform(0, self.options.placement_delay))
        loads = await self.loads(self.manifest.t_fixed_sha256, frozenset())
        slot = choose_slot(loads, self.manifest.num_stages, self.manifest.lanes, self.rng, stage, lane)
        logger.info("%s placement: live lane totals %s -> stage %d lane %d", self.label(), _rounded(loads), *slot)
        return slot

    async def loads(self, t_fixed_sha256: str, unreachable: set[str] | frozenset) -> dict:
        """Every stage's live peers' throughputs per lane (`peer/lanes.py`); raises if the DHT cannot be read."""
        stages, now, me = await self.fetch(), get_dht_time(), self.peer_id()
        return lane_loads(
            stages, self.manifest, lambda e: counts_for_placement(e, now, t_fixed_sha256, me, unreachable)
        )

    async def move_target(
        self, here: Slot, throughput: float, t_fixed_sha256: str, unreachable: set[str], online_since: float
    ) -> Slot | None:
        """The (stage, lane) a move from `here` would raise the bottleneck enough for (`peer/lanes.py`
        `move_target`), among those --stage / --lane leave open, counting only live peers we can reach; None
        to stay (also when the DHT cannot be read)."""
        try:
            loads = await self.loads(t_fixed_sha256, unreachable)
        except Exception as exc:  # noqa: BLE001 - try again next round
            logger.warning("%s could not read the DHT for rebalancing: %s", self.label(), exc)
            return None
        loads.setdefault(here[0], {}).setdefault(here[1], []).append(throughput)
        slots = allowed_slots(self.manifest.num_stages, self.manifest.lanes, self.pinned_stage, self.pinned_lane)
        served_for = time.monotonic() - online_since
        return move_target(loads, slots, here, throughput, self.options.hysteresis, served_for)

    async def run(
        self,
        move_target: Callable[[], Awaitable[Slot | None]],
        stage: Callable[[], int],
        switch_lane: Callable[[int], Awaitable[None]],
    ) -> None:
        """Every ~`rebalance_interval`: if a move would pay (`move_target`), wait a random part of
        `recheck_delay` and look again; move only if it still pays (another peer may have taken the hole
        meanwhile): to another lane of this stage with `switch_lane`, to another stage by raising `StageMove`."""
        while True:
            await asyncio.sleep(self.options.rebalance_interval * self.rng.uniform(0.8, 1.2))
            target = await move_target()
            if target is None:
                continue
            delay = self.options.hysteresis.recheck_delay * self.rng.uniform(0.2, 1.0)
            where = f"stage {target[0]} lane {target[1]}"
            logger.info("%s rebalancing: %s needs help, checking again in %.0fs", self.label(), where, delay)
            await asyncio.sleep(delay)
            if await move_target() != target:
                logger.info("%s rebalancing: %s no longer needs us, staying", self.label(), where)
                continue
            logger.info("%s rebalancing: moving to %s", self.label(), where)
            if target[0] != stage():
                raise StageMove(target)
            await switch_lane(target[1])


def _rounded(loads: dict) -> dict:
    """Lane totals for a log line."""
    return {stage: {lane: round(sum(v), 1) for lane, v in lanes.items()} for stage, lanes in loads.items()}
