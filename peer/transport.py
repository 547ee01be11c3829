"""Moving opaque byte messages between peers over hivemind's libp2p streams.

A boundary message can exceed libp2p's 2 MiB unary limit (dense activations do), so every
message travels as a stream of chunks, and the reply comes back the same way. `TripServicer`
delegates to a callback; this module knows nothing about stages or tensors.

On the wire a stream is hivemind's protobuf streaming format, unchanged (peers of older versions
interoperate): a frame is a marker byte (0: a message, 1: an error or the end of the stream), an
8-byte big-endian length, and that many bytes of protobuf (`ExpertRequest`/`ExpertResponse` with
only `metadata` set, one chunk of the message). Both ends read those frames themselves, with
`p2pio/framing.py` `Frames`, instead of through hivemind's `_add_protobuf_stream_handler`/`receive_protobuf`,
because hivemind reads a frame's whole declared length into memory before anyone can look at it
(`P2P.receive_raw_data`: `await reader.readexactly(content_length)`): a 256 MB frame cost a peer
~790 MB before the 28 KB limit applied. Here the length is checked first and a frame over the
limit is refused without reading its body.

Receiving is bounded, so that no sender can hold a peer's memory, CPU or receive slots:

- bytes: at most `max_bytes` of message, in frames of at most `min(max_bytes, CHUNK_BYTES)` bytes
  (plus the protobuf field's few bytes), checked against the frame header before the body is read;
- chunks: a message of N bytes travels in at most ceil(N / CHUNK_BYTES) + 1 chunks, checked after
  every chunk (empty chunks count), so a flood of empty chunks is refused at its second chunk;
- time: a stream must keep up a minimum rate. At t seconds after its reception began it must have
  delivered at least `min_rate * (t - grace)` bytes, or it is cut (`timeout`), so a stream that
  stalls is cut `grace` seconds (+ what it sent / `min_rate`) after it began, and no stream lasts
  longer than `grace + max_bytes / min_rate` (+ frame overhead / `min_rate`). Defaults: grace 5 s,
  min rate 128 KiB/s (1 Mbit/s): a 28 KB compressed trip may take at most 5.2 s, a 4 MiB dense one
  37 s; `receive_timeout`, when given, caps that further;
- slots: at most `max_receiving` messages are received at once (16); one sender (libp2p peer id)
  gets at most `max_per_sender` of them (4): its further streams wait up to `grace` seconds for one
  of its own slots (at most `max_per_sender` waiting), and beyond that are refused (`overloaded`).
  One identity opening many streams therefore takes 4 of the 16 slots, never all of them, and for
  at most `grace` seconds each if it does not send. When all 16 are taken (many identities), a new
  stream cuts the stream with the least progress (bytes / elapsed, stalled ones first; at least
  `EVICT_AFTER_S` old; `overloaded`), whoever holds it and however many it holds, so stalled streams
  from many identities, one each, cannot starve others (`slowest`). Before any of this, `admit` (the
  peer's `TripServer.admit_stream`) refuses a sender that is not a known upstream peer, so a stranger
  never holds a slot at all;
- after a refusal the rest of the message is read and dropped for up to 1 s before the stream is
  closed (`_linger`), so the refusal reaches the sender instead of being overtaken by a stream reset;
- a sender that hangs up while its message is being handled gets its handler cancelled (`_answer`):
  a trip abandoned upstream (a timeout there, or a lane of the same trip failed) holds no activations
  or admission slot here for its remaining timeouts.

hivemind's own protobuf stream handlers in the same process (the averager's) keep hivemind's reader;
`TripServicer.add_p2p_handlers` also bounds its frames and quiets its per-stream tracebacks, process-wide
(`p2pio/hivemind_guards.py`).

Every refusal is counted through `on_refused(code)` (and `on_refused_from(code, peer)` if given),
answered with an error reply when the stream still takes one, and logged at DEBUG only: garbage
on the stream never writes a traceback.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import closing, suppress

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto import runtime_pb2

from p2pio.framing import GRACE_S, LINGER_BYTES, LINGER_S, MIN_RATE, READ_PIECE, Frames, receive_deadline, write_message
from p2pio.hivemind_guards import limit_hivemind_frames, quiet_hivemind_stream_errors
from swarm.wire import ErrorCode, WireError, encode_error

logger = logging.getLogger(__name__)

MAX_RECEIVING = 16
MAX_PER_SENDER = 4
MAX_LINGERING = 64
EVICT_AFTER_S = 0.25  # a stream this young is never cut for a newcomer: an honest 28 KB trip needs < 0.25 s at 1 Mbit/s
_HANDLE = "TripServicer.rpc_trip"  # the handler name hivemind's ServicerBase gave it: kept for compatibility

TripHandler = Callable[[bytes, PeerID], Awaitable[bytes]]


class _Sender:
    __slots__ = ("slots", "users", "active")

    def __init__(self, slots: int):
        self.slots, self.users = asyncio.Semaphore(slots), 0
        self.active: list[_Reception] = []  # its streams holding a receive slot, oldest first


class _Reception:
    __slots__ = ("task", "evicted", "frames")

    def __init__(self, task: asyncio.Task, frames: Frames):
        self.task, self.evicted, self.frames = task, False, frames

    def rate(self, now: float) -> float:
        """Bytes per second this stream has delivered so far (0 for a stalled one)."""
        return self.frames.received / max(now - self.frames.start, 1e-3)


def slowest(receptions: list[tuple[float, float]], now: float) -> int | None:
    """Index of the stream to cut for a newcomer when every receive slot is taken, given each stream's
    (start time, bytes received): the one with the least progress (bytes / elapsed; a stalled stream has
    none), among those that began at least EVICT_AFTER_S ago. Who sends it does not matter, so many
    identities each holding one stalled stream are cut one by one as honest trips arrive. None if every
    stream began less than EVICT_AFTER_S ago (then the newcomer is refused: the slots are busy, not held)."""
    best, best_rate = None, float("inf")
    for i, (start, received) in enumerate(receptions):
        elapsed = now - start
        if elapsed < EVICT_AFTER_S:
            continue
        rate = received / elapsed
        if rate < best_rate:
            best, best_rate = i, rate
    return best


class TripServicer:
    """One boundary message in, the reply (a message or an error) out, on hivemind's stream handler
    `<namespace>::TripServicer.rpc_trip`; receiving is bounded as the module docstring says.

    `admit(peer)`, if given, is asked before anything is read from a stream: a code refuses the
    stream at once (e.g. `unknown_sender` for a peer id outside the pipeline), None reads it.
    """

    def __init__(
        self,
        on_trip: TripHandler,
        max_bytes: int,
        on_refused: Callable[[ErrorCode], None] = lambda code: None,
        max_receiving: int = MAX_RECEIVING,
        receive_timeout: float | None = None,
        *,
        max_per_sender: int = MAX_PER_SENDER,
        min_rate: float = MIN_RATE,
        grace: float = GRACE_S,
        on_refused_from: Callable[[ErrorCode, PeerID], None] | None = None,
        admit: Callable[[PeerID], ErrorCode | None] | None = None,
    ):
        if max_receiving < 1 or max_per_sender < 1 or min_rate <= 0 or grace <= 0:
            raise ValueError("receive bounds must be positive")
        self.on_trip, self.max_bytes, self.on_refused = on_trip, max_bytes, on_refused
        self.on_refused_from, self.admit = on_refused_from, admit
        self.max_receiving = max_receiving
        self.max_per_sender = max(1, min(max_per_sender, max_receiving - 1))
        self.min_rate, self.grace = min_rate, grace
        self.deadline = receive_deadline(max_bytes, min_rate, grace)
        if receive_timeout is not None:
            self.deadline = min(self.deadline, receive_timeout)
        self.receiving = asyncio.Semaphore(max_receiving)
        self.senders: dict[PeerID, _Sender] = {}
        self.served = 0
        self.abandoned = 0  # messages whose sender hung up before the reply (`_answer`)
        self.lingering = 0

    @staticmethod
    def handle_name(namespace: str | None) -> str:
        return _HANDLE if namespace is None else f"{namespace}::{_HANDLE}"

    async def add_p2p_handlers(self, p2p: P2P, *, namespace: str | None = None, balanced=False) -> None:
        """Register the raw stream handler (not hivemind's protobuf one, which buffers whole frames),
        and bound and quiet hivemind's own stream handlers in this process (the averager's)."""
        quiet_hivemind_stream_errors()
        limit_hivemind_frames()
        await p2p.add_binary_stream_handler(self.handle_name(namespace), self._handle_stream, balanced=balanced)

    async def remove_p2p_handlers(self, p2p: P2P, *, namespace: str | None = None) -> None:
        await p2p.remove_binary_stream_handler(self.handle_name(namespace))

    def _refused(self, exc: WireError, remote: PeerID) -> None:
        logger.debug("refused a trip stream from %s: %s", remote, exc)
        self.on_refused(exc.code)
        if self.on_refused_from is not None:
            self.on_refused_from(exc.code, remote)

    async def _handle_stream(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        await self.serve_stream(info.peer_id, reader, writer)

    async def serve_stream(self, remote: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One trip stream from `remote`: libp2p's authenticated peer, or the sender a relay we registered with
        names (`peer/relay.py` `RelayClient`); either way within every bound above."""
        with closing(writer):
            try:
                complete = False
                try:
                    blob = await self._receive(remote, reader)
                    complete = True
                except WireError as exc:
                    self._refused(exc, remote)
                    reply = encode_error(exc.code, exc.message)
                else:
                    try:
                        reply = await self._answer(blob, remote, reader)
                    except WireError as exc:
                        reply = encode_error(exc.code, exc.message)
                    except Exception as exc:  # noqa: BLE001 - a bug in the handler, not the sender's doing
                        logger.exception("trip handler failed on a message from %s", remote)
                        reply = encode_error(ErrorCode.INTERNAL, f"{type(exc).__name__}")
                    self.served += 1
                    if reply is None:
                        self.abandoned += 1
                        return
                await self._send(writer, reply, remote)
                if not complete:
                    await self._linger(reader)
            except Exception as exc:  # noqa: BLE001 - a broken stream must not reach asyncio's error log
                logger.debug("trip stream from %s ended: %s: %s", remote, type(exc).__name__, exc)

    async def _answer(self, blob: bytes, remote: PeerID, reader: asyncio.StreamReader) -> bytes | None:
        """`on_trip`'s reply, or None if the sender hung up first: its message ended with the end frame, so the
        stream has nothing more to say until the sender closes it (it gave up: a timeout, or its own trip was
        cancelled). The handler is then cancelled at once rather than holding the trip's activations and its
        admission slot until its own timeouts. A byte after the end frame counts as hanging up too."""
        handling = asyncio.ensure_future(self.on_trip(blob, remote))
        hang_up = asyncio.ensure_future(reader.read(1))
        try:
            await asyncio.wait({handling, hang_up}, return_when=asyncio.FIRST_COMPLETED)
            if handling.done():
                return handling.result()
            logger.debug("the sender %s hung up: its trip is dropped here", remote)
            return None
        finally:
            for task in (handling, hang_up):
                task.cancel()
            await asyncio.gather(handling, hang_up, return_exceptions=True)

    async def _receive(self, remote: PeerID, reader: asyncio.StreamReader) -> bytes:
        if self.admit is not None and (code := self.admit(remote)) is not None:
            raise WireError(code, "sender not admitted")
        sender = self.senders.get(remote)
        if sender is None:
            sender = self.senders[remote] = _Sender(self.max_per_sender)
        if sender.users >= 2 * self.max_per_sender:
            raise WireError(ErrorCode.OVERLOADED, f"{sender.users} streams from one sender")
        sender.users += 1
        try:
            try:
                if sender.slots.locked():
                    await asyncio.wait_for(sender.slots.acquire(), self.grace)
                else:
                    await sender.slots.acquire()
            except asyncio.TimeoutError:
                raise WireError(ErrorCode.OVERLOADED, "too many messages from one sender being received") from None
            try:
                return await self._receive_in_slot(sender, reader)
            finally:
                sender.slots.release()
        finally:
            sender.users -= 1
            if sender.users == 0:
                self.senders.pop(remote, None)

    async def _receive_in_slot(self, sender: _Sender, reader: asyncio.StreamReader) -> bytes:
        if not self.receiving.locked():
            await self.receiving.acquire()
        elif self._evict():
            try:
                await asyncio.wait_for(self.receiving.acquire(), 1.0)
            except asyncio.TimeoutError:
                raise WireError(ErrorCode.OVERLOADED, "too many messages being received") from None
        else:
            raise WireError(ErrorCode.OVERLOADED, "too many messages being received")
        frames = Frames(reader, self.max_bytes, min_rate=self.min_rate, grace=self.grace, deadline=self.deadline)
        reception = _Reception(asyncio.current_task(), frames)
        sender.active.append(reception)
        try:
            return await frames.message(runtime_pb2.ExpertRequest)
        except asyncio.CancelledError:
            if not reception.evicted:
                raise
            if hasattr(reception.task, "uncancel"):
                reception.task.uncancel()
            raise WireError(ErrorCode.OVERLOADED, "cut: the slowest stream when all receive slots were taken") from None
        finally:
            sender.active.remove(reception)
            self.receiving.release()

    def _evict(self) -> bool:
        """All slots taken: cut the stream with the least progress (`slowest`), whoever sends it and however
        many streams its sender holds, so stalled streams (from one identity or from many, each holding a
        single stream) cannot starve anyone; a sender's own streams are already bounded by its per-sender slots."""
        now = asyncio.get_running_loop().time()
        live = [r for s in self.senders.values() for r in s.active if not r.evicted]
        i = slowest([(r.frames.start, r.frames.received) for r in live], now)
        if i is None:
            return False
        live[i].evicted = True
        live[i].task.cancel()
        return True

    async def _linger(self, reader: asyncio.StreamReader) -> None:
        """After refusing a message not read to its end: drop what the sender still sends, until it
        closes the stream (`send_trip` does on the reply's last chunk), for up to LINGER_S and
        LINGER_BYTES, before closing.

        Closing the socket to p2pd with bytes still coming makes p2pd reset the libp2p stream, and
        the reset can overtake the reply we just wrote (the sender's p2pd drops unread data on a
        reset): a sender refused early (too large, overloaded) would see a broken stream instead of
        the refusal (measured: 30 of 30 5 MB messages refused at their first frame lost the reply
        without this; half-closing our side with write_eof loses it as well). At most MAX_LINGERING
        streams linger at once; no receive slot is held meanwhile."""
        if self.lingering >= MAX_LINGERING or reader.at_eof():
            return
        self.lingering += 1
        try:

            async def drop() -> None:
                left = LINGER_BYTES
                while left > 0 and (piece := await reader.read(READ_PIECE)):
                    left -= len(piece)

            with suppress(asyncio.TimeoutError, ConnectionError):
                await asyncio.wait_for(drop(), LINGER_S)
        finally:
            self.lingering -= 1

    async def _send(self, writer: asyncio.StreamWriter, reply: bytes, remote: PeerID) -> None:
        """The reply, within grace + its size / min_rate (a sender that does not read is cut)."""
        try:
            limit = self.grace + len(reply) / self.min_rate
            await asyncio.wait_for(write_message(writer, reply, runtime_pb2.ExpertResponse, end=False), limit)
        except asyncio.TimeoutError:
            self._refused(WireError(ErrorCode.TIMEOUT, "reply not taken in time"), remote)


async def send_trip(
    p2p: P2P,
    peer: PeerID,
    namespace: str,
    blob: bytes,
    timeout: float,
    max_reply: int,
    *,
    handle: str | None = None,
    prefix: bytes = b"",
) -> bytes:
    """Send a message and wait for the reply; connection failures and timeouts become WireErrors.

    The reply is read within the same bounds as a request (bytes, chunks, frame size before its body);
    a reply that arrived in full counts even if the peer stopped reading our message (an early refusal).
    `handle` and `prefix` (bytes before the message) address a relay instead (`peer/relay.py`).
    """

    async def exchange() -> bytes:
        _, reader, writer = await p2p.call_binary_stream_handler(peer, handle or TripServicer.handle_name(namespace))
        with closing(writer):
            if prefix:
                writer.write(prefix)
            sending = asyncio.create_task(write_message(writer, blob, runtime_pb2.ExpertRequest, end=True))
            sending.add_done_callback(lambda task: task.cancelled() or task.exception())
            try:
                reply = await Frames(reader, max_reply, eof_ends=True).message(runtime_pb2.ExpertResponse)
            finally:
                sending.cancel()
        if not reply:
            raise WireError(ErrorCode.UNREACHABLE, f"{peer} closed the stream without a reply")
        return reply

    try:
        return await asyncio.wait_for(exchange(), timeout=timeout)
    except asyncio.TimeoutError:
        raise WireError(ErrorCode.TIMEOUT, f"no reply from {peer} within {timeout:.0f}s") from None
    except WireError as exc:
        raise WireError(exc.code, f"reply from {peer}: {exc.message}") from None
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - any transport failure means: try another peer
        raise WireError(ErrorCode.UNREACHABLE, f"call to {peer} failed: {type(exc).__name__}: {exc}") from None
