"""The peer's process: join the DHT, listen, relay, check reachability, place itself, serve, stop.

What a peer does while it serves a (stage, lane) slot is one object, `peer/stage_service.py` `StageService`
(the stage's runtime, its trips, its record, the driver on stage 0, the agreement on U, the leave), built for
each slot placement picks; the run's trip flavour (`trip_flavour`: pipeline or lanes) is picked once, when the
daemon is made. This module keeps what lives as long as the process: the DHT and p2pd, the trip handler and
its admission (`peer/trip_server.py`), relaying (`peer/relay.py`), the reachability check, placement and moves
(`peer/rebalance.py`), the heartbeat file and the stop signals.

Stopping. SIGINT or SIGTERM, to the process or to its whole process group (Ctrl-C, systemd):
the peer leaves its stage, saves its checkpoint and exits; a second SIGINT exits at once. The
DHT's child process is started with both signals ignored, so a group signal cannot kill it under
the parent, and p2pd dying first only makes the leave's DHT calls time out (they are bounded); a
signal to the peer alone (`docker stop`, `protocol-swarm local`) leaves p2pd up until the peer
stops it. What fails while the peer leaves (its own trips once p2pd is gone, the trips it refuses)
is counted as failed while leaving, not as errors. On every way out the peer removes the hivemind
sockets it and its children made (`p2pio/sockets.py`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import shutil
import signal
import time
from dataclasses import replace
from pathlib import Path

from hivemind.dht import DHT

from dhtio.records import fetch_stages
from peer.join import join_dht
from peer.lanes import Slot
from peer.options import PeerOptions
from peer.processes import StopSignals, stop_dht_and_children
from peer.reachability import ReachabilityCheck
from peer.rebalance import Placement
from peer.refusals import RefusalLog
from peer.relay import Relaying
from peer.stage_service import PeerParts, StageService
from peer.stats import Stats
from peer.status_log import write_heartbeats
from peer.transport import TripServicer
from peer.trip_flavour import trip_flavour
from peer.trip_server import TripServer
from swarm.manifest import Manifest
from swarm.wire import expectation_for

logger = logging.getLogger("peer")

HARD_EXIT_AFTER = 25.0  # stopped by a signal: whatever still hangs after this, the process exits (within 30 s)


class PeerDaemon:
    def __init__(self, manifest: Manifest, options: PeerOptions):
        self.stats = Stats()
        self.trips = trip_flavour(manifest, options)
        if options.max_inflight is None:
            options = replace(options, max_inflight=self.trips.default_inflight)
        self.manifest, self.options = manifest, options
        self.stage: int | None = None  # the stage placement put this peer on (None before the first)
        self.service: StageService | None = None  # the slot served now, or the one last left
        self.stopping = asyncio.Event()
        self.dht: DHT | None = None
        self.p2p = None
        self.reachability: ReachabilityCheck | None = None
        self.relaying: Relaying | None = None
        self.placement = Placement(manifest, options, self.trips.pinned_lane, self._fetch, lambda: self.peer_id,
                                   lambda: self.label, random.Random())
        self.refusal_log = RefusalLog(interval=max(6 * options.log_interval, 10.0), started=time.monotonic())
        self.server = TripServer(self.stats, lambda: self.state, self.overload_cap, self.refusal_log,
                                 lambda: self.label)
        self._temp_identity: Path | None = None
        self.stop_signals = StopSignals(self.stopping, lambda: self.label, HARD_EXIT_AFTER)
        self.started = time.monotonic()

    @property
    def overload_cap(self) -> int:
        """Trips in flight here at most: per driver trip, the flavour's share of them (`overload_factor`)."""
        return 4 * max(self.options.max_inflight, 1) * self.manifest.num_stages * self.trips.overload_factor

    # --- identity and logging -------------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        return str(self.dht.peer_id)

    @property
    def label(self) -> str:
        name = self.options.public_name or self.peer_id[-6:]
        return f"[{name} stage {self.stage if self.stage is not None else '?'}]"

    @property
    def state(self) -> str:
        """joining (also while a slot is being built), online or leaving: the served slot's."""
        return self.service.state if self.service is not None else "joining"

    # --- start-up ---------------------------------------------------------------------------------

    def start_dht(self) -> None:
        """Join the DHT (`peer/join.py`); on a failure `stop_processes` stops what it started."""
        joined = join_dht(self.manifest, self.options)
        self.dht, self.signer, self._temp_identity = joined.dht, joined.signer, joined.temp_identity
        self.signing_key = joined.signing_key

    async def _fetch(self, stages: list[int] | None = None) -> dict:
        """The records of `stages` (None: every stage; placement and rebalancing compare them all)."""
        return await asyncio.to_thread(fetch_stages, self.dht, self.manifest, stages)

    # --- placement and serving ----------------------------------------------------------------------

    async def move_target(self) -> Slot | None:
        """Where a move would pay (`peer/rebalance.py`); None to stay."""
        service = self.service
        here, t_fixed = (service.index, service.lane), service.runtime.stage.subspace.t_fixed_sha256
        return await self.placement.move_target(here, service.throughput, t_fixed, service.router.unreachable(),
                                                service.online_since)

    async def serve(self, parts: PeerParts, slot: Slot) -> Slot | None:
        """Serve lane `slot[1]` of stage `slot[0]` until stopped (returns None) or a rebalance says move (returns
        the target)."""
        self.stage, self.service = slot[0], None
        service = self.service = await StageService.create(parts, slot, self.label)
        moves = []
        if not self.placement.pinned:
            moves.append(self.placement.run(self.move_target, lambda: service.index, service.switch_lane))
        return await service.run(self.stopping, *moves)

    async def heartbeat_loop(self) -> None:
        def describe() -> dict:
            service = self.service
            described = {"time": time.time(), "state": self.state, "stage": self.stage, "peer_id": self.peer_id}
            if service is not None:
                described.update(self.trips.heartbeat(service.lane, self.stats))
            return described

        await write_heartbeats(
            Path(self.options.heartbeat_file), describe, lambda: self.label, min(self.options.log_interval, 30.0)
        )

    async def main(self) -> None:
        loop = asyncio.get_running_loop()
        heartbeat = asyncio.create_task(self.heartbeat_loop()) if self.options.heartbeat_file else None
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_signals.handle, sig)
        try:
            # inside the try: if this fails, the DHT child and p2pd (which ignore stop signals) are still stopped
            self.p2p = await self.dht.replicate_p2p()
            max_bytes = expectation_for(self.manifest, 0, "forward", 0, "").max_bytes
            servicer = TripServicer(
                self.server.handle_trip,
                max_bytes=max_bytes,
                on_refused=self.stats.error,
                # a refusal before the message is read is noted for the aggregated log line like any other
                on_refused_from=lambda code, peer: self.refusal_log.note(peer.to_base58(), code.value),
                admit=self.server.admit_stream,  # only known upstream peers get a receive slot
                min_rate=self.options.min_stream_rate,
            )
            await servicer.add_p2p_handlers(self.p2p, namespace=self.manifest.run_id)
            max_bytes = max(max_bytes, self.trips.message_bound())  # relaying for others: K/V too, with lanes
            self.relaying = Relaying(self.p2p, self.manifest.run_id, self.options, servicer.serve_stream, self._fetch,
                                     self.peer_id, max_bytes, lambda: self.label)
            await self.relaying.start()
            await self.trips.start(self.p2p, self.relaying, self.peer_id)
            self.reachability = ReachabilityCheck(
                self.p2p, self._fetch, self.peer_id, self.options.host_maddrs, lambda: self.label, self.relaying.client
            )
            await self.reachability.start()
            logger.info(
                "peer %s joined run %s; visible at %s",
                self.peer_id,
                self.manifest.run_id,
                " ".join(str(a) for a in self.dht.get_visible_maddrs()),
            )
            parts = PeerParts(self.manifest, self.options, self.dht, self.signer, self.signing_key, self.peer_id,
                              self.stats, self.server, self.relaying, self.reachability, self.refusal_log,
                              self.stop_signals, self._fetch, self.trips)
            slot = await self.pick_stage_or_stop()
            while slot is not None and not self.stopping.is_set():
                slot = await self.serve(parts, slot)
        finally:
            if self.reachability is not None:
                await self.reachability.stop()
            if self.relaying is not None:
                await self.relaying.stop()
            if heartbeat is not None:
                heartbeat.cancel()
                await asyncio.gather(heartbeat, return_exceptions=True)
            await asyncio.to_thread(self.stop_processes)

    async def pick_stage_or_stop(self) -> Slot | None:
        pick = asyncio.create_task(self.placement.first_slot(time.monotonic() - self.started))
        stop = asyncio.create_task(self.stopping.wait())
        await asyncio.wait([pick, stop], return_when=asyncio.FIRST_COMPLETED)
        stopped = not pick.done()
        for task in (pick, stop):
            task.cancel()
        await asyncio.gather(pick, stop, return_exceptions=True)  # a task left pending is reported at exit
        return None if stopped else pick.result()

    def stop_processes(self) -> None:
        """Stop the DHT (and with it p2pd) and anything else still running below us, and remove our hivemind
        sockets and throwaway identity; the exit cannot hang on a child that ignores the stop signals. Also
        after a failed `start_dht`, whatever it got to start."""
        stop_dht_and_children(self.dht)
        if self._temp_identity is not None:
            shutil.rmtree(self._temp_identity, ignore_errors=True)

