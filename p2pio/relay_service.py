"""The relay's side of the trip relay (`peer/relay.py` says why it exists and how a trip crosses it;
the tracker's node runs it too, `tracker/relay.py`).

A directly reachable peer with `--relay-service on` carries trips for NATed peers that registered with it:
`RelayService` opens `DELIVER` on the target over the target's own connection, names the sender (as libp2p
authenticated it) and pipes the bytes both ways, `READ_PIECE` at a time, never a whole message, within its
`Budget`: circuits per sender and `MAX_CIRCUITS` in all (`overloaded`), bytes per circuit each way
(`too_large`), seconds per circuit (`timeout`); only registered targets (`unreachable` otherwise). The
stream protocol both sides speak (handler names, the peer-id header) lives here too.

A run's peers speak on `CHANNELS`: trips, and the K/V messages between the lanes of a trip
(`peer/kv_exchange.py`). A circuit stays on the channel it was opened on (`FORWARD` of a channel is
delivered as `DELIVER` of the same channel), so a NATed lane peer gets its K/V through its relay as it gets
its trips; one registration covers both, and the budget is shared.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from contextlib import closing, suppress

from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from p2pio.budget import Budget
from p2pio.framing import CHUNK_BYTES, FRAME_HEADER, FRAME_OVERHEAD, LINGER_BYTES, LINGER_S, READ_PIECE, write_message
from swarm.wire import ErrorCode, WireError, encode_error

logger = logging.getLogger("peer")

FORWARD, DELIVER, REGISTER = "relay.forward", "relay.deliver", "relay.register"
TRIPS, KV = "", ".kv"  # a run's channels, as suffixes of its namespace: trips, and K/V between lanes
CHANNELS = (TRIPS, KV)
MAX_ID_BYTES = 64  # a libp2p peer id (a multihash of the public key) is 34-39 bytes
HEADER_TIMEOUT = 5.0
CONNECT_TIMEOUT = 10.0
REGISTRATION_TTL = 90.0
MAX_REGISTERED = 128
MAX_CIRCUITS = 64
LOG_INTERVAL = 10.0
ACCEPTED, FULL = b"\x00", b"\x01"


def handler(namespace: str, name: str) -> str:
    return f"{namespace}::{name}"


def wire_bound(max_message: int) -> int:
    """Bytes of stream a message of at most `max_message` bytes takes, frames included (as `Frames` reads it)."""
    chunks = -(-max_message // CHUNK_BYTES) + 1
    return max_message + chunks * (FRAME_HEADER + FRAME_OVERHEAD) + FRAME_HEADER


def admit_circuit(
    budget: Budget, open_by_sender: int, open_total: int, target_registered: bool
) -> tuple[ErrorCode, str] | None:
    """Why a relay refuses a new circuit, or None to carry it."""
    if not target_registered:
        return ErrorCode.UNREACHABLE, "relay: the target is not registered here"
    if open_by_sender >= budget.circuits_per_peer:
        return ErrorCode.OVERLOADED, f"relay: {open_by_sender} circuits of this sender open (budget per peer)"
    if open_total >= MAX_CIRCUITS:
        return ErrorCode.OVERLOADED, f"relay: {open_total} circuits open"
    return None


async def write_id(writer: asyncio.StreamWriter, peer: PeerID) -> None:
    raw = peer.to_bytes()
    writer.write(bytes([len(raw)]) + raw)
    await writer.drain()


async def read_id(reader: asyncio.StreamReader) -> PeerID:
    """A peer id as `write_id` wrote it; WireError(malformed) on anything else."""
    try:
        size = (await asyncio.wait_for(reader.readexactly(1), HEADER_TIMEOUT))[0]
        if not 0 < size <= MAX_ID_BYTES:
            raise ValueError(size)
        return PeerID(await asyncio.wait_for(reader.readexactly(size), HEADER_TIMEOUT))
    except (asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as exc:
        raise WireError(ErrorCode.MALFORMED, f"relay header: {type(exc).__name__}") from None


async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, code: ErrorCode, message: str) -> None:
    """A coded error reply, then the rest of the sender's message dropped for up to LINGER_S (as the transport's
    `_linger` does, so the reply is not overtaken by a stream reset)."""
    with suppress(Exception):
        await write_message(writer, encode_error(code, message), runtime_pb2.ExpertResponse, end=False)

        async def drop() -> None:
            left = LINGER_BYTES
            while left > 0 and (piece := await reader.read(READ_PIECE)):
                left -= len(piece)

        await asyncio.wait_for(drop(), LINGER_S)


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, limit: int, count: Callable[[int], None]):
    """Copy until EOF, READ_PIECE at a time; WireError(too_large) past `limit` bytes."""
    moved = 0
    while piece := await reader.read(READ_PIECE):
        moved += len(piece)
        if moved > limit:
            raise WireError(ErrorCode.TOO_LARGE, f"relay: more than {limit} bytes on one circuit")
        writer.write(piece)
        await writer.drain()
        count(len(piece))


class RelayService:
    """Carries trips for registered NATed peers within `budget` (module docstring); counts what it carried."""

    def __init__(self, p2p: P2P, namespace: str, budget: Budget, max_message: int):
        self.p2p, self.namespace = p2p, namespace
        self.budget = Budget(
            budget.circuits_per_peer, min(budget.bytes_per_circuit, wire_bound(max_message)), budget.seconds_per_circuit
        )
        self.registered: dict[str, float] = {}  # peer id -> when its registration expires
        self.open: Counter = Counter()  # sender -> circuits open
        self.circuits = self.bytes_forward = self.bytes_back = 0
        self.refused: Counter = Counter()
        self.heading = 0
        self.logged = (0, 0)

    async def add_handlers(self) -> None:
        await self.p2p.add_binary_stream_handler(handler(self.namespace, REGISTER), self._register)
        for channel in CHANNELS:

            async def forward(info, reader, writer, channel: str = channel) -> None:
                await self._forward(info, reader, writer, channel)

            await self.p2p.add_binary_stream_handler(handler(self.namespace + channel, FORWARD), forward)

    def register(self, peer: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        self.registered = {p: until for p, until in self.registered.items() if until > now}
        if peer not in self.registered and len(self.registered) >= MAX_REGISTERED:
            return False
        self.registered[peer] = now + REGISTRATION_TTL
        return True

    async def _register(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with closing(writer), suppress(Exception):
            accepted = self.register(info.peer_id.to_base58())
            writer.write(ACCEPTED if accepted else FULL)
            await writer.drain()

    async def _forward(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, channel: str) -> None:
        sender = info.peer_id
        with closing(writer):
            if self.heading >= MAX_CIRCUITS:  # streams that have not named their target yet (HEADER_TIMEOUT each)
                self.refused[ErrorCode.OVERLOADED.value] += 1
                return
            self.heading += 1
            try:
                target = await read_id(reader)
            except WireError as exc:
                self.refused[exc.code.value] += 1
                return
            finally:
                self.heading -= 1
            now = time.monotonic()
            registered = self.registered.get(target.to_base58(), 0.0) > now
            refusal = admit_circuit(self.budget, self.open[sender], sum(self.open.values()), registered)
            if refusal is not None:
                self.refused[refusal[0].value] += 1
                await refuse(reader, writer, *refusal)
                return
            self.open[sender] += 1
            try:
                await self._carry(sender, target, reader, writer, channel)
            finally:
                self.open[sender] -= 1
                if self.open[sender] <= 0:
                    del self.open[sender]

    async def _carry(self, sender: PeerID, target: PeerID, reader, writer, channel: str) -> None:
        try:
            opened = self.p2p.call_binary_stream_handler(target, handler(self.namespace + channel, DELIVER))
            _, down, up = await asyncio.wait_for(opened, CONNECT_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - the target's connection is gone: tell the sender
            self.refused[ErrorCode.UNREACHABLE.value] += 1
            await refuse(reader, writer, ErrorCode.UNREACHABLE, f"relay: target not reachable ({type(exc).__name__})")
            return
        back = 0

        def forward(n: int) -> None:
            self.bytes_forward += n

        def backward(n: int) -> None:
            nonlocal back
            back += n
            self.bytes_back += n

        with closing(up):
            limit = self.budget.bytes_per_circuit
            request = asyncio.create_task(self._request(sender, reader, up, limit, forward))
            seconds = self.budget.seconds_per_circuit
            reply = asyncio.create_task(asyncio.wait_for(pump(down, writer, limit, backward), seconds))
            try:
                await asyncio.wait({request, reply}, return_when=asyncio.FIRST_COMPLETED)
                if not reply.done() and isinstance(request.exception(), WireError):
                    reply.cancel()  # the sender's message broke the budget: refuse it here, before the target does
                    exc = request.exception()
                elif not reply.done():
                    # the sender's stream ended before the target's: a sender keeps it open until it has its
                    # reply, so either the reply has come (it is read to its last chunk, before the target closes)
                    # or the sender hung up. Closing the circuit passes a hang-up on: the target stops the trip at
                    # once (`TripServicer._answer`) instead of computing a reply nobody reads
                    exc = None
                    if back:  # the reply was carried
                        self.circuits += 1
                else:
                    exc = None
                    await reply
                    self.circuits += 1
            except asyncio.TimeoutError:
                exc = WireError(ErrorCode.TIMEOUT, "relay: circuit time limit")
            except WireError as error:
                exc = error
            except Exception as error:  # noqa: BLE001 - a broken stream ends the circuit, never the relay
                logger.debug("relay circuit %s -> %s ended: %s", sender, target, error)
                exc = None
            finally:
                for task in (request, reply):
                    task.cancel()
                await asyncio.gather(request, reply, return_exceptions=True)
            if exc is not None:
                self.refused[exc.code.value] += 1
                if back == 0:
                    await refuse(reader, writer, exc.code, exc.message)

    @staticmethod
    async def _request(sender: PeerID, reader, up, limit: int, count: Callable[[int], None]) -> None:
        """The sender's id for the target, then the sender's bytes (WireError past the limit)."""
        await write_id(up, sender)
        await pump(reader, up, limit, count)

    def summary(self) -> str:
        return (
            f"relay: carried {self.circuits} trips for {len(self.registered)} registered peer(s), "
            f"{self.bytes_forward} B forward, {self.bytes_back} B back, refused {dict(self.refused) or 0}"
        )

    async def log_loop(self, label: Callable[[], str], interval: float = LOG_INTERVAL) -> None:
        """One line per interval while anything changed (benchmarks and tests read these counters)."""
        while True:
            await asyncio.sleep(interval)
            now = (self.circuits, sum(self.refused.values()))
            if now != self.logged:
                self.logged = now
                logger.info("%s %s", label(), self.summary())
