"""Issue 12, poisoning: no trip, in any compression mode, can make a stage's parameters non-finite.

The observed attack: in `compression: none` (dense, int8 wire) one well-formed trip with a token
row of 3.3e38 was finite, so it passed the wire; its square overflowed in RMSNorm, the gradients
became NaN, the clip let them through, and the stage's weights were NaN for good. Now such rows are
refused at the wire (`out_of_range`), and should anything non-finite get past the wire anyway, the
stage refuses the microbatch (`not_finite`) before hivemind's optimizer sees it, or puts back its
last finite state. The stage runtimes here run on their own DHT nodes, with real hivemind optimizers.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator

import pytest
import torch
from hivemind.dht import DHT

from peer.runtime import StageRuntime
from swarm import codec
from swarm import subspace as ss
from swarm.codec import BoundaryCodec
from swarm.live_state import parameters_sha256
from swarm.manifest import BatchSpec
from swarm.model import PipelineStage, build_stages, next_token_loss
from swarm.optim import clip_grad_norm, make_optimizer
from swarm.presets import preset
from swarm.simulate import run_trip
from swarm.wire import MAX_ACTIVATION_NORM, MAX_GRADIENT_NORM, ErrorCode, Header, WireError, encode, max_token_norm

# dense, int8 wire: the attacked configuration. One microbatch per optimizer epoch, so two stages
# that train on the same trips take the same steps, whatever hivemind's progress tracker's timing
DENSE = preset(
    "tiny",
    stages=2,
    compression="none",
    wire_dtype="int8",
    batch=BatchSpec(microbatch_size=2, seq_len=32, target_batch_size=2),
)
BATCH, SEQ = DENSE.batch.microbatch_size, DENSE.batch.seq_len


@pytest.fixture
def make_runtime() -> Iterator[Callable[[int], StageRuntime]]:
    """Stage runtimes of DENSE, each alone on its own DHT node."""
    made: list[tuple[StageRuntime, DHT]] = []

    def make(index: int) -> StageRuntime:
        dht = DHT(start=True)
        made.append((StageRuntime(DENSE, index, dht, torch.device("cpu"), f"[test stage {index}]"), dht))
        return made[-1][0]

    yield make
    for runtime, dht in made:
        runtime.shutdown()
        dht.shutdown()


def tokens_of(trip: int) -> torch.Tensor:
    return torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(trip))


def header(manifest, kind: str, width: int, trip_id: str = "poison") -> Header:
    return Header(
        run_id=manifest.run_id,
        u_version=0,
        t_fixed_sha256=manifest.t_fixed_sha256,
        trip_id=trip_id,
        stage=1 if kind == "forward" else 0,
        kind=kind,
        dtype=manifest.wire_dtype,
        shape=(BATCH, SEQ, width),
        has_tokens=kind == "forward",
        loss=None if kind == "forward" else 2.0,
    )


def poison_rows(payload: torch.Tensor, norm: float) -> torch.Tensor:
    """A copy of `payload` whose token row [0, 5] has L2 norm `norm` (or holds `norm` in one value
    when that norm itself is beyond float32, like the observed 3.3e38)."""
    poisoned = payload.detach().clone()
    width = poisoned.shape[-1]
    if norm > 1e38:
        poisoned[0, 5, 3] = norm
    else:
        poisoned[0, 5] = norm / math.sqrt(width)
    return poisoned


def refusal(call: Callable, *args) -> ErrorCode:
    with pytest.raises(WireError) as info:
        call(*args)
    return info.value.code


# --- the wire, in every compression mode ----------------------------------------------------------


@pytest.mark.parametrize(
    "compression,wire_dtype", [("none", "int8"), ("none", "bf16"), ("boundary", "bf16"), ("subspace", "bf16")]
)
def test_poison_refused_at_the_wire_in_every_mode(compression, wire_dtype):
    """Forward: k coefficients per token (compressed) or d values (dense); backward likewise."""
    manifest = preset("tiny", stages=2, compression=compression, wire_dtype=wire_dtype, batch=DENSE.batch)
    head, tail = PipelineStage(manifest, 0), PipelineStage(manifest, 1)
    sender, receiver = BoundaryCodec(manifest, head.subspace), BoundaryCodec(manifest, tail.subspace)
    basis, t_fixed = head.subspace.basis, head.subspace.t_fixed
    compressed = compression != "none"
    width = manifest.k if compressed else manifest.model.d_model
    tokens = tokens_of(0)
    with torch.no_grad():
        hidden = head(None, tokens)
        clean = ss.compress(hidden, tokens, basis, t_fixed) if compressed else hidden
    for norm in (3.3e38, 1e30, 2 * MAX_ACTIVATION_NORM):
        blob = encode(header(manifest, "forward", width), poison_rows(clean, norm), tokens, 256)
        assert refusal(receiver.decode_forward, blob, 1) == ErrorCode.OUT_OF_RANGE
    # the honest message passes, and its real gradient goes back
    _, received, _ = receiver.decode_forward(sender.encode_forward(hidden, tokens, "honest", to_stage=1), stage=1)
    leaf = received.requires_grad_(True)
    next_token_loss(tail(leaf, tokens), tokens).backward()
    sender.decode_backward(receiver.encode_backward(leaf.grad, "honest", to_stage=0, loss=2.0), stage=0)
    grad = ss.compress_grad(leaf.grad, basis) if compressed else leaf.grad
    for norm in (3.3e38, 1e30, 2 * MAX_GRADIENT_NORM):
        blob = encode(header(manifest, "backward", width), poison_rows(grad, norm), None, 256)
        assert refusal(sender.decode_backward, blob, 0) == ErrorCode.OUT_OF_RANGE


# --- a dense stage, end to end ----------------------------------------------------------------------

HEAD = PipelineStage(DENSE, 0)  # the honest sender of forward trips (it never trains here)
HEAD_CODEC = BoundaryCodec(DENSE, HEAD.subspace)


def forward_trip(trip: int) -> bytes:
    tokens = tokens_of(trip)
    with torch.no_grad():
        hidden = HEAD(None, tokens)
    return HEAD_CODEC.encode_forward(hidden, tokens, f"trip-{trip}", to_stage=1)


def serve(runtime: StageRuntime, blob: bytes) -> bytes:
    """What the daemon does with a trip on the tail stage: decode, forward, backward and step, reply."""
    header, hidden, tokens = runtime.codec.decode_forward(blob, stage=1)
    leaf, output, _ = runtime.forward(hidden, tokens, header.u_version)
    grad, loss = runtime.backward(leaf, output, None, tokens, None, header.u_version)
    runtime.step(BATCH)
    extra = {"versions": [0], "epochs": [0]}
    return runtime.codec.encode_backward(grad, header.trip_id, to_stage=0, loss=loss, extra=extra)


def poisoned_forward(norm: float) -> bytes:
    tokens = tokens_of(99)
    with torch.no_grad():
        hidden = HEAD(None, tokens)
    return encode(header(DENSE, "forward", DENSE.model.d_model), poison_rows(hidden, norm), tokens, 256)


def assert_finite(runtime: StageRuntime) -> None:
    assert all(torch.isfinite(p).all() for p in runtime.stage.parameters())


def test_poisoned_dense_stage_equals_an_honest_one(make_runtime, caplog):
    honest, attacked = make_runtime(1), make_runtime(1)
    honest_replies = [serve(honest, forward_trip(trip)) for trip in range(4)]

    replies = [serve(attacked, forward_trip(0))]
    # the observed poison (a 3.3e38 row through the int8 wire), an inf-free but huge trip, and a row
    # just beyond the bound: all refused at the wire, before any compute
    for norm in (3.3e38, 1e30, 1e18, 2 * MAX_ACTIVATION_NORM):
        assert refusal(serve, attacked, poisoned_forward(norm)) == ErrorCode.OUT_OF_RANGE
    replies.append(serve(attacked, forward_trip(1)))
    # past the wire (as if a bound were missing): the microbatch's gradients are NaN, so it is refused
    # before hivemind accumulates it, and nothing of it is applied
    before = parameters_sha256(attacked.stage)
    tokens = tokens_of(99)
    with torch.no_grad():
        hidden = poison_rows(HEAD(None, tokens), 3.3e38)
    with caplog.at_level(logging.WARNING, logger="peer.runtime"):
        for _ in range(3):
            leaf, output, _ = attacked.forward(hidden, tokens, 0)
            code = refusal(attacked.backward, leaf, output, None, tokens, None, 0)
            assert code == ErrorCode.NOT_FINITE
    assert parameters_sha256(attacked.stage) == before and all(p.grad is None for p in attacked.stage.parameters())
    assert attacked.refused_updates == {"trip refused (not_finite)": 3}
    assert len([r for r in caplog.records if r.name == "peer.runtime"]) == 1  # one line, not one per trip
    replies += [serve(attacked, forward_trip(trip)) for trip in (2, 3)]

    assert_finite(attacked)
    assert attacked.epoch == honest.epoch == 4
    assert parameters_sha256(attacked.stage) == parameters_sha256(honest.stage)
    assert replies == honest_replies  # and it answered every honest trip as the honest stage did


def test_non_finite_stage_state_is_replaced_by_the_last_finite_one(make_runtime):
    """Parameters or moments may also turn non-finite without a trip (averaging with a hostile
    fellow peer lands in `Optimizer.step`): the stage puts back its last finite state."""
    honest, stage = make_runtime(1), make_runtime(1)
    for trip in range(3):
        serve(honest, forward_trip(trip))
    serve(stage, forward_trip(0))
    serve(stage, forward_trip(1))
    kept = parameters_sha256(stage.stage)
    with torch.no_grad():  # NaN parameters: the next trip's loss is NaN, refused, and the state restored
        stage.stage.layers[0].attn.wq.weight[0, 0] = float("nan")
    assert refusal(serve, stage, forward_trip(2)) == ErrorCode.NOT_FINITE
    assert_finite(stage)
    assert parameters_sha256(stage.stage) == kept
    serve(stage, forward_trip(2))
    assert parameters_sha256(stage.stage) == parameters_sha256(honest.stage)
    # NaN moments: the step itself makes the parameters NaN; they are put back at once
    moments = stage.optimizer.opt.state[stage.stage.lm_head.weight]
    moments["exp_avg_sq"].fill_(float("nan"))
    kept = parameters_sha256(stage.stage)
    serve(stage, forward_trip(3))
    assert_finite(stage)
    assert parameters_sha256(stage.stage) == kept
    assert torch.isfinite(stage.optimizer.opt.state[stage.stage.lm_head.weight]["exp_avg_sq"]).all()
    assert stage.refused_updates["non-finite parameters replaced by the last finite state"] == 2


def test_poisoned_gradient_never_reaches_the_head(make_runtime):
    """The backward direction, on the driver's stage: a reply with an absurd gradient row."""
    honest, attacked = make_runtime(0), make_runtime(0)
    tail = PipelineStage(DENSE, 1)  # the honest tail computes real gradients for each trip
    tail_codec = BoundaryCodec(DENSE, tail.subspace)

    def trip(runtime: StageRuntime, number: int, poison: float | None = None) -> None:
        tokens = tokens_of(number)
        _, output, residual = runtime.forward(None, tokens, 0)
        leaf = output.detach().requires_grad_(True)
        next_token_loss(tail(leaf, tokens), tokens).backward()
        tail.zero_grad(set_to_none=True)
        grad = leaf.grad if poison is None else poison_rows(leaf.grad, poison)
        if poison is not None and poison > 1e38:  # the wire refuses it; and past the wire, so does the stage
            blob = encode(header(DENSE, "backward", DENSE.model.d_model), grad, None, 256)
            assert refusal(runtime.codec.decode_backward, blob, 0) == ErrorCode.OUT_OF_RANGE
            assert refusal(runtime.backward, None, output, grad, tokens, residual, 0) == ErrorCode.NOT_FINITE
            return
        if poison is not None:
            blob = encode(header(DENSE, "backward", DENSE.model.d_model), grad, None, 256)
            assert refusal(runtime.codec.decode_backward, blob, 0) == ErrorCode.OUT_OF_RANGE
            return
        _, received = runtime.codec.decode_backward(tail_codec.encode_backward(grad, "t", to_stage=0, loss=1.0), 0)
        runtime.backward(None, output, received, tokens, residual, 0)
        runtime.step(BATCH)

    for number in range(3):
        trip(honest, number)
    trip(attacked, 0)
    for poison in (3.3e38, 1e30, 2 * MAX_GRADIENT_NORM):
        trip(attacked, 1, poison)
    trip(attacked, 1)
    trip(attacked, 2)
    assert_finite(attacked)
    assert attacked.epoch == honest.epoch == 3
    assert parameters_sha256(attacked.stage) == parameters_sha256(honest.stage)


@pytest.mark.parametrize("compression,wire_dtype", [("none", "int8"), ("boundary", "bf16"), ("subspace", "bf16")])
def test_honest_traffic_stays_far_below_the_bounds(compression, wire_dtype, monkeypatch):
    """A short honest training run through the real codec, every boundary of a 4-stage pipeline: the
    largest token row crossing it is more than three orders of magnitude below each bound (longer runs
    are measured in swarm/wire.py)."""
    manifest = preset("tiny", stages=4, compression=compression, wire_dtype=wire_dtype, batch=DENSE.batch)
    stages = build_stages(manifest)
    optimizers = [make_optimizer(stage) for stage in stages]
    largest = {"forward": 0.0, "backward": 0.0}
    decode = codec.decode

    def measuring(blob, expect):
        header, payload, tokens = decode(blob, expect)
        largest[expect.kind] = max(largest[expect.kind], max_token_norm(payload))
        return header, payload, tokens

    monkeypatch.setattr(codec, "decode", measuring)
    for step in range(8):
        run_trip(stages, tokens_of(step))
        for stage, optimizer in zip(stages, optimizers, strict=True):
            clip_grad_norm(stage.parameters(), manifest.optimizer.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert 0 < largest["forward"] < MAX_ACTIVATION_NORM / 1e3
    assert 0 < largest["backward"] < MAX_GRADIENT_NORM / 1e3
