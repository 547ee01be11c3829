"""The driver: stage-0 peers own the data and keep several trips in flight (pipelining)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid

from swarm.data import load_splits
from swarm.wire import ErrorCode, WireError

logger = logging.getLogger("peer.driver")

RETRIES = 6  # at 0.5 s apart: covers the seconds a U switch takes to reach every stage


class Driver:
    def __init__(self, daemon):
        self.daemon = daemon
        self.inflight = 0
        self._stopped = False
        self._failures = 0

    def stop(self) -> None:
        self._stopped = True

    async def run(self) -> None:
        daemon = self.daemon
        # every driver reads its own random windows of the corpus
        seed = int.from_bytes(hashlib.sha256(daemon.peer_id.encode()).digest()[:4], "little")
        train, _ = await asyncio.to_thread(load_splits, daemon.manifest, daemon.options.data, seed)
        await self._wait_for_pipeline()
        slots = asyncio.Semaphore(max(daemon.options.max_inflight, 1))
        pending: set[asyncio.Task] = set()
        try:
            while not self._stopped:
                await slots.acquire()
                if self._stopped:
                    break
                tokens = train.batch(daemon.manifest.batch.microbatch_size)
                task = asyncio.create_task(self._trip(tokens))
                pending.add(task)
                task.add_done_callback(lambda t: (pending.discard(t), slots.release()))
                if self._failures:  # back off while the pipeline is broken, instead of spinning
                    await asyncio.sleep(min(0.2 * 2 ** min(self._failures, 5), 5.0))
        finally:
            self._stopped = True
            if pending:
                await asyncio.wait(pending, timeout=daemon.options.drain_timeout)

    async def _wait_for_pipeline(self) -> None:
        """Start driving once the next stage has a live peer, rather than failing trips at start-up."""
        daemon = self.daemon
        if daemon.runtime.stage.is_tail:
            return
        waited = 0.0
        while not self._stopped and not daemon.router.candidates(1):
            if waited % 10 == 0:
                logger.info("%s waiting for a peer of stage 1", daemon.label)
            await asyncio.sleep(1.0)
            waited += 1.0
            daemon.router.update(await daemon._fetch())

    async def _trip(self, tokens) -> None:
        """One microbatch; a trip refused because U changed under it (its hops disagree, or no peer of the
        next stage is at our version yet) is run again from the start under the current U."""
        self.inflight += 1
        try:
            for attempt in range(RETRIES + 1):
                try:
                    await self._run_trip(tokens)
                    self._failures = 0
                    return
                except WireError as exc:
                    if exc.code not in (ErrorCode.WRONG_VERSION, ErrorCode.NO_PEER) or attempt == RETRIES:
                        raise
                    await asyncio.sleep(0.5)
        except WireError as exc:
            self._failures += 1
            logger.warning("%s trip dropped: %s", self.daemon.label, exc)
        except Exception:  # noqa: BLE001 - one bad trip must not stop the driver
            self._failures += 1
            logger.exception("%s trip failed", self.daemon.label)
        finally:
            self.inflight -= 1

    async def _run_trip(self, tokens) -> None:
        daemon = self.daemon
        runtime = daemon.runtime
        version = runtime.stage.subspace.version
        batch = tokens.shape[0]
        _, output, residual = await runtime.run(runtime.forward, None, tokens, version)
        if runtime.stage.is_tail:  # a one-stage run: the driver is also the tail
            _, loss = await runtime.run(runtime.backward, None, output, None, tokens, batch, None, version)
            versions = [version]
        else:
            trip_id = uuid.uuid4().hex
            message = await runtime.run(runtime.encode_forward, version, output, tokens, trip_id, 1)
            daemon.stats.bytes_out += len(message)
            checker = daemon.backward_checker(runtime)
            sizes = []

            def check(reply: bytes):
                sizes.append(len(reply))
                return checker(reply)

            header, grad, downstream = await daemon.forward_to_next(message, check)
            daemon.stats.bytes_in += sizes[-1]
            versions = downstream + [version]
            loss = header.loss
            await runtime.run(runtime.backward, None, output, grad, tokens, batch, residual, version)
        if len(set(versions)) == 1:
            daemon.stats.trip_versions[version] += 1
        else:
            daemon.stats.mixed_trips += 1
            logger.error("%s trip used U versions %s", daemon.label, versions)
        daemon.stats.trips += 1
        daemon.stats.tokens += tokens.numel()
        if loss is not None:
            daemon.stats.losses.append(loss)
            daemon.stats.last_loss = loss
