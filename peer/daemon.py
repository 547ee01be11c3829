"""The peer's lifecycle: join the DHT, claim a stage, serve it, rebalance, leave.

What a peer does while it serves a stage is each its own piece, built here for each stage it serves: the
trip (`peer/trip.py` `Hop`, its `peer/next_hop.py` `NextHop` over the stage's `peer/link.py` `Link`s),
admission of incoming trips (`peer/trip_server.py`), its record (`peer/announcer.py`), the driver on stage 0
(`peer/driver.py`) and the agreement on U (`peer/subspace_sync.py`). This module starts and stops them.

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
from pathlib import Path

from hivemind.dht import DHT
from hivemind.p2p import PeerID

from dhtio.records import fetch_stages
from p2pio.relay_service import KV, TRIPS
from peer.announcer import Announcer, stage_record
from peer.audit import Ledger
from peer.driver import Driver
from peer.join import join_dht
from peer.kv_exchange import KVService
from peer.lane_trip import LaneHop, lane_codec, largest_kv_message
from peer.lanes import Slot
from peer.link import Link
from peer.next_hop import NextHop
from peer.options import PeerOptions, pick_device
from peer.processes import StopSignals, stop_dht_and_children, stop_signals_ignored_by_children
from peer.reachability import ReachabilityCheck
from peer.rebalance import Placement, StageMove
from peer.refusals import RefusalLog
from peer.relay import Relaying
from peer.routing import REFRESH_INTERVAL, Router, routed_stages
from peer.runtime import StageRuntime
from peer.stats import Stats
from peer.status_log import log_progress, write_heartbeats
from peer.subspace_sync import SubspaceSync
from peer.transport import TripServicer
from peer.trip import Hop
from peer.trip_server import TripServer
from swarm.manifest import Manifest
from swarm.records import StagePeerRecord, plausible_throughput
from swarm.wire import ErrorCode, expectation_for

logger = logging.getLogger("peer")

LEAVE_DHT_TIMEOUT = 5.0  # a DHT call while leaving gives up after this (p2pd may already be gone)
SIGNAL_DRAIN_TIMEOUT = 15.0  # stopped by a signal: trips in flight get at most this long (exit within 30 s)
HARD_EXIT_AFTER = 25.0  # stopped by a signal: whatever still hangs after this, the process exits (within 30 s)


class PeerDaemon:
    def __init__(self, manifest: Manifest, options: PeerOptions):
        self.manifest, self.options = manifest, options
        self.stats = Stats()
        self.runtime: StageRuntime | None = None
        self.index: int | None = None
        self.state = "joining"
        self.lane = options.lane or 0  # the chunk of every sequence this peer holds (0 without context parallelism)
        self.lanes = manifest.lanes
        self.kv: KVService | None = None  # K/V between the lanes of a trip (context parallelism only)
        self.hop: Hop | None = None
        self.throughput = 0.0
        self.stopping = asyncio.Event()
        self.dht: DHT | None = None
        self.p2p = None
        self.router: Router | None = None
        self.announcer: Announcer | None = None
        self.reachability: ReachabilityCheck | None = None
        self.relaying: Relaying | None = None
        self.placement = Placement(manifest, options, self._fetch, lambda: self.peer_id, lambda: self.label,
                                   random.Random())
        self.refusal_log = RefusalLog(interval=max(6 * options.log_interval, 10.0), started=time.monotonic())
        self.server = TripServer(
            self.stats, self._fetch_routed, lambda: self.state, self.overload_cap, self.refusal_log, lambda: self.label
        )
        self._temp_identity: Path | None = None
        self.stop_signals = StopSignals(self.stopping, lambda: self.label, HARD_EXIT_AFTER)
        self.started = time.monotonic()
        self.online_since = time.monotonic()  # when this peer last went online on its stage

    @property
    def overload_cap(self) -> int:
        """Trips in flight here at most. Every driver's trips pass through every lane: with P lanes a peer
        carries P times the trips of a pipeline without lanes (measured: 4 lanes refused each other's
        chunks `overloaded` until their trips collapsed on an 8 Mbit/s link)."""
        return 4 * max(self.options.max_inflight, 1) * self.manifest.num_stages * self.lanes

    # --- identity and logging -------------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        return str(self.dht.peer_id)

    @property
    def label(self) -> str:
        name = self.options.public_name or self.peer_id[-6:]
        return f"[{name} stage {self.index if self.index is not None else '?'}]"

    # --- start-up ---------------------------------------------------------------------------------

    def start_dht(self) -> None:
        """Join the DHT (`peer/join.py`); on a failure `stop_processes` stops what it started."""
        joined = join_dht(self.manifest, self.options)
        self.dht, self.signer, self._temp_identity = joined.dht, joined.signer, joined.temp_identity

    async def _fetch(self, stages: list[int] | None = None) -> dict:
        """The records of `stages` (None: every stage; placement and rebalancing compare them all)."""
        return await asyncio.to_thread(fetch_stages, self.dht, self.manifest, stages)

    def _admit_kv_sender(self, peer: PeerID) -> ErrorCode | None:
        return self.hop.admit_kv_sender(peer) if isinstance(self.hop, LaneHop) else ErrorCode.LEAVING

    async def _fetch_routed(self) -> dict:
        """With lanes, every stage: a driver picks a trip's group in each, stage 0 admits the other drivers."""
        return await self._fetch(None if self.lanes > 1 else routed_stages(self.manifest, self.index))

    # --- what the peer announces -----------------------------------------------------------------

    def record(self) -> StagePeerRecord:
        return stage_record(
            peer_id=self.peer_id,
            state=self.state,
            stage=self.index,
            throughput=self.throughput,
            runtime=self.runtime,
            lane=self.lane,
            stats=self.stats,
            public_name=self.options.public_name,
            addrs=[str(a) for a in self.dht.get_visible_maddrs()],
            reachability=self.reachability.result if self.reachability is not None else "",
            relay=self.reachability.relay if self.reachability is not None else "",
        )

    # --- routing and rebalancing --------------------------------------------------------------------

    async def refresh_loop(self) -> None:
        """Keep the router's records of the stages it needs (`routed_stages`) fresh, every REFRESH_INTERVAL."""
        while True:
            try:
                self.router.update(await self._fetch_routed())
            except Exception as exc:  # noqa: BLE001
                logger.warning("%s could not read the DHT: %s", self.label, exc)
            await asyncio.sleep(REFRESH_INTERVAL)

    async def move_target(self) -> Slot | None:
        """Where a move would pay (`peer/rebalance.py`); None to stay."""
        here, t_fixed = (self.index, self.lane), self.runtime.stage.subspace.t_fixed_sha256
        return await self.placement.move_target(here, self.throughput, t_fixed, self.router.unreachable(),
                                                self.online_since)

    async def switch_lane(self, lane: int) -> None:
        """Lanes of a stage are replicas of its weights: changing lanes keeps them, only the record changes, and
        what the K/V handler and the next trips take."""
        self.lane, self.online_since = lane, time.monotonic()
        if isinstance(self.hop, LaneHop):
            self.hop.lane = self.lane
            self.kv.serve(self.kv.codec, self.lane)
        await self.announcer.announce_now()

    async def log_loop(self) -> None:
        await log_progress(
            self.stats, lambda: self.runtime.epoch, self.refusal_log, lambda: self.label, self.options.log_interval
        )

    # --- serving one stage -------------------------------------------------------------------------

    async def serve(self, slot: Slot) -> Slot | None:
        """Serve lane `slot[1]` of stage `slot[0]` until stopped (returns None) or a rebalance says move (returns
        the target)."""
        index, self.lane = slot
        self.index, self.state = index, "joining"
        self.stats.leaving = False  # back to counting errors after a move to this stage
        device = pick_device(self.options.device)
        with stop_signals_ignored_by_children():  # hivemind's averagers are child processes
            runtime = StageRuntime(
                self.manifest,
                index,
                self.dht,
                device,
                self.label,
                self.options.checkpoint_dir,
                self.options.fault_t_fixed_seed,
                checkpoint_every=self.options.checkpoint_every,
            )
        self.runtime = runtime
        subspace = runtime.stage.subspace
        bounds = {s: plausible_throughput(self.manifest, s) for s in range(self.manifest.num_stages)}
        ledger = Ledger(audit_rate=self.options.audit_rate)
        self.router = router = Router(subspace.t_fixed_sha256, self.peer_id, claim_bounds=bounds, lanes=self.lanes,
                                     ledger=ledger)
        # messages go straight, or through the relay the peer's record names (peer/link.py)
        link = Link(self.relaying.senders[TRIPS], router)
        next_hop = NextHop(self.manifest, index, runtime, router, link, self._fetch_routed, self.stats, self.label,
                           self.options.trip_timeout)
        hop_args = (self.manifest, index, runtime, next_hop, self.stats, self.label)
        if self.kv is not None:
            kv_link = Link(self.relaying.senders[KV], router)
            hop = LaneHop(*hop_args, lane=self.lane, kv=self.kv, peer_id=self.peer_id, kv_link=kv_link)
        else:
            hop = Hop(*hop_args)
        self.hop = hop
        self.announcer = Announcer(self.dht, self.manifest, self.signer, self.record, lambda: self.label)
        self.throughput = await runtime.run(runtime.measure_throughput)
        self.server.set_throughput(self.throughput, hop.tokens_per_trip)
        await self.announcer.announce_now()
        stages = await self._fetch([index, *routed_stages(self.manifest, index)])
        peers_here = [e for e in stages.get(index, []) if router.compatible(e)]
        sync = None
        if self.manifest.updates_u:
            sync = SubspaceSync(hop, self.dht, self.signer, self.peer_id, self.announcer.announce_now)
            router.update(stages)
            await sync.catch_up()  # before loading state: donors' tensors live in the current span(U)
        if peers_here:
            loaded = await runtime.run(runtime.load_from_peers)
            logger.info(
                "%s %s state from %d peer(s) of the stage (epoch %d)",
                self.label,
                "loaded" if loaded else "could not load",
                len(peers_here),
                runtime.epoch,
            )
        elif not await runtime.run(runtime.load_checkpoint):
            logger.info("%s starting stage %d from the seed", self.label, index)
        router.update(stages)
        if self.kv is not None:
            if self.options.fault_cp_version is not None:  # fault injection: another CP basis version, same bytes
                runtime.stage.cp_basis.version = self.options.fault_cp_version
            self.kv.serve(lane_codec(self.manifest, runtime.stage), self.lane)
        self.server.hop = hop
        self.state = "online"
        self.online_since = time.monotonic()
        await self.announcer.announce_now()
        logger.info("%s online: %.0f tokens/s measured, layers %s", self.label, self.throughput,
                    list(self.manifest.layers_of(index)))
        tasks = [asyncio.create_task(coro) for coro in (self.announcer.run(), self.refresh_loop(), self.log_loop())]
        if not self.placement.pinned:
            moves = self.placement.run(self.move_target, lambda: self.index, self.switch_lane)
            tasks.append(asyncio.create_task(moves))
        if sync is not None:
            tasks.append(asyncio.create_task(sync.run()))
        driver = None
        if runtime.stage.is_head:
            driver = Driver(hop, self.peer_id, self.options.data, self.options.max_inflight, self.options.drain_timeout,
                            self._fetch)
            tasks.append(asyncio.create_task(driver.run()))
        stop = asyncio.create_task(self.stopping.wait())
        target = None
        try:
            done, _ = await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stop and task.exception() is not None:
                    if isinstance(task.exception(), StageMove):
                        target = task.exception().target
                    else:
                        raise task.exception()
        finally:
            # audit duplicates still out belong to this stage too (peer/next_hop.py `NextHop.shadows`)
            await self.leave([*tasks, stop, *hop.next_hop.shadows.values()], driver)
        return target

    async def leave(self, tasks: list[asyncio.Task], driver) -> None:
        """Announce LEAVING, stop driving, let trips in flight finish, checkpoint, release the stage. From here on
        what fails is the leave's doing, not the swarm's: it is counted apart from errors (`Stats.leaving`)."""
        self.state = "leaving"
        self.stats.leaving = True
        if driver is not None:
            driver.stop()
        await self.announcer.announce_now(timeout=LEAVE_DHT_TIMEOUT)  # p2pd may be gone already (a group SIGTERM)
        drain = self.options.drain_timeout
        if self.stop_signals.received:
            drain = min(drain, SIGNAL_DRAIN_TIMEOUT)
        deadline = time.monotonic() + drain
        while (self.stats.load > 0 or (driver is not None and driver.inflight > 0)) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.server.hop = self.hop = None
        if self.kv is not None:
            self.kv.serve(None)
        runtime, self.runtime = self.runtime, None
        if runtime is not None:
            await runtime.run(runtime.save_checkpoint)  # queued behind any backward still running
            # hivemind's Optimizer.shutdown joins its tracker and averagers (5 s each): off the event loop,
            # so a second Ctrl-C is still handled meanwhile
            await asyncio.to_thread(runtime.shutdown)
        logger.info(
            "%s left the stage (trips %d, tokens %d, errors %s, failed while leaving %d)",
            self.label,
            self.stats.trips,
            self.stats.tokens,
            dict(self.stats.errors) or 0,
            self.stats.leaving_failures,
        )

    async def heartbeat_loop(self) -> None:
        def describe() -> dict:
            described = {"time": time.time(), "state": self.state, "stage": self.index, "peer_id": self.peer_id}
            if self.lanes > 1:  # read by `kv_bytes_per_token` (`protocol-swarm local`, benchmarks/netsim)
                described.update(lane=self.lane, kv_bytes=self.stats.kv_bytes, kv_tokens=self.stats.kv_tokens)
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
            if self.lanes > 1:
                self.kv = KVService(
                    self.p2p,
                    self.manifest.run_id,
                    largest_kv_message(self.manifest),
                    admit=self._admit_kv_sender,
                    min_rate=self.options.min_stream_rate,
                    receive_timeout=self.options.trip_timeout,
                )
                max_bytes = max(max_bytes, self.kv.servicer.max_bytes)  # relaying for others, K/V too
            self.relaying = Relaying(self.p2p, self.manifest.run_id, self.options, servicer.serve_stream, self._fetch,
                                     self.peer_id, max_bytes, lambda: self.label)
            await self.relaying.start()
            if self.kv is not None:
                await self.kv.start()  # never removed, like the trip handler: p2pd stops with the DHT
                await self.relaying.deliver(KV, self.kv.servicer.serve_stream)  # K/V our relay delivers
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
            slot = await self.pick_stage_or_stop()
            while slot is not None and not self.stopping.is_set():
                slot = await self.serve(slot)
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

