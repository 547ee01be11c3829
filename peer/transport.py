"""Moving opaque byte messages between peers over hivemind's libp2p streams.

A boundary message can exceed libp2p's 2 MiB unary limit (dense activations do), so every
message travels as a stream of chunks, and the reply comes back the same way. The receiver
stops reading as soon as a sender goes past its size limit. `TripServicer` delegates to a
callback; this module knows nothing about stages or tensors.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import AsyncIterator  # hivemind recognises streaming handlers by typing's alias only

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from swarm.wire import ErrorCode, WireError, encode_error

CHUNK_BYTES = 1 << 20

TripHandler = Callable[[bytes, PeerID], Awaitable[bytes]]


class TooLarge(Exception):
    pass


async def _join_chunks(chunks: AsyncIterator, max_bytes: int) -> bytes:
    parts, total = [], 0
    async for chunk in chunks:
        total += len(chunk.metadata)
        if total > max_bytes:
            raise TooLarge(f"message exceeds {max_bytes} bytes")
        parts.append(chunk.metadata)
    return b"".join(parts)


def _split(blob: bytes, message_type) -> list:
    return [message_type(metadata=blob[i : i + CHUNK_BYTES]) for i in range(0, max(len(blob), 1), CHUNK_BYTES)]


class TripServicer(ServicerBase):
    """`rpc_trip`: one boundary message in, the reply (a message or an error) out.

    Receiving is bounded before any decoding: at most `max_receiving` messages are read at once
    (each capped at `max_bytes`), and a sender gets `receive_timeout` seconds to finish sending,
    so slow or parallel senders cannot hold unbounded memory.
    """

    def __init__(
        self,
        on_trip: TripHandler,
        max_bytes: int,
        on_refused: Callable[[ErrorCode], None] = lambda code: None,
        max_receiving: int = 16,
        receive_timeout: float = 30.0,
    ):
        self.on_trip, self.max_bytes, self.on_refused = on_trip, max_bytes, on_refused
        self.receiving = asyncio.Semaphore(max_receiving)
        self.receive_timeout = receive_timeout

    async def _receive(self, requests: AsyncIterator[runtime_pb2.ExpertRequest]) -> bytes:
        if self.receiving.locked():
            raise WireError(ErrorCode.OVERLOADED, "too many messages being received")
        async with self.receiving:
            try:
                return await asyncio.wait_for(_join_chunks(requests, self.max_bytes), self.receive_timeout)
            except TooLarge as exc:
                raise WireError(ErrorCode.TOO_LARGE, str(exc)) from None
            except asyncio.TimeoutError:
                raise WireError(ErrorCode.TIMEOUT, f"message not received within {self.receive_timeout:.0f}s") from None

    async def rpc_trip(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        try:
            blob = await self._receive(requests)
        except WireError as exc:
            self.on_refused(exc.code)
            reply = encode_error(exc.code, exc.message)
        else:
            reply = await self.on_trip(blob, context.remote_id)
        for chunk in _split(reply, runtime_pb2.ExpertResponse):
            yield chunk


async def _as_stream(blob: bytes) -> AsyncIterator[runtime_pb2.ExpertRequest]:
    for chunk in _split(blob, runtime_pb2.ExpertRequest):
        yield chunk


async def send_trip(p2p: P2P, peer: PeerID, namespace: str, blob: bytes, timeout: float, max_reply: int) -> bytes:
    """Send a message and wait for the reply; connection failures and timeouts become WireErrors."""
    stub = TripServicer.get_stub(p2p, peer, namespace=namespace)

    async def exchange() -> bytes:
        replies = await stub.rpc_trip(_as_stream(blob))
        reply = await _join_chunks(replies, max_reply)
        if not reply:
            raise WireError(ErrorCode.UNREACHABLE, f"{peer} closed the stream without a reply")
        return reply

    try:
        return await asyncio.wait_for(exchange(), timeout=timeout)
    except asyncio.TimeoutError:
        raise WireError(ErrorCode.TIMEOUT, f"no reply from {peer} within {timeout:.0f}s") from None
    except TooLarge as exc:
        raise WireError(ErrorCode.TOO_LARGE, f"reply from {peer}: {exc}") from None
    except (asyncio.CancelledError, WireError):
        raise
    except Exception as exc:  # noqa: BLE001 - any transport failure means: try another peer
        raise WireError(ErrorCode.UNREACHABLE, f"call to {peer} failed: {type(exc).__name__}: {exc}") from None
