"""One trip, one hop at a time: what a stage does with a microbatch, on the driver and on every server.

The networked twin of `swarm/simulate.py` `run_trip`: forward through the stage's layers, pass the
boundary message to the next stage and wait for its reply (the compressed input gradient), then
backward and the optimizer step. Where `run_trip` loops over stages in one process, `Hop.hop` is
one stage's turn, and the next stage's turn happens in another peer's `Hop.hop`, reached through
its `next_hop`. The driver (stage 0) starts a trip with `drive`; every other stage runs `serve` on a
message its `TripServer` admitted. `Hop` is the pipeline flavour of a trip; its sibling with context
parallelism is `peer/lane_trip.py` `LaneHop`. Both answer the same questions (`serve`, `drive`, `upstream`,
`tokens_per_trip`) and share the serve envelope (`serve_trip`: decode, the flavour's `turn`, the reply);
which one a served stage gets is picked once, in `peer/trip_flavour.py` `trip_flavour`.

A trip's activations live exactly as long as the coroutine: if the caller goes away libp2p closes
the stream, the coroutine is cancelled and the state is released. Which peer of the next stage gets the
trip, a retry on another one while this hop still holds its activations, the audit duplicates and the
checks of the reply are the next hop's (`peer/next_hop.py` `NextHop`).

Collaborators are explicit: the stage's `runtime` (torch work on its one thread), its `next_hop`
(`peer/next_hop.py`: the router, the link and fresh records are its) and `stats` (the counters the peer
announces).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from peer.next_hop import NextHop
from peer.runtime import StageRuntime
from peer.stats import Stats
from swarm.wire import ErrorCode, Header, WireError, encode_error

logger = logging.getLogger("peer")


@dataclass
class HopResult:
    input_grad: torch.Tensor | None  # None on stage 0: nothing upstream
    loss: float | None
    versions: list[int]  # this hop's U version last
    epochs: list[int]  # the epoch of each hop's weights (`StageOptimizer.weights_epoch`), this hop's last
    sent: int = 0  # bytes of the forward message to the next stage and of its reply
    received: int = 0


Refuse = Callable[[ErrorCode, str, int], bytes]  # a refusal counted and logged by the server, its reply


class Turns(Protocol):
    """What `serve_trip` needs of a trip flavour (`Hop` here, `peer/lane_trip.py` `LaneHop`)."""

    index: int
    runtime: StageRuntime
    stats: Stats
    label: str

    async def turn(self, header: Header, hidden: torch.Tensor, tokens: torch.Tensor, sender: str) -> HopResult:
        """This stage's turn in a trip that arrived."""


async def serve_trip(hop: Turns, blob: bytes, refuse: Refuse, sender: str) -> bytes:
    """The serve envelope both trip flavours share: decode the forward message, `hop.turn`, encode the reply. Every
    failure is a coded error reply (`refuse`: counted and logged by the server), never an exception that could take
    the peer down. `sender` (who sent it) matters to a lane trip only (`peer/lane_trip.py`), which names its
    senders."""
    runtime, index, stats = hop.runtime, hop.index, hop.stats
    try:
        header, hidden, tokens = runtime.codec.decode_forward(blob, stage=index)
    except WireError as exc:
        return refuse(exc.code, exc.message, 0)
    stats.load += 1
    began = time.perf_counter()
    try:
        result = await hop.turn(header, hidden, tokens, sender)
        stats.served.add(time.perf_counter() - began)
        if index:  # stage 0 counts the trips it drives, not the chunks it serves another driver
            stats.trips += 1
            stats.tokens += tokens.numel()
        return runtime.codec.encode_backward(
            result.input_grad,
            header.trip_id,
            to_stage=max(index - 1, 0),  # stage 0 serves only a lane trip's driver (peer/lane_trip.py)
            loss=result.loss,
            extra={"versions": result.versions, "epochs": result.epochs},
        )
    except WireError as exc:
        return refuse(exc.code, exc.message, exc.hops)
    except Exception as exc:  # noqa: BLE001 - a trip must never take the peer down
        logger.exception("%s trip %s failed", hop.label, header.trip_id[:8])
        stats.error(ErrorCode.INTERNAL)
        return encode_error(ErrorCode.INTERNAL, f"{type(exc).__name__}")
    finally:
        stats.load -= 1


class Hop:
    """One stage's turn in every trip through it."""

    def __init__(self, next_hop: NextHop, stats: Stats, label: str):
        """The stage (manifest, index, runtime) is its next hop's: one stage, one `NextHop`."""
        self.manifest, self.index, self.runtime = next_hop.manifest, next_hop.index, next_hop.runtime
        self.next_hop = next_hop
        self.router, self.fetch, self.stats, self.label = next_hop.router, next_hop.fetch, stats, label
        self.tokens_per_trip = next_hop.tokens_per_trip

    # --- the trip ------------------------------------------------------------------------------

    async def drive(self, tokens: torch.Tensor) -> None:
        """Stage 0: one microbatch through the whole pipeline and back; its counters and its U audit."""
        version = self.runtime.stage.subspace.version
        result = await self.hop(None, tokens, version, uuid.uuid4().hex)
        stats = self.stats
        if len(set(result.versions)) == 1:
            stats.trip_versions[version] += 1
        else:
            stats.mixed_trips += 1
            logger.error("%s trip used U versions %s", self.label, result.versions)
        stats.trips += 1
        stats.tokens += tokens.numel()
        stats.bytes_out += result.sent  # a driver's byte counters are its boundary's traffic
        stats.bytes_in += result.received
        if result.loss is not None:
            stats.losses.append(result.loss)
            stats.last_loss = result.loss

    async def serve(self, blob: bytes, refuse: Refuse, sender: str = "") -> bytes:
        """Stages 1…n−1: a forward message in, its backward reply out (`serve_trip`)."""
        return await serve_trip(self, blob, refuse, sender)

    def upstream(self) -> int | None:
        """The stage whose peers may send this stage trips (for stage 1 the drivers); None on stage 0, which drives
        trips and accepts none (`peer/trip_server.py`)."""
        return self.index - 1 if self.index else None

    async def turn(self, header: Header, hidden: torch.Tensor, tokens: torch.Tensor, sender: str) -> HopResult:
        """This stage's turn in a trip that arrived (a lane trip's is `LaneHop.turn`)."""
        # decode checked the version against ours; every later step re-checks it
        return await self.hop(hidden, tokens, header.u_version, header.trip_id)

    async def hop(self, hidden: torch.Tensor | None, tokens: torch.Tensor, version: int, trip_id: str) -> HopResult:
        """This stage's turn: forward, the rest of the pipeline (unless this is the tail), backward, step."""
        runtime = self.runtime
        if runtime.stage.is_tail:
            # the tail waits on nobody: forward, backward and the step in one stage-thread job, so a trip's
            # graph never outlives its job and a burst of trips holds one graph's memory, not one per trip
            def whole() -> tuple[torch.Tensor | None, float | None, int]:
                leaf, output, residual = runtime.forward(hidden, tokens, version)
                epoch = runtime.optimizer.weights_epoch  # the forward's weights: the step may download others
                return *runtime.learn(leaf, output, None, tokens, residual, version), epoch

            input_grad, loss, epoch = await runtime.run(whole)
            return HopResult(input_grad, loss, [version], [epoch])
        leaf, output, residual = await runtime.run(runtime.forward, hidden, tokens, version)
        epoch = runtime.optimizer.weights_epoch  # the weights the forward used
        message = await runtime.run(runtime.encode_forward, version, output, tokens, trip_id, self.index + 1)
        asked = time.perf_counter()
        reply = await self.next_hop.send(message)
        self.stats.reply_wait.add(time.perf_counter() - asked)
        input_grad, _ = await runtime.run(runtime.learn, leaf, output, reply.grad, tokens, residual, version)
        return HopResult(input_grad, reply.loss, reply.versions + [version], reply.epochs + [epoch], len(message),
                         reply.size)
