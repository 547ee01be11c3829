"""The driver: stage-0 peers own the data and keep several trips in flight (pipelining).

Each microbatch is one trip, `Hop.drive` (`peer/trip.py`); this module only feeds trips, runs again
those refused because U switched under them, and backs off while the pipeline is broken."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

from peer.next_hop import Fetch
from peer.routing import REFRESH_INTERVAL
from peer.trip import Hop
from swarm.data import load_splits
from swarm.wire import ErrorCode, WireError

logger = logging.getLogger("peer.driver")

RETRIES = 6  # at 0.5 s apart: covers the seconds a U switch takes to reach every stage
# how long every stage must have had a live peer before the first trip: each peer re-reads the stage before its
# own every REFRESH_INTERVAL (plus the read itself), and admits only senders it read (`peer/admission.py`)
SETTLE = REFRESH_INTERVAL + 3.0


class Driver:
    def __init__(
        self, hop: Hop, peer_id: str, data: str | None, max_inflight: int, drain_timeout: float, fetch_all: Fetch
    ):
        self.hop, self.peer_id, self.data = hop, peer_id, data
        self.max_inflight, self.drain_timeout = max_inflight, drain_timeout
        self.fetch_all = fetch_all  # every stage's records: the whole pipeline, not only the next hop
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
        """Start driving once every stage has a live peer and no new one has appeared for `SETTLE` seconds (at
        most `3 * SETTLE` after the pipeline first had a peer in every stage: in a large swarm one always joins),
        rather than failing trips at start-up: a trip through a stage with no peer yet fails `no_peer`, and one
        sent to a peer that has not yet read the records of the stage before it (this driver's, or those of a
        peer that came online after its last read) is refused `unknown_sender`, an error on the refusing peer.
        Every peer re-reads those records within `SETTLE`, so the first trips find every hop knowing the last."""
        hop = self.hop
        if hop.runtime.stage.is_tail:
            return
        stages = range(1, hop.manifest.num_stages)
        seen: set[str] = set()
        first = newest = None  # when every stage first had a live peer; when the last new one appeared
        asked = 0
        while not self._stopped:
            records = await self.fetch_all()
            live = {s: {e.record.peer_id for e in records.get(s, []) if hop.router.compatible(e)} for s in stages}
            missing = [s for s, ids in live.items() if not ids]
            now = time.monotonic()
            if missing:
                if asked % 10 == 0:
                    logger.info("%s waiting for a peer of stage %s", hop.label, ", ".join(map(str, missing)))
            else:
                ids = set().union(*live.values())
                if first is None:
                    first = now
                    logger.info("%s every stage has a peer: driving once each has read the stage before it "
                                "(%.0f s without a new peer)", hop.label, SETTLE)
                if newest is None or not ids <= seen:
                    newest = now
                seen |= ids
                if now - newest >= SETTLE or now - first >= 3 * SETTLE:
                    hop.router.update(await hop.fetch())
                    return
            asked += 1
            await asyncio.sleep(1.0)

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
