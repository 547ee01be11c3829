"""Who may send this peer a trip, and how many: admission in front of `Hop.serve`.

A forward trip for stage s is accepted only from a libp2p peer id (authenticated by libp2p) that
holds a live record of this run for stage s−1 (for s = 1 that is a driver); anyone else is answered
`unknown_sender` before the message is decoded, and counted. A backward reply is read only from the
stream this peer opened to the peer it chose (`send_trip` dials that peer id, and libp2p
authenticates the peer at the other end), so nobody else can answer for it. Known senders are held
to a token bucket and an in-flight cap (`sender_limits`), and every refusal is logged once per
sender per interval (`peer.refusals`), not once per trip.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import get_dht_time

from peer.refusals import RefusalLog, SenderLimits
from peer.trip import Fetch, Hop, Stats
from swarm.wire import ErrorCode, encode_error

logger = logging.getLogger("peer")

SENDER_REFRESH_INTERVAL = 2.0  # at most one DHT read per this many seconds on behalf of unknown senders


class TripServer:
    """Admits or refuses each incoming trip, then hands it to the stage's current `Hop`.

    `hop` is None while the peer serves no stage; `state` says the peer's state (joining, online,
    leaving) at the moment of asking."""

    def __init__(
        self,
        stats: Stats,
        fetch: Fetch,
        state: Callable[[], str],
        overload_cap: int,
        refusal_log: RefusalLog,
        label: Callable[[], str],
    ):
        self.stats, self.fetch, self.state, self.label = stats, fetch, state, label
        self.overload_cap = overload_cap
        self.refusal_log = refusal_log
        self.sender_limits = self._sender_limits()
        self.hop: Hop | None = None
        self._sender_refresh_at = -float("inf")
        self._sender_refresh_lock: asyncio.Lock | None = None

    def _sender_limits(self) -> SenderLimits:
        """Per-sender limits, sized so honest traffic never meets them.

        In flight: half of the global cap (`overload_cap`), so one sender can never take every slot;
        an honest driver keeps `--max-inflight` trips in flight (default 4, an eighth of it for a
        2-stage run and less for longer ones), and an honest relay only carries more when this peer
        is near its global cap anyway. Rate: a sender refills a slot only when we answered, so honest
        trips arrive no faster than we complete them (plus a few quick retries after refusals); the
        bucket allows 4× our measured rate, at least 20 trips/s, in bursts of twice the in-flight cap.
        The rate is set once the stage's throughput is measured (`set_throughput`)."""
        cap = max(self.overload_cap // 2, 1)
        return SenderLimits(rate=20.0, burst=2.0 * cap, max_inflight=cap)

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

    def _upstream(self) -> set[str]:
        """Peer ids with a live record of this run for the stage before ours (for stage 1: the drivers)."""
        hop, now = self.hop, get_dht_time()
        if hop is None or not hop.index:
            return set()
        return {e.record.peer_id for e in hop.router.stages.get(hop.index - 1, []) if e.expiration > now}

    def admit_stream(self, peer: PeerID) -> ErrorCode | None:
        """The transport asks this before reading a stream: a sender that is not upstream of us is refused
        at once, unless a DHT re-read is due (then `handle_trip` reads the message and checks again after
        re-reading, so a peer that joined a moment ago is served). Everything else is decided there."""
        if self.hop is None or not self.hop.index or self.state() != "online":
            return None
        if peer.to_base58() in self._upstream():
            return None
        if time.monotonic() - self._sender_refresh_at >= SENDER_REFRESH_INTERVAL:
            return None
        return ErrorCode.UNKNOWN_SENDER

    async def _admit(self, sender: str) -> bytes | None:
        """None if `sender` may send us a trip now (its slot then taken), else the refusal. Nothing of the
        message is read before this: an unknown sender costs a set lookup and, at most once per
        SENDER_REFRESH_INTERVAL for all of them together, a DHT read (so an honest peer that joined
        seconds ago is refused at most until that read)."""
        hop, state = self.hop, self.state()
        if hop is None or state != "online":
            return self.refuse(sender, ErrorCode.LEAVING, f"peer is {state}, not serving")
        if hop.runtime.stage.is_head:
            return self.refuse(sender, ErrorCode.WRONG_STAGE, "stage 0 drives trips and accepts none")
        if sender not in self._upstream():
            if self._sender_refresh_lock is None:
                self._sender_refresh_lock = asyncio.Lock()
            async with self._sender_refresh_lock:
                if time.monotonic() - self._sender_refresh_at >= SENDER_REFRESH_INTERVAL:
                    self._sender_refresh_at = time.monotonic()
                    try:
                        hop.router.update(await asyncio.wait_for(self.fetch(), 5.0))
                    except Exception as exc:  # noqa: BLE001 - refuse now; the next miss reads again
                        logger.warning("%s could not read the DHT for a sender check: %s", self.label(), exc)
            if sender not in self._upstream():
                return self.refuse(
                    sender, ErrorCode.UNKNOWN_SENDER, f"no live record of stage {hop.index - 1} for this peer id"
                )
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
        return await hop.serve(blob, lambda code, message, hops: self.refuse(sender, code, message, hops))
