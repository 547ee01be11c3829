"""One served (stage, lane) slot, one object: everything a peer builds, runs and stops while it serves a stage.

`PeerDaemon` (`peer/daemon.py`) runs the process: the DHT, p2pd, signals, relaying, reachability, placement.
What serving one slot takes is here, so that a reader finds it in one room: the stage's `StageRuntime`, its
`Router` and `Ledger`, the `Link` over which its trips leave, its `NextHop`, the trip flavour's hop, its record
(`peer/announcer.py`), the agreement on U (`peer/subspace_sync.py`), the driver on stage 0 (`peer/driver.py`) and
the leave. `StageService.create` builds a slot up to online (a peer stopped while the slot waits for a state
leaves it joining), `run` serves it until the peer stops or a rebalance moves it, `shutdown` leaves it
(checkpoint if it went online, release). A move builds a new `StageService`.

The trip flavour (`peer/trip_flavour.py`: pipeline or lanes) is picked once per process; a slot asks it whatever
differs between the two.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import suppress
from dataclasses import dataclass

from hivemind.dht import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey

from p2pio.relay_service import TRIPS
from peer.announcer import Announcer, stage_record
from peer.audit import Ledger
from peer.driver import Driver
from peer.lane_trip import LaneHop
from peer.lanes import Slot
from peer.link import Link
from peer.memory import DRIVER_SHARE, SERVED_SHARE, available_memory, trips_that_fit
from peer.next_hop import NextHop
from peer.options import PeerOptions, pick_device
from peer.processes import StopSignals, stop_signals_ignored_by_children
from peer.reachability import ReachabilityCheck
from peer.rebalance import StageMove
from peer.refusals import RefusalLog
from peer.relay import Relaying
from peer.routing import REFRESH_INTERVAL, Router, routed_stages
from peer.runtime import StageRuntime
from peer.stats import Stats
from peer.status_log import log_progress
from peer.subspace_sync import SubspaceSync
from peer.trip import Hop
from peer.trip_flavour import Trips
from peer.trip_server import TripServer
from swarm.manifest import Manifest
from swarm.records import StagePeerRecord, plausible_throughput

logger = logging.getLogger("peer")

LEAVE_DHT_TIMEOUT = 5.0  # a DHT call while leaving gives up after this (p2pd may already be gone)
MIN_JOIN_RETRY_S = 5.0  # a joiner whose state download failed before it began tries again no sooner
SIGNAL_DRAIN_TIMEOUT = 15.0  # stopped by a signal: trips in flight get at most this long (exit within 30 s)

FetchStages = Callable[..., Awaitable[dict]]  # records of the stages named (none named: every stage)


@dataclass
class PeerParts:
    """What a served slot uses of its peer process, each built once by `PeerDaemon`."""

    manifest: Manifest
    options: PeerOptions
    dht: DHT
    signer: RSASignatureValidator
    signing_key: RSAPrivateKey  # the signer's key, which the stage's progress records are signed with too
    peer_id: str
    stats: Stats  # the peer's counters: they outlive a move
    server: TripServer  # admits incoming trips for whichever hop is served (`TripServer.hop`)
    relaying: Relaying  # the senders a `Link` uses, straight or through a relay
    reachability: ReachabilityCheck  # what the record says about how to reach this peer
    refusal_log: RefusalLog
    stop_signals: StopSignals  # a stop by signal shortens the leave's drain
    fetch: FetchStages
    trips: Trips


class StageService:
    """Lane `lane` of stage `index`, served by this peer (module docstring). `state`: joining, online, leaving."""

    def __init__(self, parts: PeerParts, slot: Slot, label: str):
        self.parts, self.label = parts, label
        self.index, self.lane = slot
        self.state = "joining"
        self.online_since = time.monotonic()  # when this peer went online on this stage (or last switched lanes)
        self.throughput = 0.0
        self.free_memory: int | None = None  # bytes free when the slot was built (`peer/memory.py`)
        self.runtime: StageRuntime | None = None
        self.hop: Hop | LaneHop | None = None
        self.sync: SubspaceSync | None = None
        self.driver: Driver | None = None
        self.tasks: list[asyncio.Task] = []

    @classmethod
    async def create(cls, parts: PeerParts, slot: Slot, label: str) -> StageService:
        """Build the slot and bring it online: runtime, router, next hop, the flavour's hop, measured throughput,
        U caught up and state loaded (from the stage's peers, else the checkpoint, else the seed); stopped while
        it waits for the stage's state, it stays joining."""
        service = cls(parts, slot, label)
        await service._start()
        return service

    async def _start(self) -> None:
        parts, manifest, options, index = self.parts, self.parts.manifest, self.parts.options, self.index
        parts.stats.leaving = False  # back to counting errors after a move to this stage
        device = pick_device(options.device)
        with stop_signals_ignored_by_children():  # hivemind's averagers are child processes
            runtime = StageRuntime(manifest, index, parts.dht, device, self.label, options.checkpoint_dir,
                                   options.fault_t_fixed_seed, options.fault_poison_served_state,
                                   signing_key=parts.signing_key, checkpoint_every=options.checkpoint_every,
                                   stats=parts.stats, gradient_wire=options.gradient_wire,
                                   judges_by_lane=parts.trips.judges_by_lane)
        self.runtime = runtime
        runtime.optimizer.lane = self.lane
        subspace = runtime.stage.subspace
        bounds = {s: plausible_throughput(manifest, s) for s in range(manifest.num_stages)}
        ledger = Ledger(audit_rate=options.audit_rate)
        self.router = router = Router(subspace.t_fixed_sha256, parts.peer_id, claim_bounds=bounds,
                                      lanes=manifest.lanes, ledger=ledger)
        # messages go straight, or through the relay the peer's record names (peer/link.py)
        link = Link(parts.relaying.senders[TRIPS], router)
        next_hop = NextHop(manifest, index, runtime, router, link, self.fetch_routed, parts.stats, self.label,
                           options.trip_timeout)
        self.hop = hop = parts.trips.hop(next_hop, parts.stats, self.label, self.lane)
        self.announcer = Announcer(parts.dht, manifest, parts.signer, self.record, lambda: self.label)
        batch = manifest.batch
        self.throughput = await runtime.run(runtime.stage.measure_throughput, batch.microbatch_size, batch.seq_len)
        self.free_memory = available_memory(runtime.device)
        parts.server.bound_by_memory(trips_that_fit(parts.server.capacity, runtime.stage.trip_activation_bytes,
                                                    self.free_memory, SERVED_SHARE))
        parts.server.set_throughput(self.throughput, hop.tokens_per_trip)
        await self.announcer.announce_now()
        stages = await parts.fetch([index, *routed_stages(manifest, index)])
        peers_here = self._compatible_here(stages)
        if manifest.updates_u:
            self.sync = SubspaceSync(hop, parts.dht, parts.signer, parts.peer_id, self.announcer.announce_now)
            router.update(stages)
            await self.sync.catch_up()  # before loading state: donors' tensors live in the current span(U)
        if peers_here and await self._load_from_peers():
            logger.info("%s loaded state from %d peer(s) of the stage (epoch %d)", self.label, len(peers_here),
                        runtime.epoch)
        elif parts.stop_signals.stopping.is_set():
            # stopped while waiting for a state: neither the seed nor the checkpoint goes online for a moment, and
            # `shutdown` keeps the checkpoint as it is (the runtime holds the seed)
            logger.info("%s stopped while joining: nothing loaded, nothing served", self.label)
            return
        elif not await runtime.run(runtime.load_checkpoint):
            logger.info("%s starting stage %d from the seed", self.label, index)
        router.update(stages)
        parts.trips.serve(hop, runtime)
        parts.server.hop = hop
        self.state = "online"
        self.online_since = time.monotonic()
        await self.announcer.announce_now()
        logger.info("%s online: %.0f tokens/s measured, layers %s", self.label, self.throughput,
                    list(manifest.layers_of(index)))

    async def _load_from_peers(self) -> bool:
        """Whether a state the stage vouches for was taken (`peer/state_load.py`). While the stage has other online
        peers, the slot stays out of service until one is: serving the seed (or an old checkpoint) beside them
        would send every trip routed here, and the gradients it returns upstream, through other weights. Tries are
        RETRY_S apart (the download's own pace); False once no other online peer is left to load from, or once the
        peer is stopping (no download is begun then)."""
        runtime, stopping = self.runtime, self.parts.stop_signals.stopping
        tries = 1
        while not stopping.is_set():
            if await runtime.run(runtime.load_from_peers):
                return True
            online = len(self._compatible_here(await self.parts.fetch([self.index])))
            if not online:
                return False
            wait = max(runtime.next_download_in(), MIN_JOIN_RETRY_S)
            logger.warning("%s stays joining: no state of %d online peer(s) of the stage taken after %d tr%s; "
                           "trying again in %.0f s", self.label, online, tries, "y" if tries == 1 else "ies", wait)
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stopping.wait(), wait)
            if self.sync is not None and not stopping.is_set():
                await self.sync.catch_up()  # the stage may have switched U meanwhile: donors serve the new span
            tries += 1
        return False  # stopped while joining: `_start` leaves the slot joining

    def _compatible_here(self, stages: dict) -> list:
        """The other online peers of this stage in `stages` (as fetched) whose state this slot could take."""
        return [e for e in stages.get(self.index, []) if self.router.compatible(e)]

    async def fetch_routed(self) -> dict:
        """The records of the stages this slot keeps (the flavour's `routed`: None reads every stage)."""
        return await self.parts.fetch(self.parts.trips.routed(self.index))

    def record(self) -> StagePeerRecord:
        """What the peer announces while it serves this slot (`peer/announcer.py`)."""
        parts, reachability = self.parts, self.parts.reachability
        return stage_record(
            peer_id=parts.peer_id,
            state=self.state,
            stage=self.index,
            throughput=self.throughput,
            runtime=self.runtime,
            lane=self.lane,
            stats=parts.stats,
            public_name=parts.options.public_name,
            addrs=[str(a) for a in parts.dht.get_visible_maddrs()],
            reachability=reachability.result,
            relay=reachability.relay,
        )

    async def refresh_loop(self) -> None:
        """Keep the router's records of the stages it needs (`fetch_routed`) fresh, every REFRESH_INTERVAL, and the
        lanes of this stage's records in its gradient averager (the flavour's `hand_lanes`)."""
        while True:
            try:
                stages = await self.fetch_routed()
                self.router.update(stages)
                self.parts.trips.hand_lanes(self.runtime.optimizer.grad_averager, self._compatible_here(stages))
            except Exception as exc:  # noqa: BLE001
                logger.warning("%s could not refresh its records: %s", self.label, exc)
            await asyncio.sleep(REFRESH_INTERVAL)

    async def switch_lane(self, lane: int) -> None:
        """Lanes of a stage are replicas of its weights: changing lanes keeps them, only the record changes, and
        what the flavour's lane handling takes (`LaneTrips.switch_lane`)."""
        self.lane, self.online_since = lane, time.monotonic()
        self.runtime.optimizer.lane = lane
        self.parts.trips.switch_lane(self.hop, lane)
        await self.announcer.announce_now()

    async def run(self, stopping: asyncio.Event, *jobs: Coroutine) -> Slot | None:
        """Serve until `stopping` is set (returns None) or one of `jobs` (the daemon's placement) raises
        `StageMove` (returns its target); any other failure is raised. Always left through `shutdown`."""
        parts, runtime = self.parts, self.runtime
        if self.state == "joining":  # stopped before it went online (`_start`): nothing to serve
            for job in jobs:
                job.close()
            await self.shutdown()
            return None
        coros = [self.announcer.run(), self.refresh_loop(), self.log_loop(), *jobs]
        if self.sync is not None:
            coros.append(self.sync.run())
        if runtime.stage.is_head:
            options, trip_bytes = parts.options, runtime.stage.trip_activation_bytes
            window = trips_that_fit(options.max_inflight, trip_bytes, self.free_memory, DRIVER_SHARE)
            if window < options.max_inflight:
                logger.info("%s keeps %d trips in flight, not %d: each holds %.0f MB of activations here",
                            self.label, window, options.max_inflight, trip_bytes / 2**20)
            self.driver = Driver(self.hop, parts.peer_id, options.data, window, options.drain_timeout, parts.fetch)
            coros.append(self.driver.run())
        self.tasks = [asyncio.create_task(coro) for coro in coros]
        stop = asyncio.create_task(stopping.wait())
        target = None
        try:
            done, _ = await asyncio.wait([stop, *self.tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stop and task.exception() is not None:
                    if isinstance(task.exception(), StageMove):
                        target = task.exception().target
                    else:
                        raise task.exception()
        finally:
            self.tasks.append(stop)
            await self.shutdown()
        return target

    async def log_loop(self) -> None:
        await log_progress(self.parts.stats, lambda: self.runtime.epoch, self.parts.refusal_log, lambda: self.label,
                           self.parts.options.log_interval)

    async def shutdown(self) -> None:
        """Announce LEAVING, stop driving, let trips in flight finish, checkpoint (a slot that went online), release
        the stage. From here on what fails is the leave's doing, not the swarm's: it is counted apart from errors
        (`Stats.leaving`)."""
        parts, stats, driver = self.parts, self.parts.stats, self.driver
        served = self.state == "online"  # a slot stopped while joining holds the seed: no checkpoint of it
        self.state = "leaving"
        stats.leaving = True
        if driver is not None:
            driver.stop()
        await self.announcer.announce_now(timeout=LEAVE_DHT_TIMEOUT)  # p2pd may be gone already (a group SIGTERM)
        drain = parts.options.drain_timeout
        if parts.stop_signals.received:
            drain = min(drain, SIGNAL_DRAIN_TIMEOUT)
        deadline = time.monotonic() + drain
        while (stats.load > 0 or (driver is not None and driver.inflight > 0)) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        # audit duplicates still out belong to this stage too (peer/next_hop.py `NextHop.shadows`)
        tasks = [*self.tasks, *self.hop.next_hop.shadows.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        parts.server.hop = self.hop = None
        parts.trips.release()
        # nothing of the stage is kept past its leave: a peer that moved holds only the stage it serves now
        self.tasks, self.sync, self.driver = [], None, None
        runtime, self.runtime = self.runtime, None
        if runtime is not None:
            if served:
                await runtime.run(runtime.save_checkpoint)  # queued behind any backward still running
            # hivemind's Optimizer.shutdown joins its tracker and averagers (5 s each): off the event loop,
            # so a second Ctrl-C is still handled meanwhile
            await asyncio.to_thread(runtime.shutdown)
        logger.info("%s left the stage (trips %d, tokens %d, errors %s, failed while leaving %d)", self.label,
                    stats.trips, stats.tokens, dict(stats.errors) or 0, stats.leaving_failures)
