"""K/V messages between the lanes of one trip (issue 17): the libp2p handler and the per-trip exchange.

A stage with context parallelism P is served by lanes 0..P-1; a trip names one peer per lane (its
group, fixed by the driver when the trip starts). Per layer, lane c sends its K/V message
(`swarm.cp_wire`) to the trip's peers of lanes > c and waits for those of lanes < c; backward it
returns each received message's gradient to its sender and gets back those of its own message from
lanes > c (`swarm.cp_lane.LaneTrip` sums them).

`KVService` (one per peer) receives these messages on its own stream handler, `<run>.kv`, through
`peer.transport.TripServicer`, so a K/V stream has the same bounds as a trip stream (bytes, chunks,
rate, receive slots per sender and in all, the frame size checked before its body is read). Each
message is answered with `ACK` or a refusal code, and every check comes before a tensor is allocated:
the header's form (`parse_kv_header`), then, for a trip this peer has registered, the sender: libp2p
authenticates the remote peer id, and it must be the peer the trip's group names for the lane the
message claims (`unknown_sender` otherwise); then `decode_kv`'s claims (run, CP basis version and
hash, stage, layer, lanes, kind, dtype, shapes, byte count), then the values.

A lane may hear from a trip before it registered the trip itself (its own boundary message can be
slower than an earlier lane's K/V): such a message is checked against this peer's current codec and
kept as bytes in `peer.kv_early.EarlyBuffer`, bounded per sender, per trip and in all (bytes and count)
and for `ttl` seconds; beyond a bound it is refused `overloaded`. When the trip registers
(`KVService.open`), what its group does not name as the sender, or what no longer decodes under the
trip's codec, is dropped and counted.
A message for a trip closed here a moment ago is refused `timeout` rather than buffered.

`LaneExchange` is one trip at one lane. Sends go through the trip's `peer/link.py` `Link`, as a trip's boundary
message does: straight, or through the relay a lane peer's record names (the relay delivers them to this same
handler, `p2pio.relay_service.KV`). They go to every destination at once and fail, like receives
that wait too long, as a `WireError` with a code: the caller retries the trip with another group, never
finishing it with stale K/V. Bytes are message bytes (the K/V message, or the reply), counted per
exchange and per service (`bytes_in` of a service: every message its handler read, refused ones too);
the stream framing adds 17 bytes per chunk of up to 1 MiB and an end frame.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence

import torch
from hivemind.p2p import P2P, PeerID

from p2pio.framing import GRACE_S, MIN_RATE, receive_deadline
from p2pio.relay_service import KV
from peer.kv_early import BufferLimits, EarlyBuffer, EarlyMessage
from peer.link import Link, NoRelays
from peer.relay import TripSender
from peer.transport import MAX_PER_SENDER, TripServicer
from swarm.cp_modes import KVCompression
from swarm.cp_wire import CPCodec, Kind, KVExpectation, KVHeader, decode_kv, encode_kv, parse_kv_header
from swarm.wire import ErrorCode, WireError, encode_error, raise_if_error

logger = logging.getLogger(__name__)

ACK = b"KVOK"
MAX_REPLY = 4096  # an ACK or a refusal (at most ~1 KB of JSON)
KINDS: tuple[Kind, ...] = ("forward", "backward")
RECEIVE_TIMEOUT = 60.0  # a lane waiting for an earlier lane's K/V of one layer (the peer passes its trip timeout)
MAX_CLOSED = 4096  # trip ids remembered as closed, for `BufferLimits.ttl`

Payload = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # Z_k, Z_v, θ (or their gradients)


def message_limit(codec: CPCodec, lane: int, mode: KVCompression) -> int:
    """The largest K/V message a peer of `lane` accepts under `codec` and `mode` (the transport's bound)."""
    return max(codec.expectation(kind, lane, mode).max_bytes for kind in KINDS)


def _sources(kind: str, lane: int, size: int) -> range:
    """The lanes a lane hears from: the earlier ones forward (their K/V), the later ones backward."""
    return range(lane) if kind == "forward" else range(lane + 1, size)


class LaneExchange:
    """One trip's K/V traffic at one lane; made by `KVService.open`, freed by `close`."""

    def __init__(
        self,
        service: KVService,
        trip_id: str,
        group: Sequence[PeerID | str],
        lane: int,
        mode: KVCompression | None,
        link: Link | None = None,
    ):
        codec = service.codec
        if codec is None or mode is None:
            raise WireError(ErrorCode.LEAVING, "this peer serves no lane")
        peers = [p if isinstance(p, PeerID) else PeerID.from_base58(p) for p in group]
        if len(peers) != codec.spec.size or not 0 <= lane < len(peers) or peers[lane] != service.p2p.peer_id:
            raise ValueError(f"a group of {len(peers)} peers not naming this peer at lane {lane} of {codec.spec.size}")
        self.service, self.trip_id, self.group, self.lane, self.link = service, trip_id, peers, lane, link
        self.codec, self.mode = codec, mode
        self.expect: dict[str, KVExpectation] = {kind: codec.expectation(kind, lane, mode) for kind in KINDS}
        self.inbox: dict[tuple[str, int], dict[int, Payload]] = {}
        self.complete: dict[tuple[str, int], asyncio.Event] = {}
        self.taken: set[tuple[str, int]] = set()
        self.bytes_in = self.bytes_out = 0
        self.closed = False

    def check_sender(self, header: KVHeader, remote: PeerID) -> None:
        if not 0 <= header.src < len(self.group) or self.group[header.src] != remote:
            raise WireError(ErrorCode.UNKNOWN_SENDER, f"this trip's group names another peer for lane {header.src}")

    def _check_new(self, header: KVHeader) -> None:
        if self.closed:
            raise WireError(ErrorCode.TIMEOUT, "trip closed here")
        key = (header.kind, header.layer)
        if key in self.taken or header.src in self.inbox.get(key, {}):
            raise WireError(ErrorCode.MALFORMED, f"a second {header.kind} message of layer {header.layer}")

    async def accept(self, header: KVHeader, blob: bytes, remote: PeerID) -> None:
        """Check the sender, decode (off the event loop) and file a message; raises WireError."""
        self.check_sender(header, remote)
        self._check_new(header)
        _, z_k, z_v, theta = await asyncio.to_thread(decode_kv, blob, self.expect[header.kind])
        self._check_new(header)  # the trip may have closed, or the same message come twice, meanwhile
        key = (header.kind, header.layer)
        received = self.inbox.setdefault(key, {})
        received[header.src] = (z_k, z_v, theta)
        self.bytes_in += len(blob)
        if len(received) == len(_sources(header.kind, self.lane, len(self.group))):
            self.complete.setdefault(key, asyncio.Event()).set()

    async def send_forward(self, layer: int, z_k: torch.Tensor, z_v: torch.Tensor, theta: torch.Tensor | None) -> None:
        """This lane's K/V message of `layer` to every later lane, at once."""
        payloads = {dst: (z_k, z_v, theta) for dst in range(self.lane + 1, len(self.group))}
        await self._send("forward", layer, payloads)

    async def send_backward(self, layer: int, grads: dict[int, Payload]) -> None:
        """The gradient of each received message of `layer` back to its sender (the earlier lanes)."""
        if set(grads) != set(range(self.lane)):
            raise ValueError(f"gradients for lanes {sorted(grads)}, lane {self.lane} received from {self.lane} lanes")
        await self._send("backward", layer, grads)

    async def receive_forward(self, layer: int, timeout: float | None = None) -> dict[int, Payload]:
        """The K/V of `layer` of every earlier lane, by lane."""
        return await self._receive("forward", layer, timeout)

    async def receive_backward(self, layer: int, timeout: float | None = None) -> dict[int, Payload]:
        """The gradients of this lane's message of `layer` from every later lane, by lane (summed by the
        caller, `swarm.cp_lane.LaneTrip.backward_layer`; the last lane gets none)."""
        return await self._receive("backward", layer, timeout)

    def close(self) -> None:
        """Free everything of this trip here; waiting receives fail, later messages are refused."""
        if self.closed:
            return
        self.closed = True
        self.inbox.clear()
        for event in self.complete.values():
            event.set()
        self.service.forget(self)

    async def _send(self, kind: Kind, layer: int, payloads: dict[int, Payload]) -> None:
        expect = self.expect[kind]
        if (self.codec.basis.version, self.codec.basis.sha256) != (expect.cp_version, expect.cp_sha256):
            raise WireError(ErrorCode.WRONG_CP_VERSION, f"CP basis switched to v{self.codec.basis.version} in the trip")
        if not payloads:
            return

        def encode() -> dict[int, bytes]:
            blobs = {}
            for peer_lane, (z_k, z_v, theta) in payloads.items():  # from this lane to `peer_lane`
                owner = self.lane if kind == "forward" else peer_lane  # the lane whose K/V it is
                header = self.codec.header(
                    kind, layer, owner, self.lane, peer_lane, z_k.shape[0], self.mode, self.trip_id
                )
                blobs[peer_lane] = encode_kv(header, z_k, z_v, theta)
            return blobs

        blobs = await asyncio.to_thread(encode)
        sends = [self.service.send(self.group[peer_lane], blob, self.link) for peer_lane, blob in blobs.items()]
        failures = [r for r in await asyncio.gather(*sends, return_exceptions=True) if isinstance(r, BaseException)]
        self.bytes_out += sum(len(blob) for blob in blobs.values())
        if failures:
            raise failures[0]

    async def _receive(self, kind: str, layer: int, timeout: float | None) -> dict[int, Payload]:
        key, expected = (kind, layer), _sources(kind, self.lane, len(self.group))
        if self.closed:
            raise WireError(ErrorCode.TIMEOUT, "trip closed here")
        if key in self.taken:
            raise ValueError(f"{kind} K/V of layer {layer} was received already")
        if expected:
            timeout = self.service.receive_timeout if timeout is None else timeout
            try:
                await asyncio.wait_for(self.complete.setdefault(key, asyncio.Event()).wait(), timeout)
            except asyncio.TimeoutError:
                missing = [src for src in expected if src not in self.inbox.get(key, {})]
                raise WireError(
                    ErrorCode.TIMEOUT, f"no {kind} K/V of layer {layer} from lane(s) {missing} in {timeout:.3g}s"
                ) from None
        if self.closed:
            raise WireError(ErrorCode.TIMEOUT, "trip closed while waiting for K/V")
        self.taken.add(key)
        self.complete.pop(key, None)
        return self.inbox.pop(key, {})


class KVService:
    """This peer's K/V handler, its registered trips and its early messages (see the module docstring).

    `serve(codec, lane, mode)` says what the peer serves (None: nothing; every message is then refused
    `leaving`); `admit(peer)`, if given, is asked before a stream is read (e.g. only known lane peers of
    the stage), as the trip handler's admission is. `min_rate` (bytes/s, the peer's `--min-stream-kbit`) is the
    rate a K/V stream must keep, received (`TripServicer`) and sent (a send may take as long as it allows);
    `receive_timeout` is how long a lane waits for another lane's K/V of one layer (the peer's trip timeout)."""

    def __init__(
        self,
        p2p: P2P,
        namespace: str,
        max_bytes: int,
        *,
        limits: BufferLimits | None = None,
        min_rate: float = MIN_RATE,
        receive_timeout: float = RECEIVE_TIMEOUT,
        admit: Callable[[PeerID], ErrorCode | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.p2p, self.namespace = p2p, namespace + KV
        self.straight = Link(TripSender(p2p, self.namespace), NoRelays())  # for trips opened without a link
        self.min_rate, self.receive_timeout, self.clock = min_rate, receive_timeout, clock
        self.early = EarlyBuffer(limits or BufferLimits())
        self.exchanges: dict[str, LaneExchange] = {}
        self.sending: dict[PeerID, asyncio.Semaphore] = {}  # per destination: its receive slots for one sender
        self.senders: Counter[PeerID] = Counter()  # sends waiting or running, per destination
        self.closed: dict[str, float] = {}  # trip id → until when its messages are refused
        self.codec: CPCodec | None = None
        self.mode: KVCompression | None = None
        self.lane = 0
        self.bytes_in = self.bytes_out = 0
        self.refused: Counter[str] = Counter()
        self.dropped = 0  # early messages dropped at registration (sender not in the group, or stale)
        self.admit = admit
        self.servicer = TripServicer(
            self._on_message, max_bytes, on_refused=self._count, admit=self._admit, min_rate=min_rate
        )

    async def start(self) -> None:
        await self.servicer.add_p2p_handlers(self.p2p, namespace=self.namespace)

    async def stop(self) -> None:
        await self.servicer.remove_p2p_handlers(self.p2p, namespace=self.namespace)
        for exchange in list(self.exchanges.values()):
            exchange.close()
        self.early = EarlyBuffer(self.early.limits)

    def serve(self, codec: CPCodec | None, lane: int = 0) -> None:
        """What this peer serves from now on: `codec`'s stage at `lane`, messages in the spec's mode. Open trips
        keep what they were opened with."""
        self.codec, self.lane = codec, lane
        self.mode = None if codec is None else codec.spec.mode
        if codec is not None:  # one message per layer from each other lane, each way
            trip_count = 2 * len(codec.layers) * max(codec.spec.size - 1, 1)
            self.early.limits = dataclasses.replace(self.early.limits, trip_count=trip_count)

    async def open(self, trip_id: str, group: Sequence[PeerID | str], link: Link | None = None) -> LaneExchange:
        """Register a trip (its group names one peer per lane, by id or base58, this peer at its lane) and hand
        it the early messages its group names as their senders and that decode under the current codec. `link`:
        the served stage's (`peer/link.py`, through the relay a lane peer's record names), by default every peer
        straight."""
        if trip_id in self.exchanges or trip_id in self.closed:
            raise ValueError(f"trip {trip_id!r} is open or was closed here: a retried trip needs a new id")
        exchange = LaneExchange(self, trip_id, group, self.lane, self.mode, link)
        self.exchanges[trip_id] = exchange
        try:
            for message in self.early.take(trip_id, self.clock()):
                try:
                    await exchange.accept(message.header, message.blob, message.sender)
                except WireError as exc:
                    self.dropped += 1
                    logger.debug("dropped an early K/V message of trip %s from %s: %s", trip_id, message.sender, exc)
        except BaseException:  # cancelled while decoding: the trip is not left registered
            exchange.close()
            raise
        return exchange

    def forget(self, exchange: LaneExchange) -> None:
        if self.exchanges.get(exchange.trip_id) is exchange:
            del self.exchanges[exchange.trip_id]
        now = self.clock()
        self.closed = {trip: until for trip, until in self.closed.items() if until > now}
        if len(self.closed) >= MAX_CLOSED:
            del self.closed[next(iter(self.closed))]
        self.closed[exchange.trip_id] = now + self.early.limits.ttl
        self.early.take(exchange.trip_id, now)

    async def send(self, peer: PeerID, blob: bytes, link: Link | None = None) -> None:
        """One message to `peer` over `link` (by default straight), answered with ACK; anything else is a WireError.

        At most `MAX_PER_SENDER` streams go to one peer at once, the receive slots a receiver gives one sender
        (`peer.transport.TripServicer`): further sends wait here instead of being refused `overloaded` there
        after its grace (on a slow uplink, trips in flight × layers of K/V outnumber the slots). Once sending,
        a message may take as long as a receiver at this peer's minimum stream rate would allow it."""
        self.bytes_out += len(blob)
        slots = self.sending.setdefault(peer, asyncio.Semaphore(MAX_PER_SENDER))
        self.senders[peer] += 1
        timeout = receive_deadline(len(blob), self.min_rate) + GRACE_S  # + the reply's own grace
        try:
            async with slots:
                reply = await (link or self.straight).send(peer, blob, timeout, MAX_REPLY)
        finally:
            self.senders[peer] -= 1
            if not self.senders[peer]:  # kept only while a send to `peer` is waiting or running
                del self.senders[peer], self.sending[peer]
        raise_if_error(reply)
        if reply != ACK:
            raise WireError(ErrorCode.MALFORMED, f"{peer} answered a K/V message with {reply[:16]!r}")

    def _admit(self, peer: PeerID) -> ErrorCode | None:
        """Asked before a stream gets a receive slot: nobody while this peer serves no lane."""
        if self.codec is None:
            return ErrorCode.LEAVING
        return None if self.admit is None else self.admit(peer)

    def _count(self, code: ErrorCode) -> None:
        self.refused[code.value] += 1

    async def _on_message(self, blob: bytes, remote: PeerID) -> bytes:
        self.bytes_in += len(blob)
        try:
            await self._accept(blob, remote)
        except WireError as exc:
            self._count(exc.code)
            logger.debug("refused a K/V message from %s: %s", remote, exc)
            return encode_error(exc.code, exc.message)
        return ACK

    async def _accept(self, blob: bytes, remote: PeerID) -> None:
        codec, mode = self.codec, self.mode
        if codec is None or mode is None:
            raise WireError(ErrorCode.LEAVING, "this peer serves no lane")
        header, _ = parse_kv_header(blob)
        if header.kind not in KINDS:
            raise WireError(ErrorCode.WRONG_KIND, f"unknown kind {header.kind!r}")
        exchange = self.exchanges.get(header.trip_id)
        if exchange is None:
            if self.closed.get(header.trip_id, 0.0) > self.clock():
                raise WireError(ErrorCode.TIMEOUT, "trip closed here")
            self.early.check_room(remote, header.trip_id, len(blob), self.clock())
            await asyncio.to_thread(decode_kv, blob, codec.expectation(header.kind, self.lane, mode))
            exchange = self.exchanges.get(header.trip_id)  # it may have registered, or even closed, meanwhile
            if exchange is None and self.closed.get(header.trip_id, 0.0) > self.clock():
                raise WireError(ErrorCode.TIMEOUT, "trip closed here")
            if exchange is None:
                self.early.add(EarlyMessage(remote, header, blob), self.clock())
                return
        await exchange.accept(header, blob, remote)
