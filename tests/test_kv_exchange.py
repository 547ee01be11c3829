"""K/V messages between the lanes of a trip (issue 17): `peer/kv_exchange.py` over real hivemind P2P
daemons on loopback (three lane peers and an intruder, on one event loop), its early-message buffer, and a lane
trip's sends in flight (issue 27, `peer/lane_trip.py` `_Sends`: `LaneHop._forward` of real `LaneTrip`s; no
wall-clock budget is asserted, only what had happened when)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import time
import tracemalloc
import uuid
from types import SimpleNamespace

import pytest
import torch
from hivemind.p2p import P2P

from peer.kv_early import BufferLimits, EarlyBuffer, EarlyMessage
from peer.kv_exchange import KVService, message_limit
from peer.lane_trip import LaneHop, _Sends
from peer.stats import Stats
from swarm.context_parallel import ContextParallelSpec, CPBasis
from swarm.cp_lane import LaneTrip
from swarm.cp_model import CPDecoder
from swarm.cp_wire import CPCodec, encode_kv, parse_kv_header, wire_step
from swarm.manifest import ModelShape
from swarm.wire import ErrorCode, WireError

SHAPE = ModelShape(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, vocab_size=256, max_seq_len=64)
SPEC = ContextParallelSpec(size=3, compression="subspace", theta_max=0.5)
SEQ, BATCH, LAYERS = 24, 2, 2
STUCK = 60.0  # how long a test waits for what must happen before it calls it stuck (old code: forever)


def make_codec(run_id: str = "run-kv") -> CPCodec:
    return CPCodec(SPEC, SHAPE, SEQ, BATCH, run_id, CPBasis.for_spec(SPEC, SHAPE, seed=5))


def payload(seed: int, kind: str = "forward"):
    generator = torch.Generator().manual_seed(seed)
    n = SEQ // SPEC.size
    z_k, z_v = (
        torch.randn(BATCH, n, SPEC.r_k, generator=generator),
        torch.randn(BATCH, n, SPEC.r_v, generator=generator),
    )
    theta = (torch.rand(BATCH, SPEC.n_theta, generator=generator) - 0.5) * (SPEC.theta_max if kind == "forward" else 3)
    return z_k, z_v, theta


def on_wire(tensors):
    """What a receiver decodes: Z in bf16, θ in float32."""
    z_k, z_v, theta = tensors
    return z_k.bfloat16().float(), z_v.bfloat16().float(), theta


def same(got, want) -> bool:
    return all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


class Net:
    """Three lane peers (lanes 0, 1, 2 of stage 0) and an intruder on loopback, each with a KVService."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.p2ps: list[P2P] = []
        self.services: list[KVService] = []

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)

    async def start(self) -> None:
        codec = make_codec()
        maddrs = []
        for lane in range(4):  # every daemon dials all earlier ones: each pair is connected
            p2p = await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
            maddrs += await p2p.get_visible_maddrs()
            service = KVService(p2p, "run-kv", message_limit(codec, lane % 3, SPEC.mode))
            service.serve(codec, lane % 3)
            await service.start()
            self.p2ps.append(p2p)
            self.services.append(service)

    async def stop(self) -> None:
        for service, p2p in zip(self.services, self.p2ps, strict=True):
            await service.stop()
            await p2p.shutdown()

    @property
    def lanes(self) -> list[KVService]:
        return self.services[:3]

    @property
    def intruder(self) -> KVService:
        return self.services[3]

    @property
    def group(self):
        return [p2p.peer_id for p2p in self.p2ps[:3]]


@pytest.fixture(scope="module")
def net():
    loop = asyncio.new_event_loop()
    running = Net(loop)
    running.run(running.start())
    yield running
    running.run(running.stop())
    loop.close()


def trip_id() -> str:
    return uuid.uuid4().hex


def message(trip: str, src: int = 0, dst: int = 1, layer: int = 0, codec: CPCodec | None = None, **changes) -> bytes:
    codec = codec or make_codec()
    header = codec.header("forward", layer, src, src, dst, BATCH, SPEC.mode, trip)
    return encode_kv(dataclasses.replace(header, **changes), *payload(src))


async def refusal(service: KVService, peer, blob: bytes) -> ErrorCode | None:
    """The code `peer` refused `blob` with, None if it took it. A send that came back `unreachable` (no answer at
    all: once in CI, on a loaded machine, where `overloaded` was due) is sent once more, its reason printed: these
    tests check what a receiver answers, not that loopback daemons never drop a stream."""

    async def send() -> WireError | None:
        try:
            await service.send(peer, blob)
        except WireError as exc:
            return exc
        return None

    failure = await send()
    if failure is not None and failure.code is ErrorCode.UNREACHABLE:
        print(f"sent once more after: {failure.message}")
        await asyncio.sleep(0.5)
        failure = await send()
    return None if failure is None else failure.code


def test_forward_and_backward_between_three_lanes_are_bit_exact(net):
    async def body():
        trip, before_out = trip_id(), [s.bytes_out for s in net.lanes]
        lanes = [await service.open(trip, net.group) for service in net.lanes]
        sent = {lane: payload(lane) for lane in range(3)}
        await asyncio.gather(*(lanes[c].send_forward(1, *sent[c]) for c in range(3)))
        assert await lanes[0].receive_forward(1) == {}
        got1, got2 = await lanes[1].receive_forward(1), await lanes[2].receive_forward(1)
        assert set(got1) == {0} and same(got1[0], on_wire(sent[0]))
        assert set(got2) == {0, 1} and same(got2[0], on_wire(sent[0])) and same(got2[1], on_wire(sent[1]))

        grads = {(c, j): payload(10 * c + j, "backward") for c in range(3) for j in range(c)}
        await asyncio.gather(*(lanes[c].send_backward(1, {j: grads[c, j] for j in range(c)}) for c in range(3)))
        for c in range(3):
            got = await lanes[c].receive_backward(1)
            assert set(got) == set(range(c + 1, 3)) and all(same(got[d], on_wire(grads[d, c])) for d in got)

        # what left one lane arrived at another, message for message, and the services counted it
        assert sum(x.bytes_out for x in lanes) == sum(x.bytes_in for x in lanes) > 0
        assert [s.bytes_out - b for s, b in zip(net.lanes, before_out, strict=True)] == [x.bytes_out for x in lanes]
        forward = len(message(trip))
        assert lanes[0].bytes_out == 2 * forward and lanes[2].bytes_in == 2 * forward  # lane 2 gets no backward
        for exchange in lanes:
            exchange.close()

    net.run(body())


def test_lanes_train_through_the_exchange_as_in_one_process(net):
    """Three `LaneTrip`s of one model, each on its own peer, with every K/V message over libp2p, compute
    bit for bit what `wire_step` computes in one process (same messages, same rounding, same sums)."""
    model, n = CPDecoder(SHAPE, SPEC, seed=5), SEQ // SPEC.size
    with torch.no_grad():  # θ heads start at zero; give them weight so θ is not all zeros
        for block in model.layers:
            block.attn.theta_head.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(block.attn.layer))
    twin = copy.deepcopy(model)
    tokens = torch.randint(0, SHAPE.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))

    async def run_lane(c: int, exchange) -> tuple[LaneTrip, float]:
        lane = LaneTrip(model, c, tokens[:, c * n : (c + 1) * n])
        for layer in lane.order:  # the sends' acks need not come before the earlier lanes' K/V
            payload = lane.payload(layer)
            sending = exchange.send_forward(layer, *payload) if payload is not None else asyncio.sleep(0)
            _, received = await asyncio.gather(sending, exchange.receive_forward(layer))
            lane.complete(layer, received)
        loss = lane.loss(tokens[:, (c + 1) * n] if c < SPEC.size - 1 else None, SEQ)
        for layer in reversed(lane.order):
            await exchange.send_backward(layer, lane.backward_layer(layer, await exchange.receive_backward(layer)))
        return lane, loss

    async def body():
        trip = trip_id()
        exchanges = [await s.open(trip, net.group) for s in net.lanes]
        done = await asyncio.gather(*(run_lane(c, x) for c, x in enumerate(exchanges)))
        for exchange in exchanges:
            exchange.close()
        return done, sum(x.bytes_out for x in exchanges), len(trip)

    done, wire_bytes, id_length = net.run(body())
    for lane, _ in done:  # in lane order, as wire_step adds them
        lane.input_grad()
        lane.apply_grads()
    want, sent = wire_step(twin, tokens, make_codec())
    assert sum(loss for _, loss in done) == want
    for (name, got), expected in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert got.grad is not None and torch.equal(got.grad, expected.grad), name
    messages = LAYERS * 2 * 3  # per layer 3 forward (0→1, 0→2, 1→2) and 3 backward; wire_step's trip id is ""
    assert wire_bytes == sum(sent["forward"]) + sum(sent["backward"]) + messages * id_length


def test_early_messages_are_delivered_when_the_trip_registers(net):
    async def body():
        trip = trip_id()
        first = await net.lanes[0].open(trip, net.group)
        await first.send_forward(0, *payload(0))  # lanes 1 and 2 have not registered the trip yet
        assert all(len(s.early.held(trip)) == 1 for s in net.lanes[1:])
        later = [await s.open(trip, [p.to_base58() for p in net.group]) for s in net.lanes[1:]]  # ids as text
        assert all(not s.early.held(trip) for s in net.lanes[1:])
        await later[0].send_forward(0, *payload(1))
        got = await later[1].receive_forward(0)
        assert same(got[0], on_wire(payload(0))) and same(got[1], on_wire(payload(1)))
        for exchange in [first, *later]:
            exchange.close()

    net.run(body())


def test_refusals_carry_their_codes_and_the_trip_goes_on(net):
    async def body():
        trip, lane0, lane1, intruder = trip_id(), *net.lanes[:2], net.intruder
        peer1 = net.group[1]
        early_from_intruder = message(trip)
        assert await refusal(intruder, peer1, early_from_intruder) is None  # held: the group is not known yet
        dropped = lane1.dropped
        exchange = await lane1.open(trip, net.group)
        assert lane1.dropped == dropped + 1  # ... and dropped when the trip registered
        cases = [
            (intruder, message(trip), ErrorCode.UNKNOWN_SENDER),  # lane 0 is another peer in this trip's group
            (lane0, message(trip, cp_version=1), ErrorCode.WRONG_CP_VERSION),
            (lane0, message(trip, cp_sha256="0" * 64), ErrorCode.WRONG_CP_HASH),
            (lane0, message(trip, codec=make_codec("other-run")), ErrorCode.WRONG_RUN),
            (lane0, message(trip, layer=LAYERS), ErrorCode.WRONG_STAGE),
            (lane0, message(trip, dst=2), ErrorCode.WRONG_STAGE),
            (lane0, b"garbage, not a K/V message", ErrorCode.MALFORMED),
            (lane0, message(trip)[:-2], ErrorCode.MALFORMED),
        ]
        for sender, blob, code in cases:
            assert await refusal(sender, peer1, blob) == code, code
        assert await refusal(lane0, peer1, message(trip)) is None  # the honest message after all that
        got = await exchange.receive_forward(0)
        assert same(got[0], on_wire(payload(0)))
        assert await refusal(lane0, peer1, message(trip)) == ErrorCode.MALFORMED  # once per layer and kind
        exchange.close()

        stranger, before = intruder.p2p.peer_id, lane1.bytes_in  # admission (e.g. known lane peers) before reading
        lane1.admit = lambda peer: ErrorCode.UNKNOWN_SENDER if peer == stranger else None
        try:
            assert await refusal(intruder, peer1, message(trip_id())) == ErrorCode.UNKNOWN_SENDER
            assert lane1.bytes_in == before
        finally:
            lane1.admit = None

    net.run(body())


def test_a_lane_on_another_cp_basis_gets_no_kv_and_sends_none(net):
    """Lane 2 switched its CP basis (v1, the same Ū): lanes 0 and 1 refuse what it sends, it refuses what
    they send, both as `wrong_cp_version`; and a basis that switches during a trip stops its sends."""

    def switched() -> CPCodec:
        codec = make_codec()
        codec.basis.switch(dict(codec.basis.ubar), 1)
        return codec

    async def body():
        lane0, lane2 = net.lanes[0], net.lanes[2]
        saved = lane0.codec, lane2.codec
        lane2.serve(switched(), 2)
        try:
            trip = trip_id()
            lanes = [await s.open(trip, net.group) for s in net.lanes]
            for send in (
                lanes[0].send_forward(0, *payload(0)),  # lane 1 takes it, lane 2 refuses it
                lanes[2].send_backward(0, {0: payload(20, "backward"), 1: payload(21, "backward")}),
            ):
                with pytest.raises(WireError) as caught:
                    await send
                assert caught.value.code == ErrorCode.WRONG_CP_VERSION
            for exchange in lanes:
                exchange.close()

            lane0.serve(make_codec(), 0)  # a codec of its own, switched below while a trip is open
            exchange = await lane0.open(trip_id(), net.group)
            lane0.codec.basis.switch(dict(lane0.codec.basis.ubar), 1)
            with pytest.raises(WireError) as caught:
                await exchange.send_forward(0, *payload(0))
            assert caught.value.code == ErrorCode.WRONG_CP_VERSION and exchange.bytes_out == 0
            exchange.close()
        finally:
            lane0.serve(saved[0], 0)
            lane2.serve(saved[1], 2)

    net.run(body())


def test_an_oversized_message_is_refused_before_its_body_is_read(net):
    async def body():
        lane1, peer1 = net.lanes[1], net.group[1]
        huge = message(trip_id()) + bytes(32 << 20)
        before = lane1.bytes_in
        tracemalloc.start()
        try:
            code = await refusal(net.lanes[0], peer1, huge)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert code == ErrorCode.TOO_LARGE
        assert peak < 8 << 20, peak  # the sender's chunks in flight; nothing near the 32 MiB was received
        assert lane1.bytes_in == before  # the handler never saw it

    net.run(body())


def test_a_flood_of_early_messages_stays_within_the_buffer_bound(net):
    async def body():
        lane1, peer1, now = net.lanes[1], net.group[1], [0.0]
        size = len(message("x" * 32))
        saved = lane1.early, lane1.clock
        lane1.early = EarlyBuffer(BufferLimits(4 * size, 5, 3 * size, 100, ttl=10.0))
        lane1.clock = lambda: now[0]  # the TTL on a clock of our own: a loaded machine must not expire them
        try:
            codes = [await refusal(net.lanes[0], peer1, message(uuid.uuid4().hex)) for _ in range(6)]
            assert codes == [None] * 3 + [ErrorCode.OVERLOADED] * 3  # per sender: 3 messages' bytes
            codes = [await refusal(net.lanes[2], peer1, message(uuid.uuid4().hex)) for _ in range(3)]
            assert codes == [None] + [ErrorCode.OVERLOADED] * 2  # in all: 4 messages' bytes
            assert lane1.early.bytes == 4 * size and len(lane1.early.messages) == 4
            now[0] = 10.0  # the TTL frees them
            assert await refusal(net.lanes[0], peer1, message(uuid.uuid4().hex)) is None
            assert len(lane1.early.messages) == 1
        finally:
            lane1.early, lane1.clock = saved

    net.run(body())


def test_a_missing_lane_times_out_and_a_refused_send_surfaces_its_code(net):
    async def body():
        trip = trip_id()
        lanes = [await s.open(trip, net.group) for s in net.lanes]
        await lanes[0].send_forward(0, *payload(0))  # lane 1 never sends
        with pytest.raises(WireError) as caught:
            await lanes[2].receive_forward(0, timeout=0.3)
        assert caught.value.code == ErrorCode.TIMEOUT and "[1]" in caught.value.message
        for exchange in lanes:
            exchange.close()

        trip = trip_id()  # a group naming, for lane 2, a peer that serves no lane
        net.intruder.serve(None)
        try:
            exchange = await net.lanes[0].open(trip, [*net.group[:2], net.p2ps[3].peer_id])
            with pytest.raises(WireError) as caught:
                await exchange.send_forward(0, *payload(0))
            assert caught.value.code == ErrorCode.LEAVING
            exchange.close()
        finally:
            net.intruder.serve(make_codec(), 0)

    net.run(body())


def test_close_leaves_nothing_behind(net):
    async def body():
        trip = trip_id()
        lanes = [await s.open(trip, net.group) for s in net.lanes]
        await lanes[0].send_forward(0, *payload(0))
        waiting = asyncio.ensure_future(lanes[2].receive_forward(0))
        await asyncio.sleep(0.05)
        for exchange in lanes:
            exchange.close()
        with pytest.raises(WireError):
            await waiting  # a receive waiting when its trip closed fails at once
        for service, exchange in zip(net.lanes, lanes, strict=True):
            assert trip not in service.exchanges and not service.early.held(trip)
            assert not exchange.inbox
        assert await refusal(net.lanes[0], net.group[1], message(trip)) == ErrorCode.TIMEOUT  # late: not buffered
        assert not net.lanes[1].early.held(trip)
        with pytest.raises(ValueError):
            await net.lanes[1].open(trip, net.group)  # a retried trip takes a new id
        with pytest.raises(ValueError):
            await net.lanes[1].open(trip_id(), net.group[1:] + net.group[:1])  # its lane names another peer
        started = time.monotonic()
        with pytest.raises(WireError):
            await lanes[2].receive_forward(1)  # a receive after the close fails at once, not after its timeout
        assert time.monotonic() - started < 1.0

    net.run(body())


def test_an_open_cancelled_while_decoding_early_messages_leaves_no_trip(net):
    async def body():
        trip = trip_id()
        await net.lanes[0].send(net.group[1], message(trip))  # held early at lane 1
        assert net.lanes[1].early.held(trip)
        opening = asyncio.ensure_future(net.lanes[1].open(trip, net.group))
        await asyncio.sleep(0)  # registered, now decoding the early message off the loop
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening
        assert trip not in net.lanes[1].exchanges and not net.lanes[1].early.held(trip)

    net.run(body())


def test_early_buffer_bounds_duplicates_and_expiry():
    blob = message("t1")
    header, _ = parse_kv_header(blob)
    size = len(blob)

    def early(sender, trip="t1", layer=0):
        return EarlyMessage(sender, dataclasses.replace(header, trip_id=trip, layer=layer), blob)

    buffer = EarlyBuffer(BufferLimits(10 * size, total_count=3, sender_bytes=10 * size, sender_count=2, ttl=10.0))
    buffer.add(early("a"), now=0.0)
    with pytest.raises(WireError) as caught:
        buffer.add(early("a"), now=1.0)
    assert caught.value.code == ErrorCode.MALFORMED  # the same layer twice from one sender
    buffer.add(early("b"), now=1.0)  # the same claim from another sender: the group decides at registration
    buffer.add(early("a", layer=1), now=2.0)
    for sender in ("a", "c"):  # a's count, then the total count
        with pytest.raises(WireError) as caught:
            buffer.add(early(sender, "t2"), now=3.0)
        assert caught.value.code == ErrorCode.OVERLOADED
    assert buffer.bytes == 3 * size and buffer.sender_count == {"a": 2, "b": 1}
    buffer.expire(now=11.5)  # a's first and b's are over 10 s old
    assert len(buffer.messages) == 1 and buffer.sender_count == {"a": 1}
    assert [m.header.layer for m in buffer.take("t1", now=11.9)] == [1]
    assert buffer.bytes == 0 and not buffer.messages and not buffer.by_trip and not buffer.sender_bytes

    one_trip = EarlyBuffer(BufferLimits(100 * size, 100, 100 * size, 100, trip_count=2))
    one_trip.add(early("a"), now=0.0)
    one_trip.add(early("b"), now=0.0)
    with pytest.raises(WireError) as caught:  # a third message for one unregistered trip id, from anyone
        one_trip.add(early("c", layer=1), now=0.0)
    assert caught.value.code == ErrorCode.OVERLOADED
    one_trip.add(early("c", "t2"), now=0.0)  # another trip still has room

    by_bytes = EarlyBuffer(BufferLimits(3 * size, 100, sender_bytes=2 * size, sender_count=100))
    by_bytes.add(early("a"), now=0.0)
    by_bytes.add(early("a", layer=1), now=0.0)
    by_bytes.add(early("b"), now=0.0)
    for sender in ("a", "c"):  # a's bytes, then the total bytes
        with pytest.raises(WireError) as caught:
            by_bytes.add(early(sender, "t2"), now=0.0)
        assert caught.value.code == ErrorCode.OVERLOADED


def lane_trip(lane: int) -> LaneTrip:
    n = SEQ // SPEC.size
    tokens = torch.randint(0, SHAPE.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return LaneTrip(CPDecoder(SHAPE, SPEC, seed=5), lane, tokens[:, lane * n : (lane + 1) * n])


async def _inline(fn, *args):
    return fn(*args)


def _hop() -> SimpleNamespace:
    """What `_forward` needs of a LaneHop: a runtime's `run`, and the stats where its K/V waits are counted."""
    hop = SimpleNamespace(runtime=SimpleNamespace(run=_inline), stats=Stats())
    hop._kv_wait = functools.partial(LaneHop._kv_wait, hop)
    return hop


HOP = _hop()


class Gate:
    """Holds a service's K/V handler on the forward message of layer 0 (so its ACK too) until `release`."""

    def __init__(self, service: KVService):
        self.service, self.accept, self.release = service, service._accept, asyncio.Event()
        self.held = asyncio.Event()

    async def _accept(self, blob: bytes, remote) -> None:
        header, _ = parse_kv_header(blob)
        if (header.kind, header.layer) == ("forward", 0):
            self.held.set()
            await self.release.wait()
        await self.accept(blob, remote)

    def __enter__(self) -> Gate:
        self.service._accept = self._accept
        return self

    def __exit__(self, *_) -> None:
        self.release.set()
        self.service._accept = self.accept


def test_a_lane_computes_every_layer_while_its_first_send_waits_for_its_ack(net):
    async def body():
        trip = trip_id()
        exchanges = [await s.open(trip, net.group) for s in net.lanes]
        lane, sends, hop = lane_trip(0), _Sends(), _hop()
        with Gate(net.lanes[1]) as gate:
            # lane 0 hears from no lane: on the old code its forward waited for lane 1's ACK of layer 0, forever here
            await asyncio.wait_for(LaneHop._forward(hop, lane, exchanges[0], sends), STUCK)
            assert lane.done == len(lane.order) > 1  # every layer computed
            assert hop.stats.kv_wait.count == len(lane.order)  # one wait for the other lanes' K/V per layer
            await asyncio.wait_for(gate.held.wait(), STUCK)
            # layer 1's message reached lane 1 while its handler still holds layer 0's, unanswered
            assert set(await asyncio.wait_for(exchanges[1].receive_forward(1), STUCK)) == {0}
            assert not gate.release.is_set() and not sends.tasks[0].done()
            assert len(sends.tasks) == len(lane.order)  # one send per layer, no more
            gate.release.set()
            await asyncio.wait_for(sends.settle(), STUCK)  # what the trip awaits before its step
        assert all(task.done() and task.exception() is None for task in sends.tasks)
        assert set(await exchanges[1].receive_forward(0)) == {0}
        assert all(set(exchanges[2].inbox["forward", layer]) == {0} for layer in lane.order)  # lane 1's still due
        for exchange in exchanges:
            exchange.close()

    net.run(body())


def test_a_refused_send_fails_the_trip_at_once_and_leaves_no_task(net):
    async def body():
        trip = trip_id()
        exchanges = [await s.open(trip, net.group) for s in net.lanes[:2]]
        lane, sends = lane_trip(1), _Sends()
        net.lanes[2].serve(None)  # lane 2 leaves: lane 1's K/V are refused `leaving`
        try:
            # lane 0 never sends: lane 1 waits for its layer 0 until its own send's refusal fails the trip (not
            # after the receive's timeout)
            with pytest.raises(WireError) as caught:
                await asyncio.wait_for(LaneHop._forward(HOP, lane, exchanges[1], sends), STUCK)
        finally:
            net.lanes[2].serve(make_codec(), 2)
        assert caught.value.code == ErrorCode.LEAVING
        assert len(sends.tasks) == 1 and all(task.done() for task in sends.tasks)

        # a trip cancelled while a send waits for its ACK: the send is cancelled and awaited, none left running
        trip = trip_id()
        exchanges += [await s.open(trip, net.group) for s in net.lanes]
        lane, sends = lane_trip(0), _Sends()
        with Gate(net.lanes[1]) as gate:
            await asyncio.wait_for(LaneHop._forward(HOP, lane, exchanges[2], sends), STUCK)
            await asyncio.wait_for(gate.held.wait(), STUCK)
            assert not sends.tasks[0].done()
            await sends.cancel()
            assert all(task.done() for task in sends.tasks) and sends.tasks[0].cancelled()
        for exchange in exchanges:
            exchange.close()

    net.run(body())
