"""The run's trip flavour, picked once per process in `trip_flavour` and nowhere else: a pipeline run's
`PipelineTrips` (`peer/trip.py` `Hop`) or a context-parallel run's `LaneTrips` (`peer/lane_trip.py` `LaneHop` and
the `peer/kv_exchange.py` `KVService` that carries K/V between the lanes of a trip). The flavour answers every
question on which the two differ (the stages whose records a slot keeps, how many trips a peer carries per driver
trip, what the heartbeat adds, the K/V handler's admission, the records' lanes a gradient averager judges by), so
the daemon, the slot (`peer/stage_service.py`), the trip server and the trips ask it instead of testing how many
lanes the run has.
"""

from __future__ import annotations

from hivemind.p2p import P2P, PeerID

from p2pio.relay_service import KV
from peer.kv_exchange import KVService
from peer.lane_trip import LaneHop, lane_codec, largest_kv_message
from peer.link import Link
from peer.next_hop import NextHop
from peer.options import PeerOptions
from peer.relay import Relaying
from peer.robust_averaging import RobustAveraging
from peer.routing import routed_stages
from peer.runtime import StageRuntime
from peer.stats import Stats
from peer.trip import Hop
from swarm.manifest import Manifest
from swarm.records import PeerEntry
from swarm.wire import ErrorCode


class PipelineTrips:
    """A pipeline run's trips (no context parallelism): each served stage gets a `peer/trip.py` `Hop`, and the
    trip handler is the only one the peer listens on."""

    overload_factor = 1  # trips a peer carries per driver trip
    # trips a driver keeps in flight unless told (`--max-inflight`): 8 kept stage 0 busy at RTT 100 where 4 left it
    # idle a fifth of the time (+8% tokens/s at RTT 0 and at 100, benchmarks/RESULTS.md, Latency)
    default_inflight = 8
    pinned_lane = 0  # a pipeline stage has one lane: placement picks only the stage
    judges_by_lane = False  # ...and its gradient senders are judged all together

    def __init__(self, manifest: Manifest):
        self.manifest = manifest

    def message_bound(self) -> int:
        """The largest message of a channel beside the trips' (none here): what relaying for others must carry."""
        return 0

    async def start(self, p2p: P2P, relaying: Relaying, peer_id: str) -> None:
        """Listen beside the trip handler: a pipeline has nothing else to hear."""

    def routed(self, index: int) -> list[int]:
        """The stages whose records a peer of stage `index` keeps (`peer/routing.py` `routed_stages`)."""
        return routed_stages(self.manifest, index)

    def hop(self, next_hop: NextHop, stats: Stats, label: str, lane: int) -> Hop:
        """The slot's hop: the stage's turn in every trip, its next stage reached through `next_hop`."""
        return Hop(next_hop, stats, label)

    def serve(self, hop: Hop, runtime: StageRuntime) -> None:
        """The stage goes online: nothing beside the trip server (`TripServer.hop`) takes its trips."""

    def release(self) -> None:
        """The stage is left: nothing beside the trip server held it."""

    def switch_lane(self, hop: Hop, lane: int) -> None:
        """A pipeline stage has one lane (`peer/lanes.py` `allowed_slots`): placement never switches it."""

    def heartbeat(self, lane: int, stats: Stats) -> dict:
        """What the heartbeat adds: nothing (no K/V counters)."""
        return {}

    def hand_lanes(self, averager: RobustAveraging, entries: list[PeerEntry]) -> None:
        """A pipeline stage's gradient senders are all of one lane: its averager needs no records' lanes."""


class LaneTrips:
    """A context-parallel run's trips (issue 17): each served slot gets a `peer/lane_trip.py` `LaneHop`, and the
    peer listens for K/V too (`KVService`, on its own channel, also delivered by the peer's relay)."""

    default_inflight = 4  # measured with 2-4 per lane (benchmarks/netsim/cp.py); a group's lanes hold its K/V too

    def __init__(self, manifest: Manifest, options: PeerOptions):
        self.manifest, self.options = manifest, options
        self.pinned_lane = options.lane  # --lane, or None: placement picks the lane too
        # every driver's trips pass through every lane: with P lanes a peer carries P times the trips of a pipeline
        # without lanes (measured: 4 lanes refused each other's chunks `overloaded` until their trips collapsed on
        # an 8 Mbit/s link)
        self.overload_factor = manifest.lanes
        self.judges_by_lane = True  # a gradient sender is judged among its lane's senders (peer/averaging_lanes.py)
        self.hop_served: LaneHop | None = None  # the lane the K/V handler serves now, None while none is served
        # set by `start`, once p2pd is up and before any slot is served
        self.kv: KVService
        self.relaying: Relaying
        self.peer_id: str

    def message_bound(self) -> int:
        """The largest K/V message of the run: relaying for others carries K/V too."""
        return largest_kv_message(self.manifest)

    async def start(self, p2p: P2P, relaying: Relaying, peer_id: str) -> None:
        """The K/V handler, never removed (like the trip handler: p2pd stops with the DHT), and the K/V our relay
        delivers."""
        self.relaying, self.peer_id = relaying, peer_id
        self.kv = KVService(
            p2p,
            self.manifest.run_id,
            self.message_bound(),
            admit=self.admit_kv_sender,
            min_rate=self.options.min_stream_rate,
            receive_timeout=self.options.trip_timeout,
        )
        await self.kv.start()
        await relaying.deliver(KV, self.kv.servicer.serve_stream)

    def hand_lanes(self, averager: RobustAveraging, entries: list[PeerEntry]) -> None:
        """Hand the stage's gradient averager the lane each of its peers' signed records names (`entries`), and when
        each record expires: a sender is judged among its record's lane's senders (`peer/averaging_lanes.py`)."""
        averager.set_record_lanes({entry.record.peer_id: (entry.record.lane, entry.expiration) for entry in entries})

    def admit_kv_sender(self, peer: PeerID) -> ErrorCode | None:
        """Asked before a K/V stream is read: the served lane's peers of its stage only (`LaneHop.admit_kv_sender`)."""
        return ErrorCode.LEAVING if self.hop_served is None else self.hop_served.admit_kv_sender(peer)

    def routed(self, index: int) -> list[int] | None:
        """Every stage (None): a driver picks a trip's group in each, stage 0 admits the other drivers."""
        return None

    def hop(self, next_hop: NextHop, stats: Stats, label: str, lane: int) -> LaneHop:
        """The slot's lane hop: its K/V through this process's `KVService`, sent over a K/V `Link`."""
        kv_link = Link(self.relaying.senders[KV], next_hop.router)  # K/V through a lane peer's relay, as trips go
        return LaneHop(next_hop, stats, label, lane=lane, kv=self.kv, peer_id=self.peer_id, kv_link=kv_link)

    def serve(self, hop: LaneHop, runtime: StageRuntime) -> None:
        """The slot goes online: the K/V handler takes its lane's messages under the stage's codec."""
        if self.options.fault_cp_version is not None:  # fault injection: another CP basis version, same bytes
            runtime.stage.cp_basis.version = self.options.fault_cp_version
        self.hop_served = hop
        self.kv.serve(lane_codec(self.manifest, runtime.stage), hop.lane)

    def release(self) -> None:
        """The slot is left: every K/V message is refused `leaving` until the next one is served."""
        self.hop_served = None
        self.kv.serve(None)

    def switch_lane(self, hop: LaneHop, lane: int) -> None:
        """Lanes of a stage are replicas of its weights: only what the K/V handler and the next trips take changes."""
        hop.lane = lane
        self.kv.serve(self.kv.codec, lane)

    def heartbeat(self, lane: int, stats: Stats) -> dict:
        """Read by `kv_bytes_per_token` (`protocol-swarm local`, benchmarks/netsim)."""
        return {"lane": lane, "kv_bytes": stats.kv_bytes, "kv_tokens": stats.kv_tokens}


Trips = PipelineTrips | LaneTrips


def trip_flavour(manifest: Manifest, options: PeerOptions) -> Trips:
    """The run's trip flavour, picked once per process: the one place that asks whether the run has lanes."""
    return LaneTrips(manifest, options) if manifest.lanes > 1 else PipelineTrips(manifest)
