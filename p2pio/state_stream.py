"""Reading a peer's state stream (hivemind's `rpc_download_state`) within bounds a hostile donor cannot stretch.

hivemind's own download (`DecentralizedAverager._load_state_from_peers`) deserializes whatever a donor streams:
the dtype and size each tensor names are allocated before anything is checked (`U100000000`, `complex128`, 2^60
elements), and the metadata is unpickled however large. Both readers of another peer's state, a joining peer
(`peer/state_load.py`) and the exporter (`dhtio/state_download.py`), read it here instead: each tensor's first
part must name the dtype and shape the reader expects, uncompressed, before its bytes are kept; every message's
protobuf bytes count against the expected total; metadata comes once, small, with an epoch. The reader's time
is bounded like a trip stream's: a grace plus the expected bytes at a minimum rate (`StateStream.budget`), and
no pause between two messages longer than one part takes at that rate (`IDLE_S`) once the first arrived.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import torch
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from p2pio.framing import GRACE_S, MIN_RATE
from swarm.export import one_line
from swarm.live_state import LiveStateError

MAX_METADATA = 64 << 10  # the state's metadata: epoch and a few optimizer scalars, msgpacked
PART_ALLOWANCE = 128 << 10  # protobuf bytes a tensor may take beyond its values (one part of the next tensor)
IDLE_S = GRACE_S + (2 << 20) / MIN_RATE  # the longest pause between two messages: one 2 MiB part at MIN_RATE


class StateStream:
    """Reads the tensors at the head of a donor's state stream, refusing anything an honest peer does not send.

    An honest peer streams each tensor as hivemind serializes it uncompressed: a first part naming its dtype,
    compression NONE and its size, then parts holding only more bytes. `shapes` (and `dtypes`, float32 where not
    given) are what the reader expects, in order; tensors after them are not read. Anything else (another dtype
    or compression, another size, more bytes than the shape holds, a second metadata, more protobuf bytes in all
    than the tensors plus `PART_ALLOWANCE` each) is refused before it is kept."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[str] | None = None):
        self.shapes = [tuple(s) for s in shapes]
        self.dtypes = list(dtypes) if dtypes is not None else ["float32"] * len(self.shapes)
        if len(self.dtypes) != len(self.shapes):
            raise ValueError("one dtype per shape")
        self.sizes = [torch.Size(s).numel() * torch.empty((), dtype=getattr(torch, d)).element_size()
                      for s, d in zip(self.shapes, self.dtypes, strict=True)]
        self.tensors: list[torch.Tensor] = []
        self.metadata: dict | None = None
        self.buffer: bytearray | None = None  # the tensor being received
        self.received = 0
        self.limit = sum(self.sizes) + PART_ALLOWANCE * len(self.shapes) + MAX_METADATA

    @property
    def budget(self) -> float:
        """Seconds a donor gets to send the tensors: the grace and minimum rate a peer's trip streams get."""
        return GRACE_S + sum(self.sizes) / MIN_RATE

    @property
    def epoch(self) -> int | None:
        return None if self.metadata is None else self.metadata["epoch"]

    @property
    def done(self) -> bool:
        return len(self.tensors) == len(self.shapes)

    def feed(self, message: averaging_pb2.DownloadData) -> None:
        self.received += message.ByteSize()
        if self.received > self.limit:
            raise LiveStateError(f"the state stream sent more than its tensors' {self.limit} bytes")
        if message.metadata:
            if self.metadata is not None or len(message.metadata) > MAX_METADATA:
                raise LiveStateError("the state stream sent its metadata twice, or too much of it")
            metadata = MSGPackSerializer.loads(message.metadata)
            value = metadata.get("epoch") if isinstance(metadata, dict) else None
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise LiveStateError("the state's metadata names no epoch")
            self.metadata = metadata
        part = message.tensor_part
        if part.dtype:  # the first part of a tensor
            self._close_tensor()
            if self.done:
                return  # a tensor after those expected: not read
            at = len(self.tensors)
            known = part.compression in runtime_pb2.CompressionType.values()  # an open enum: any number parses
            codec = runtime_pb2.CompressionType.Name(part.compression) if known else str(part.compression)
            if part.dtype != self.dtypes[at] or codec != "NONE" or tuple(part.size) != self.shapes[at]:
                raise LiveStateError(
                    f"tensor {at} came as {part.dtype} {tuple(part.size)} ({codec}), expected "
                    f"{self.dtypes[at]} {self.shapes[at]} uncompressed"
                )
            self.buffer = bytearray()
        elif self.buffer is None:
            if not part.buffer:
                return
            raise LiveStateError("the state stream sent bytes before naming their tensor")
        self.buffer += part.buffer
        if len(self.buffer) > self.sizes[len(self.tensors)]:
            raise LiveStateError(f"tensor {len(self.tensors)} is larger than its shape allows")

    def end(self) -> tuple[int, list[torch.Tensor]]:
        """(the epoch, the tensors) once the stream stopped (read through the tensors expected, or ended)."""
        if not self.done:
            self._close_tensor()
        if self.metadata is None or not self.done:
            raise LiveStateError(f"the state ended after {len(self.tensors)} of {len(self.shapes)} tensors")
        return self.metadata["epoch"], self.tensors

    def _close_tensor(self) -> None:
        """Close the tensor being received (at the next tensor's first part, or at the end of the stream)."""
        if self.buffer is None:
            return
        at = len(self.tensors)
        if len(self.buffer) != self.sizes[at]:
            raise LiveStateError(f"tensor {at} ended after {len(self.buffer)} bytes")
        dtype = getattr(torch, self.dtypes[at])
        self.tensors.append(torch.frombuffer(self.buffer, dtype=dtype).reshape(self.shapes[at]) if self.sizes[at]
                            else torch.empty(self.shapes[at], dtype=dtype))
        self.buffer = None


async def read_state(
    open_stream: Callable[[], Awaitable[AsyncIterator[averaging_pb2.DownloadData]]],
    reader: StateStream,
    timeout: float,
) -> tuple[int, list[torch.Tensor]]:
    """(the donor's epoch, its tensors) from the stream `open_stream` opens, within `timeout` seconds; every
    failure, the donor's or the network's, is a LiveStateError."""
    stream = None
    try:
        async with asyncio.timeout(timeout):
            stream = await open_stream()
            while not reader.done:
                try:  # once it started, a donor that stops sending is dropped, not at the end of its budget (its
                    # first message may wait for an averaging round to end: hivemind copies the state after it)
                    message = await asyncio.wait_for(anext(stream), IDLE_S if reader.received else None)
                except StopAsyncIteration:
                    break
                reader.feed(message)
            return reader.end()
    except LiveStateError:
        raise
    except TimeoutError:
        raise LiveStateError(f"the state did not arrive within {timeout:.0f}s, or paused {IDLE_S:.0f}s") from None
    except Exception as exc:  # noqa: BLE001 - the network's or the donor's failures alike: the next donor is asked
        raise LiveStateError(one_line(exc)) from None
    finally:
        if stream is not None and hasattr(stream, "aclose"):
            await stream.aclose()
