"""Who may send this peer a trip, and how many: admission in front of `Hop.serve`.

A forward trip for stage s is accepted only from a libp2p peer id (authenticated by libp2p) that
holds a live record of this run for stage s−1 (for s = 1 that is a driver); anyone else is answered
`unknown_sender` before a receive slot is given or a byte of its stream is read (`admit_stream`),
and counted; the refusal kicks a rate-limited background DHT re-read, so a peer that joined a moment
ago is served on its retry (`peer/admission.py`). A backward reply is read only from the
stream this peer opened to the peer it chose (`send_trip` dials that peer id, and libp2p
authenticates the peer at the other end), so nobody else can answer for it. Known senders are held
to a token bucket and an in-flight cap (`sender_limits`), and every refusal is logged once per
sender per interval (`peer.refusals`), not once per trip. Which stage is "the stage before" is the trip
flavour's answer (`upstream`): with context parallelism stage 0 accepts too, from stage 0 (the chunks a trip's
driver, itself a stage-0 peer, hands the other lanes: `peer/lane_trip.py`); a pipeline's stage 0 accepts none.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from hivemind.p2p import PeerID

from peer.admission import StagePeers
from peer.lane_trip import LaneHop
from peer.refusals import RefusalLog, SenderLimits
from peer.stats import Stats
from peer.trip import Hop
from swarm.wire import ErrorCode, encode_error

logger = logging.getLogger("peer")


class TripServer:
    """Admits or refuses each incoming trip, then hands it to the stage's current hop (`Hop` or `LaneHop`).

    `hop` is None while the peer serves no stage; `state` says the peer's state (joining, online,
    leaving) at the moment of asking."""

    def __init__(
        self,
        stats: Stats,
        state: Callable[[], str],
        overload_cap: int,
        refusal_log: RefusalLog,
        label: Callable[[], str],
    ):
        self.stats, self.state, self.label = stats, state, label
        self.capacity = overload_cap  # trips held at most, before the served stage's memory bounds it
        self.overload_cap = overload_cap
        self.refusal_log = refusal_log
        self.sender_limits = self._sender_limits()
        self.hop: Hop | LaneHop | None = None
        self.upstream = StagePeers()

    def _sender_limits(self) -> SenderLimits:
        """Per-sender limits, sized so honest traffic never meets them.

        In flight: a fair share of the global cap (`overload_cap`, `peer.refusals.fair_share`): no limit
        while fewer than half the cap's trips are in flight, then each sender at most its equal share of
        the cap among the senders with trips in flight. The cap is this peer's own capacity, so it does not
        depend on what a sender's `--max-inflight` is: a stage-1 relay carrying 4 drivers' trips (4×D in
        flight), as the only sender, may use the whole cap; it is refused only when the peer is at least
        half full and it holds more than its share, i.e. when it would take slots other senders need. Rate:
        a sender refills a slot only when we answered, so honest trips arrive no faster than we complete
        them (plus a few quick retries after refusals); the bucket allows 4× our measured rate, at least
        20 trips/s, in bursts of the whole cap. The rate is set once the stage's throughput is measured
        (`set_throughput`)."""
        cap = max(self.overload_cap, 1)
        return SenderLimits(rate=20.0, burst=float(cap), max_inflight=cap, total_cap=cap)

    def bound_by_memory(self, trips: int) -> None:
        """Hold no more than `trips` at once (`peer/memory.py`): set for each slot served, before its throughput."""
        self.overload_cap = max(1, min(self.capacity, trips))
        self.sender_limits = self._sender_limits()

    def set_throughput(self, tokens_per_second: float, tokens_per_trip: int) -> None:
        self.sender_limits.rate = max(20.0, 4.0 * tokens_per_second / tokens_per_trip)

    async def handle_trip(self, blob: bytes, remote: PeerID) -> bytes:
        """The transport's handler: one forward message in, one reply out."""
        self.stats.bytes_in += len(blob)
        sender = remote.to_base58()
        reply = await self._admit(sender)
        if reply is None:
            try:
                reply = await self._serve(blob, sender)
            finally:
                self.sender_limits.release(sender)
        self.stats.bytes_out += len(reply)
        return reply

    def refuse(self, sender: str, code: ErrorCode, message: str, hops: int = 0) -> bytes:
        """Count a refusal and note it for the aggregated log line; the reply to send back."""
        self.stats.error(code)
        if hops == 0:  # refusals relayed from further down are the next hop's, logged there
            self.refusal_log.note(sender, code.value)
        return encode_error(code, message, hops)

    def _not_admitted(self, sender: str) -> tuple[ErrorCode, str] | None:
        """None if `sender` may be given a receive slot now, else the refusal (code, message). Pure lookups:
        an unknown sender is refused at once and a background re-read of the stage's records (`hop.fetch`) kicked
        (`StagePeers.admits`)."""
        hop, state = self.hop, self.state()
        if hop is None or state != "online":
            return ErrorCode.LEAVING, f"peer is {state}, not serving"
        upstream = hop.upstream()  # for stage 1: the drivers
        if upstream is None:
            return ErrorCode.WRONG_STAGE, "stage 0 drives trips and accepts none"
        if not self.upstream.admits(hop.index, upstream, hop.router.stages.get(upstream, []), sender, hop.fetch,
                                    self.label()):
            return ErrorCode.UNKNOWN_SENDER, f"no live record of stage {upstream} for this peer id"
        return None

    def admit_stream(self, peer: PeerID) -> ErrorCode | None:
        """The transport asks this before giving a stream a receive slot: anyone but a known upstream peer of a
        serving stage is refused at once, so strangers never hold a slot (issue 12's slowloris with fresh
        identities). The refusal is counted by the transport (`on_refused`, `on_refused_from`)."""
        refusal = self._not_admitted(peer.to_base58())
        return None if refusal is None else refusal[0]

    async def _admit(self, sender: str) -> bytes | None:
        """None if `sender` may send us a trip now (its in-flight slot then taken), else the refusal. Checked
        again after the message was read: the peer's state or stage may have changed meanwhile."""
        refusal = self._not_admitted(sender)
        if refusal is not None:
            return self.refuse(sender, *refusal)
        why = self.sender_limits.admit(sender, time.monotonic())
        if why is not None:
            return self.refuse(sender, ErrorCode.OVERLOADED, why)
        return None

    async def _serve(self, blob: bytes, sender: str) -> bytes:
        hop, state = self.hop, self.state()
        if hop is None or state != "online":  # it may have changed while the sender was checked
            return self.refuse(sender, ErrorCode.LEAVING, f"peer is {state}, not serving")
        if self.stats.load >= self.overload_cap:
            return self.refuse(sender, ErrorCode.OVERLOADED, f"{self.stats.load} trips in flight")
        return await hop.serve(blob, lambda code, message, hops: self.refuse(sender, code, message, hops), sender)
