"""Moving opaque byte messages between peers over hivemind's libp2p streams.

A boundary message can exceed libp2p's 2 MiB unary limit (dense activations do), so every
message travels as a stream of chunks, and the reply comes back the same way. The receiver
stops reading as soon as a sender goes past its size limit. Both handlers of `TripServicer`
delegate to callbacks; this module knows nothing about stages or tensors.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import AsyncIterator  # hivemind recognises streaming handlers by typing's alias only

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from swarm.wire import ErrorCode, WireError, encode_error

CHUNK_BYTES = 1 << 20

TripHandler = Callable[[bytes, PeerID], Awaitable[bytes]]
InfoHandler = Callable[[], dict]


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
    """`rpc_trip`: one boundary message in, the reply (a message or an error) out. `rpc_info`: a ping."""

    def __init__(
        self,
        on_trip: TripHandler,
        on_info: InfoHandler,
        max_bytes: int,
        on_refused: Callable[[ErrorCode], None] = lambda code: None,
    ):
        self.on_trip, self.on_info, self.max_bytes, self.on_refused = on_trip, on_info, max_bytes, on_refused

    async def rpc_trip(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        try:
            blob = await _join_chunks(requests, self.max_bytes)
        except TooLarge as exc:
            self.on_refused(ErrorCode.TOO_LARGE)
            reply = encode_error(ErrorCode.TOO_LARGE, str(exc))
        else:
            reply = await self.on_trip(blob, context.remote_id)
        for chunk in _split(reply, runtime_pb2.ExpertResponse):
            yield chunk

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        return runtime_pb2.ExpertInfo(serialized_info=json.dumps(self.on_info()).encode())


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


async def ping(p2p: P2P, peer: PeerID, namespace: str, timeout: float = 5.0) -> dict:
    stub = TripServicer.get_stub(p2p, peer, namespace=namespace)
    reply = await stub.rpc_info(runtime_pb2.ExpertUID(uid="info"), timeout=timeout)
    return json.loads(reply.serialized_info)
