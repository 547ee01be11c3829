"""A context-parallel trip (issue 17): lane c of every stage carries chunk c of the sequence, exchanging K/V.

With `context_parallel.size` P > 1 a trip is a row of P lane trips. The driver (any stage-0 peer, see
`LaneHop.drive`) fixes the trip's *group* when it starts: one peer per lane of every stage
(`peer/lanes.py` `pick_group`). It serves its own lane itself and sends every other lane's chunk to that
lane's stage-0 peer; lane c of stage s hands its boundary message to the group's lane-c peer of stage s+1
and waits for its reply, like a pipeline `Hop` (`peer/trip.py`, its sibling: both serve through `serve_trip`),
while every layer's K/V crosses between the lanes of the stage (`peer/kv_exchange.py`, computed by
`swarm.cp_lane.LaneTrip`). A lane sends a layer's K/V (and backward its gradients) without waiting for the
receivers' ACKs before the next layer (`_Sends`); the trip awaits them all before its step.

Every boundary message of a lane trip carries its claim (`peer/lane_claim.py`: the group, the chunk's place, and
on an audited trip the audit fork, the lane trips' equivalent of a pipeline hop's duplicate), checked before any
compute. The driver forks a trip at `pick_audit`'s rate; the lanes of the stage before the fork send both
messages through `NextHop.ask`, which compares the replies and believes only a trusted peer's loss.

A lane's parameter gradients stay in its `LaneTrip` until the trip's last backward here; they are then
applied, checked and stepped in one stage-thread job (`StageRuntime.learn_lane`). A failure before that
(a K/V timeout, a refusal, a lane's peer gone) closes the exchange and drops the lane's gradients: the
trip fails on this lane, and the driver runs the whole trip again with a new id and another group.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid

import torch
from hivemind.p2p import PeerID

from peer.admission import StagePeers
from peer.audit import LANE_AUDIT_RATE
from peer.kv_exchange import KVService, LaneExchange, message_limit
from peer.lane_claim import Fork, Group, LaneClaim, new_fork, read_claim, split_claims
from peer.lanes import EmptyLane, Strikes, pick_audit, pick_group
from peer.link import Link
from peer.next_hop import NextHop
from peer.stats import Stats
from peer.trip import HopResult, Refuse, serve_trip
from swarm.context_parallel import CPBasis
from swarm.cp_lane import LaneTrip
from swarm.cp_modes import DENSE_KV
from swarm.cp_wire import CPCodec
from swarm.fingerprint import weights_version
from swarm.manifest import Manifest
from swarm.wire import ErrorCode, Header, WireError

logger = logging.getLogger("peer")

GROUP_ATTEMPTS = 3  # groups tried for one trip before it is dropped


def lane_codec(manifest: Manifest, stage) -> CPCodec:
    """The K/V codec of `stage` (a `PipelineStage` with context parallelism) for this run's microbatches."""
    spec = manifest.context_parallel
    batch = manifest.batch
    layers = manifest.layers_of(stage.index)
    return CPCodec(spec, manifest.model, batch.seq_len, batch.microbatch_size, manifest.run_id, stage.cp_basis,
                   stage.index, layers)


def largest_kv_message(manifest: Manifest) -> int:
    """The transport's bound for K/V messages of this run: the larger of its compressed and dense ones (peers send
    the spec's mode only, and run no dense warm-up: `peer/cli.py` refuses a manifest that asks for one)."""
    spec, shape, batch = manifest.context_parallel, manifest.model, manifest.batch
    codec = CPCodec(spec, shape, batch.seq_len, batch.microbatch_size, manifest.run_id,
                    CPBasis.for_spec(spec, shape, manifest.seed))
    return max(message_limit(codec, 0, mode) for mode in (spec.mode, DENSE_KV))


async def _cancel_all(tasks) -> None:
    """Cancel the tasks and wait until each has ended, whatever it raised (none is left running or unretrieved)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _together(*awaitables) -> list:
    """Run awaitables at once; the first failure cancels the others (no orphan keeps a K/V exchange busy)."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        await _cancel_all(tasks)
        raise


async def _own(exchanging) -> None:
    """A failure of this lane's K/V exchange is this hop's (hops 0): `hops` counts along the lane's chain of
    stages, and a refusal by a lane peer of the same stage is not one hop down it."""
    try:
        await exchanging
    except WireError as exc:
        raise WireError(exc.code, exc.message) from None


class _Sends:
    """One lane trip's K/V sends in flight (issue 27). A receiver needs a message's one-way trip, the sender
    nothing back: waiting for each layer's ACK before the next layer's compute cost a round trip per layer and
    direction. Each layer sends at most once per direction, so a trip holds at most 2 × its layers' sends (and
    their tensors). A failed send fails the trip as soon as a wait of the trip sees it (`watch`), as when every
    send was awaited; `settle` awaits them all before the step touches weights, and `cancel` leaves no task
    behind the exchange's close."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Future] = []
        self.failed = asyncio.Event()

    def start(self, send) -> None:
        task = asyncio.ensure_future(send)
        task.add_done_callback(self._done)
        self.tasks.append(task)

    def _done(self, task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.failed.set()

    async def watch(self, waiting):
        """`waiting`'s result, unless a send fails first: then that failure (the wait cancelled)."""
        tasks = asyncio.ensure_future(waiting), asyncio.ensure_future(self.failed.wait())
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await _cancel_all(tasks)
        if self.failed.is_set():
            await self.settle()
        return tasks[0].result()

    async def settle(self) -> None:
        """Every send done; the first failure is raised, the others cancelled."""
        await _together(*self.tasks)

    async def cancel(self) -> None:
        await _cancel_all(self.tasks)


class LaneHop:
    """This peer's lane `lane` of stage `index` in every lane trip through it (`serve`), and, on stage 0, the
    driver of whole trips (`drive`). The next hop is the group's, not the router's: a trip never changes
    peers midway (its K/V would go stale); the driver runs it again with another group instead. A sibling of
    `peer/trip.py` `Hop` over the same `StageRuntime`, `NextHop` and serve envelope (`serve_trip`)."""

    def __init__(
        self, next_hop: NextHop, stats: Stats, label: str, *, lane: int, kv: KVService, peer_id: str,
        kv_link: Link | None = None,
    ):
        """The stage (manifest, index, runtime) is its next hop's, as a pipeline `Hop`'s."""
        self.manifest, self.index, self.runtime = next_hop.manifest, next_hop.index, next_hop.runtime
        self.next_hop = next_hop
        self.router, self.fetch, self.stats, self.label = next_hop.router, next_hop.fetch, stats, label
        self.tokens_per_trip = next_hop.tokens_per_trip
        self.lane, self.kv, self.peer_id = lane, kv, peer_id
        self.kv_link = kv_link  # K/V to the group's lane peers, through their relays (None: straight)
        self.lanes = self.manifest.lanes
        self.strikes = Strikes()  # groups that failed, per peer: `pick` prefers peers with fewer
        self.stage_peers = StagePeers()  # who may send this lane K/V (`admit_kv_sender`)
        # the driver cannot see which lane peers its partners have verified, so it forks at a fixed rate (raised
        # by --audit-rate), not on every trip with an unverified peer as a pipeline hop duplicates
        self.audit_rate = max(LANE_AUDIT_RATE, self.router.ledger.audit_rate)
        self.audit_rng = random.Random()

    # --- serving one lane -----------------------------------------------------------------------------

    def admit_kv_sender(self, peer: PeerID) -> ErrorCode | None:
        """K/V messages come only from peers with a live record at this stage (the other lanes of its trips),
        asked before a stream is read: ids merged from the router's reads and kept until their records expire
        (`peer/admission.py`), so strangers, fresh identities included, get no receive slot. A miss asks for a
        re-read, so a lane partner that announced after this peer's last read is admitted on its next trip."""
        entries = self.router.stages.get(self.index, [])
        if self.stage_peers.admits(self.index, self.index, entries, peer.to_base58(), self.fetch, self.label):
            return None
        return ErrorCode.UNKNOWN_SENDER

    async def serve(self, blob: bytes, refuse: Refuse, sender: str = "") -> bytes:
        """A chunk's forward message in (every stage, stage 0 from the trip's driver), its backward reply out."""
        return await serve_trip(self, blob, refuse, sender)

    def upstream(self) -> int:
        """The stage whose peers may send this lane trips: the stage before, and on stage 0 stage 0 itself (the
        trip's driver is a stage-0 peer handing this lane its chunk)."""
        return max(self.index - 1, 0)

    async def turn(self, header: Header, hidden: torch.Tensor, tokens: torch.Tensor, sender: str) -> HopResult:
        """A chunk's forward message (from the group's previous stage of this lane, or from the driver on stage 0):
        its claim checked before any compute, then this lane's turn. Stage 0 sends the driver no gradient: zeros
        keep the reply's format."""
        claim = read_claim(header.extra, self.manifest, self.index, self.lane, self.peer_id, sender,
                           tuple(tokens.shape))
        head = self.runtime.stage.is_head
        result = await self.lane_hop(claim, None if head else hidden, tokens, header.u_version, header.trip_id)
        if head:
            result.input_grad = torch.zeros(*tokens.shape, self.manifest.model.d_model)
        return result

    async def lane_hop(
        self, claim: LaneClaim, hidden: torch.Tensor | None, tokens: torch.Tensor, version: int, trip_id: str
    ) -> HopResult:
        """This lane's turn: the layers with the exchange, the next stage's lane (or the loss), the layers'
        backward with the exchange, then the gradients applied and the step in one job."""
        runtime = self.runtime
        exchange = await self.kv.open(trip_id, claim.group[self.index], link=self.kv_link)
        sends = _Sends()
        try:
            lane, weights = await runtime.run(self._start, claim.lane, tokens, hidden, version)
            epoch = runtime.optimizer.weights_epoch  # the weights the lane's forward uses
            await _own(self._forward(lane, exchange, sends))
            sent = received = 0
            residual = out_grad = None
            if runtime.stage.is_tail:
                nxt = None if claim.next_tokens is None else torch.tensor(claim.next_tokens)
                loss, weights_after = await runtime.run(self._loss, lane, nxt, claim.seq_len)
                logger.debug("%s lane trip %s lane %d: loss %.4f, weights changed %d times in its forward (epoch %d "
                             "to %d), K/V with %s", self.label, trip_id[-8:], claim.lane, loss, weights_after - weights,
                             epoch, runtime.optimizer.weights_epoch,
                             " ".join(p[-6:] for p in claim.group[self.index]))
                versions, epochs = [version], [epoch]
            else:
                output, residual = await runtime.run(lane.output)
                onward = claim.onward(self.index)  # the audited stage cannot tell a forked trip
                message = await runtime.run(self._encode, version, output, tokens, trip_id, onward)
                fork, duplicate = claim.forked(self.index), None
                if fork is not None:  # the driver audits the next stage on this trip
                    fork_claim, fork_id = fork
                    blob = await runtime.run(self._encode, version, output, tokens, fork_id, fork_claim)
                    duplicate = (fork_claim.group[self.index + 1][claim.lane], blob)
                asked = time.perf_counter()
                reply = await self.next_hop.ask(claim.group[self.index + 1][claim.lane], message, duplicate)
                self.stats.reply_wait.add(time.perf_counter() - asked)
                await runtime.run(lane.backward_output, reply.grad)
                loss, versions, out_grad = reply.loss, reply.versions + [version], reply.grad
                epochs = reply.epochs + [epoch]
                sent, received = len(message), reply.size
            await _own(self._backward(lane, exchange, sends))
            await _own(sends.settle())
            input_grad = await runtime.run(runtime.learn_lane, lane, tokens, residual, out_grad, version)
            self.stats.kv_bytes += exchange.bytes_out
            self.stats.kv_tokens += tokens.numel()
            return HopResult(input_grad, loss, versions, epochs, sent, received)
        finally:
            try:
                await sends.cancel()
            finally:
                exchange.close()

    def _start(self, lane: int, tokens: torch.Tensor, hidden: torch.Tensor | None, version: int
               ) -> tuple[LaneTrip, int]:
        """The lane's trip, and the weights' version it starts from (`_weights_version`)."""
        self.runtime.check_version(version)
        device, stage = self.runtime.device, self.runtime.stage
        trip = LaneTrip(stage, lane, tokens.to(device), None if hidden is None else hidden.to(device))
        return trip, self._weights_version()

    def _loss(self, lane: LaneTrip, next_tokens: torch.Tensor | None, seq_len: int) -> tuple[float, int]:
        return lane.loss(next_tokens, seq_len), self._weights_version()

    def _weights_version(self) -> int:
        """How many times the stage's weights changed in place (`weights_version`), read only for the tail's DEBUG
        line on weights that change under a lane's forward (benchmarks/audit_pairs.py); 0 otherwise."""
        if not logger.isEnabledFor(logging.DEBUG):
            return 0
        return weights_version(list(self.runtime.stage.parameters()))

    async def _forward(self, lane: LaneTrip, exchange: LaneExchange, sends: _Sends) -> None:
        run = self.runtime.run
        for layer in lane.order:
            payload = await run(lane.payload, layer)
            if payload is not None:
                sends.start(exchange.send_forward(layer, *payload))
            received = await self._kv_wait(sends, exchange.receive_forward(layer))
            await run(lane.complete, layer, received)

    async def _backward(self, lane: LaneTrip, exchange: LaneExchange, sends: _Sends) -> None:
        for layer in reversed(lane.order):
            grads = await self._kv_wait(sends, exchange.receive_backward(layer))
            back = await self.runtime.run(lane.backward_layer, layer, grads)
            sends.start(exchange.send_backward(layer, back))

    async def _kv_wait(self, sends: _Sends, receiving):
        """The other lanes' K/V of one layer (`_Sends.watch`), the wait counted (`Stats.kv_wait`)."""
        began = time.perf_counter()
        try:
            return await sends.watch(receiving)
        finally:
            self.stats.kv_wait.add(time.perf_counter() - began)

    def _encode(self, version: int, output, tokens, trip_id: str, claim: LaneClaim) -> bytes:
        self.runtime.check_version(version)
        return self.runtime.codec.encode_forward(output, tokens, trip_id, self.index + 1, extra=claim.extra())

    # --- driving whole trips (stage 0) -----------------------------------------------------------------

    def pick(self) -> tuple[Group, Fork | None]:
        """One peer per lane of every stage, this peer at its own lane of stage 0 (NO_PEER for an empty lane), and
        the trip's audit fork, if it gets one (`pick_audit`, at `audit_rate`)."""
        now, groups = time.monotonic(), []
        listed = {e.record.peer_id for entries in self.router.stages.values() for e in entries}
        strikes = self.strikes.current(listed, now)
        for stage in range(self.manifest.num_stages):
            taken = {self.lane: self.peer_id} if stage == self.index else None
            group = pick_group(self.router, stage, self.lanes, now, taken, strikes)
            if isinstance(group, EmptyLane):
                raise WireError(ErrorCode.NO_PEER, str(group))
            groups.append(group.peers)
        audit = pick_audit(self.router, groups, self.audit_rate, self.audit_rng, now, strikes)
        return tuple(groups), None if audit is None else new_fork(*audit)

    async def drive(self, tokens: torch.Tensor) -> None:
        """Stage 0: one microbatch as P lane trips, run again with another group (`pick` prefers peers with fewer
        strikes) while a lane fails; the trip's loss is the sum of the lanes' losses."""
        failure: BaseException | None = None
        for _ in range(GROUP_ATTEMPTS):
            try:
                group, audit = self.pick()
            except WireError:
                self.router.update(await self.fetch())
                group, audit = self.pick()
            try:
                return await self.drive_group(tokens, group, audit)
            except WireError as exc:
                failure = exc
        raise failure if failure is not None else WireError(ErrorCode.NO_PEER, "no group")

    async def drive_group(
        self, tokens: torch.Tensor, group: Group, audit: Fork | None = None
    ) -> None:
        """One trip over `group` (and its audit fork, if any: the fork's replies are only compared, by the lanes
        of the stage before it); on any lane's failure the other lanes are cancelled (their exchanges close), the
        group's peers get a strike each, and the first failure is raised."""
        version, trip_id = self.runtime.stage.subspace.version, uuid.uuid4().hex
        tasks = []
        for claim, chunk in split_claims(tokens, group, audit):
            if claim.lane == self.lane:
                tasks.append(asyncio.ensure_future(self.lane_hop(claim, None, chunk, version, trip_id)))
            else:
                tasks.append(asyncio.ensure_future(self._remote(claim, chunk, trip_id)))
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        await _cancel_all(pending)
        errors = {c: t.exception() for c, t in enumerate(tasks) if t in done and t.exception() is not None}
        if errors:
            # which peer stalled the others cannot always be told (a lane peer that refuses or vanishes fails the
            # lanes that exchange K/V with it, and their refusals name them): every peer of the group gets a strike
            self.strikes.strike((peer for peers in group for peer in peers if peer != self.peer_id), time.monotonic())
            for c, exc in errors.items():
                if isinstance(exc, WireError):
                    self.stats.error(exc.code)
                logger.warning("%s lane %d of trip %s failed: %s", self.label, c, trip_id[:8], exc)
            raise next(iter(errors.values()))
        results = [t.result() for t in tasks]
        self.strikes.clear(peer for peers in group for peer in peers)
        self._count(results, tokens, version)

    async def _remote(self, claim: LaneClaim, chunk: torch.Tensor, trip_id: str) -> HopResult:
        """A lane's chunk to the group's stage-0 peer of that lane, its loss and versions back."""
        message = await self.runtime.run(self._encode_start, chunk, trip_id, claim)
        reply = await self.next_hop.hand(claim.group[0][claim.lane], message)
        return HopResult(None, reply.loss, reply.versions, reply.epochs, len(message), reply.size)

    def _encode_start(self, chunk: torch.Tensor, trip_id: str, claim: LaneClaim) -> bytes:
        """A stage-0 lane needs only its tokens: the message's residual is T_fixed (zero once compressed)."""
        anchor = self.runtime.stage.subspace.t_fixed[chunk.to(self.runtime.device)]
        return self.runtime.codec.encode_forward(anchor, chunk, trip_id, 0, extra=claim.extra())

    def _count(self, results: list[HopResult], tokens: torch.Tensor, version: int) -> None:
        stats = self.stats
        stats.trips += 1
        stats.tokens += tokens.numel()
        stats.trip_versions[version] += 1
        stats.bytes_out += sum(r.sent for r in results)
        stats.bytes_in += sum(r.received for r in results)
        losses = [r.loss for r in results]
        if all(loss is not None for loss in losses):
            stats.losses.append(sum(losses))
            stats.last_loss = stats.losses[-1]
