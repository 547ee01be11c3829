"""The frames of one trip stream: hivemind's protobuf streaming format, read within bounds and written chunked.

A frame is a marker byte (0: a message, 1: an error or the end of the stream), an 8-byte big-endian
length, and that many bytes of protobuf (`ExpertRequest`/`ExpertResponse` with only `metadata` set,
one chunk of the message). `Frames` checks a frame's length before reading its body (hivemind's own
reader reads the whole declared length first); the bounds themselves are explained in
`peer/transport.py`, which uses this module for both directions (and the trip relay,
`p2pio/relay_service.py`, to size and refuse what it carries).
"""

from __future__ import annotations

import asyncio

from google.protobuf.message import DecodeError
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from swarm.wire import ErrorCode, WireError

LINGER_S = 1.0  # after a reply: how long the rest of a refused message is read and dropped (see `_linger`)
LINGER_BYTES = 32 << 20
CHUNK_BYTES = 1 << 20
FRAME_OVERHEAD = 8  # an ExpertRequest/Response with one `metadata` of <= 1 MiB: a tag byte and a 3-byte varint
MAX_END_FRAME = 1 << 12  # the end-of-stream frame (an empty RPCError; an error message from hivemind's handler)
GRACE_S = 5.0
MIN_RATE = 128 * 1024  # bytes per second
READ_PIECE = 1 << 16
FRAME_HEADER = 1 + P2P.HEADER_LEN


def receive_deadline(max_bytes: int, min_rate: float = MIN_RATE, grace: float = GRACE_S) -> float:
    """The longest a stream of at most `max_bytes` can take to arrive: grace + its wire bytes / min_rate."""
    chunks = -(-max_bytes // CHUNK_BYTES) + 1
    return grace + (max_bytes + chunks * (FRAME_HEADER + FRAME_OVERHEAD) + FRAME_HEADER) / min_rate


class Frames:
    """Reads one message from hivemind's stream frames within bounds (see the module docstring).

    `min_rate=None` reads without a rate (the caller bounds the whole exchange with a timeout).
    `eof_ends`: the stream ends with the sender closing it (replies) rather than with an end frame
    (requests); an error frame is then the remote handler's failure. A reply also ends at its first
    chunk shorter than CHUNK_BYTES (every chunk but the last is full), so the sender need not wait
    for the receiver to close the stream.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        max_bytes: int,
        *,
        min_rate: float | None = None,
        grace: float = GRACE_S,
        deadline: float | None = None,
        eof_ends: bool = False,
    ):
        self.reader, self.max_bytes, self.min_rate, self.grace = reader, max_bytes, min_rate, grace
        self.max_frame = min(max_bytes, CHUNK_BYTES) + FRAME_OVERHEAD
        self.eof_ends = eof_ends
        self.closed_code = ErrorCode.UNREACHABLE if eof_ends else ErrorCode.MALFORMED  # a peer gone, or a sender
        self.loop = asyncio.get_running_loop()
        self.start = self.loop.time()
        self.deadline = None if deadline is None else self.start + deadline
        self.received = 0  # bytes off the stream, frame headers included

    def _cut_at(self) -> float | None:
        cut = None if self.min_rate is None else self.start + self.grace + self.received / self.min_rate
        if self.deadline is not None:
            cut = self.deadline if cut is None else min(cut, self.deadline)
        return cut

    async def _read(self, n: int, eof_ok: bool = False) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            cut = self._cut_at()
            if cut is None:
                piece = await self.reader.read(min(n - len(buf), READ_PIECE))
            else:
                left = cut - self.loop.time()
                try:
                    if left <= 0:
                        raise asyncio.TimeoutError
                    piece = await asyncio.wait_for(self.reader.read(min(n - len(buf), READ_PIECE)), left)
                except asyncio.TimeoutError:
                    raise WireError(ErrorCode.TIMEOUT, self._too_slow()) from None
            if not piece:
                if eof_ok and not buf:
                    return b""
                raise WireError(self.closed_code, "stream closed in the middle of a message")
            buf += piece
            self.received += len(piece)
        return bytes(buf)

    def _too_slow(self) -> str:
        took = self.loop.time() - self.start
        if self.min_rate is None:
            return f"message not received within {took:.1f}s"
        return (
            f"stream cut after {took:.1f}s with {self.received} bytes: slower than {self.min_rate:.0f} B/s "
            f"after a {self.grace:.0f}s grace"
        )

    async def message(self, chunk_type=runtime_pb2.ExpertRequest) -> bytes:
        parts, total, chunks = [], 0, 0
        while True:
            head = await self._read(FRAME_HEADER, eof_ok=self.eof_ends)
            if not head:
                return b"".join(parts)
            marker, length = head[:1], int.from_bytes(head[1:], P2P.BYTEORDER)
            if marker == P2P.ERROR_MARKER:
                if length > MAX_END_FRAME:
                    raise WireError(ErrorCode.TOO_LARGE, f"an end-of-stream frame of {length} bytes")
                body = await self._read(length)
                if not self.eof_ends:
                    return b"".join(parts)
                raise WireError(ErrorCode.UNREACHABLE, f"remote handler failed: {rpc_error(body)}")
            if marker != P2P.MESSAGE_MARKER:
                raise WireError(ErrorCode.MALFORMED, f"not a stream frame (marker {marker!r})")
            if length > self.max_frame:
                raise WireError(ErrorCode.TOO_LARGE, f"a frame of {length} bytes (limit {self.max_frame})")
            chunks += 1
            body = await self._read(length)
            try:
                chunk = chunk_type.FromString(body)
            except (DecodeError, ValueError, RuntimeError):
                raise WireError(ErrorCode.MALFORMED, "a frame is not a protobuf chunk") from None
            if any(field.name != "metadata" for field, _ in chunk.ListFields()):
                raise WireError(ErrorCode.MALFORMED, "a chunk carries fields other than its bytes")
            total += len(chunk.metadata)
            if total > self.max_bytes:
                raise WireError(ErrorCode.TOO_LARGE, f"message exceeds {self.max_bytes} bytes")
            if chunks > -(-total // CHUNK_BYTES) + 1:
                raise WireError(ErrorCode.MALFORMED, f"{chunks} chunks for {total} bytes")
            parts.append(chunk.metadata)
            if self.eof_ends and len(chunk.metadata) < CHUNK_BYTES:
                return b"".join(parts)


def rpc_error(body: bytes) -> str:
    try:
        return RPCError.FromString(body).message[:200]
    except Exception:  # noqa: BLE001 - an unreadable error is still an error
        return "unreadable error"


def frame(marker: bytes, payload: bytes) -> bytes:
    return marker + len(payload).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + payload


def split_message(blob: bytes, message_type) -> list:
    return [message_type(metadata=blob[i : i + CHUNK_BYTES]) for i in range(0, max(len(blob), 1), CHUNK_BYTES)]


async def write_message(writer: asyncio.StreamWriter, blob: bytes, message_type, end: bool) -> None:
    for chunk in split_message(blob, message_type):
        writer.write(frame(P2P.MESSAGE_MARKER, chunk.SerializeToString()))
        await writer.drain()
    if end:
        writer.write(frame(P2P.ERROR_MARKER, b""))  # hivemind's END_OF_STREAM: an empty RPCError
        await writer.drain()
