"""The driver: stage-0 peers own the data and keep several trips in flight (pipelining).

Each microbatch is one trip, `Hop.drive` (`peer/trip.py`); this module only feeds trips, runs again
those refused because U switched under them, and backs off while the pipeline is broken."""

from __future__ import annotations

import asyncio
import hashlib
import logging

from peer.trip import Hop
from swarm.data import load_splits
from swarm.wire import ErrorCode, WireError

logger = logging.getLogger("peer.driver")

RETRIES = 6  # at 0.5 s apart: covers the seconds a U switch takes to reach every stage


class Driver:
    def __init__(self, hop: Hop, peer_id: str, data: str | None, max_inflight: int, drain_timeout: float):
        self.hop, self.peer_id, self.data = hop, peer_id, data
        self.max_inflight, self.drain_timeout = max_inflight, drain_timeout
        self.inflight = 0
        self._stopped = False
        self._failures = 0

    def stop(self) -> None:
        self._stopped = True

    async def run(self) -> None:
        manifest = self.hop.manifest
        # every driver reads its own random windows of the corpus
        seed = int.from_bytes(hashlib.sha256(self.peer_id.encode()).digest()[:4], "little")
        train, _ = await asyncio.to_thread(load_splits, manifest, self.data, seed)
        await self._wait_for_pipeline()
        slots = asyncio.Semaphore(max(self.max_inflight, 1))
        pending: set[asyncio.Task] = set()
        try:
            while not self._stopped:
                await slots.acquire()
                if self._stopped:
                    break
                tokens = train.batch(manifest.batch.microbatch_size)
                task = asyncio.create_task(self._trip(tokens))
                pending.add(task)
                task.add_done_callback(lambda t: (pending.discard(t), slots.release()))
                if self._failures:  # back off while the pipeline is broken, instead of spinning
                    await asyncio.sleep(min(0.2 * 2 ** min(self._failures, 5), 5.0))
        finally:
            self._stopped = True
            if pending:  # trips still out after the drain are cancelled and awaited: none outlives the driver
                _, late = await asyncio.wait(pending, timeout=self.drain_timeout)
                for task in late:
                    task.cancel()
                await asyncio.gather(*late, return_exceptions=True)

    async def _wait_for_pipeline(self) -> None:
        """Start driving once the next stage has a live peer, rather than failing trips at start-up."""
        hop = self.hop
        if hop.runtime.stage.is_tail:
            return
        waited = 0.0
        while not self._stopped and not hop.router.candidates(1):
            if waited % 10 == 0:
                logger.info("%s waiting for a peer of stage 1", hop.label)
            await asyncio.sleep(1.0)
            waited += 1.0
            hop.router.update(await hop.fetch())

    async def _trip(self, tokens) -> None:
        """One microbatch; a trip refused because U changed under it (its hops disagree, or no peer of the
        next stage is at our version yet) is run again from the start under the current U."""
        self.inflight += 1
        try:
            for attempt in range(RETRIES + 1):
                try:
                    await self.hop.drive(tokens)
                    self._failures = 0
                    return
                except WireError as exc:
                    if exc.code not in (ErrorCode.WRONG_VERSION, ErrorCode.NO_PEER) or attempt == RETRIES:
                        raise
                    await asyncio.sleep(0.5)
        except WireError as exc:
            self._failures += 1
            logger.warning("%s trip dropped: %s", self.hop.label, exc)
        except Exception:  # noqa: BLE001 - one bad trip must not stop the driver
            self._failures += 1
            logger.exception("%s trip failed", self.hop.label)
        finally:
            self.inflight -= 1
