"""The per-lane engine of context parallelism (issue 17): P lanes of a stage, driven in one process in the
swarm's order with every K/V message through the real codec, compute what the in-process stage computes."""

from __future__ import annotations

import weakref

import pytest
import torch
from builders import tiny_manifest

from swarm.cp_lane import LaneTrip
from swarm.cp_wire import CPCodec, lanes_backward, lanes_forward
from swarm.model import build_stages, next_token_loss
from swarm.wire import ErrorCode, WireError

SEQ, BATCH, V = 32, 2, 256


def _manifest(size: int, compression: str, variant: str, wire_dtype: str = "fp32", **overrides):
    """3 stages of 2 layers (head, middle, tail), the pipeline's `subspace` mode: T_S and every non-tail
    wo/w2 are constrained, so their gradients go through the projection hooks."""
    cp = {"size": size, "compression": compression, "variant": variant, "wire_dtype": wire_dtype}
    return tiny_manifest("subspace", n_layers=6, stages=3, context_parallel=cp, **overrides)


def _stages(manifest, dtype=torch.float32):
    stages = [stage.to(dtype) for stage in build_stages(manifest)]
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # θ heads start at zero; give them weight so the rotating mixture really rotates
        for stage in stages:
            for block in stage.layers:
                head = block.attn.theta_head
                if head is not None:
                    head.weight.copy_(torch.randn(head.weight.shape, generator=generator).to(dtype) * 0.5)
                    head.bias.copy_(torch.randn(head.bias.shape, generator=generator).to(dtype) * 0.5)
    return stages


def _tokens() -> torch.Tensor:
    return torch.randint(0, V, (BATCH, SEQ), generator=torch.Generator().manual_seed(11))


def _in_process(stages, tokens):
    """The whole pipeline in one graph (each stage's CPAttention runs all chunks): loss, each stage's
    input, input gradient, output, output gradient and parameter gradients."""
    inputs, outputs, hidden = [], [], None
    for stage in stages:
        inputs.append(hidden)
        hidden = stage(hidden, tokens)
        outputs.append(hidden)
        hidden.retain_grad()  # the gradient the next stage sends back (its input gradient)
    loss = next_token_loss(hidden, tokens)
    loss.backward()
    grads = [{name: p.grad.clone() for name, p in stage.named_parameters() if p.grad is not None} for stage in stages]
    for stage in stages:
        stage.zero_grad(set_to_none=True)
    return float(loss.detach()), inputs, outputs, grads


def _codec(stage, tokens):
    manifest = stage.manifest
    return CPCodec(
        manifest.context_parallel,
        manifest.model,
        SEQ,
        BATCH,
        manifest.run_id,
        stage.cp_basis,
        stage.index,
        manifest.layers_of(stage.index),
    )


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _run_lanes(stage, tokens, hidden, out_grad):
    """P lanes of `stage`, every message through encode_kv/decode_kv; returns (lanes, loss or outputs)."""
    size = stage.manifest.context_parallel.size
    n, sent = SEQ // size, {"forward": [0] * 6, "backward": [0] * 6}
    chunk = lambda t, c: None if t is None else t[:, c * n : (c + 1) * n]  # noqa: E731
    lanes = [LaneTrip(stage, c, chunk(tokens, c), chunk(hidden, c)) for c in range(size)]
    codec = _codec(stage, tokens)
    lanes_forward(lanes, codec, sent, trip_id="trip-1")
    if stage.is_tail:
        with pytest.raises(ValueError, match="not .* chunks"):  # the loss's normalisation needs the whole length
            lanes[0].loss(tokens[:, n], SEQ - 1)
        result = sum(lane.loss(tokens[:, (c + 1) * n] if c < size - 1 else None, SEQ) for c, lane in enumerate(lanes))
    else:
        result = torch.cat([lane.output()[0] for lane in lanes], dim=1)
        for c, lane in enumerate(lanes):
            lane.backward_output(chunk(out_grad, c))
    lanes_backward(lanes, codec, sent, trip_id="trip-1")
    assert all(b > 0 for b in sent["forward"][stage.first_layer : stage.first_layer + 2]) or size == 1
    return lanes, result


# Float32, fp32 wire: the lanes run the very ops the one-graph stage runs per chunk (the same attend, the same
# message rounding), except that norms and MLPs see (B, n, d) chunks instead of (B, S, d) and each parameter's
# gradient is a sum of P per-lane sums instead of one sum over B·S rows: only the float32 summation order
# differs, a few ulp. Measured over every case below: ≤ 1.2e-6 relative to the tensor's largest entry. 1e-5
# leaves a margin of 8x; a dropped receiver's gradient or an unprojected gradient is off by O(1) (both tried).
TOL = 1e-5


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize(
    "compression, variant, stage_embedding",
    [("none", "remote", 0), ("subspace", "paper", 0), ("subspace", "remote", 0), ("subspace", "remote", 8)],
)
def test_lanes_equal_the_one_process_stages(size, compression, variant, stage_embedding):
    """With stage embeddings, each lane adds its stage's table on entry and takes it out before the boundary."""
    manifest = _manifest(size, compression, variant, stage_embedding_rank=stage_embedding)
    stages, tokens = _stages(manifest), _tokens()
    loss, inputs, outputs, grads = _in_process(stages, tokens)
    for stage in stages:
        out_grad = None if stage.is_tail else outputs[stage.index].grad
        hidden = None if stage.is_head else inputs[stage.index].detach()
        lanes, result = _run_lanes(stage, tokens, hidden, out_grad)
        if stage.is_tail:
            assert result == pytest.approx(loss, rel=1e-6)  # the lanes' losses sum to the sequence's mean
        else:
            assert _max_rel(result, outputs[stage.index].detach()) < TOL
        input_grads = [lane.input_grad() for lane in lanes]
        if stage.is_head:
            assert all(g is None for g in input_grads)
        else:
            assert _max_rel(torch.cat(input_grads, dim=1), outputs[stage.index - 1].grad) < TOL
        assert all(p.grad is None for p in stage.parameters())  # nothing reaches .grad before apply_grads
        for item in stage.constrained:  # the projection hooks ran under autograd.grad too
            buffered = sum(lane.grads[item.param] for lane in lanes)
            assert _max_rel(stage.subspace.project(buffered, item.axis), buffered) < 1e-5, item.name
        for lane in lanes:
            lane.apply_grads()
            assert lane.grads == {}
        got = {name: p.grad for name, p in stage.named_parameters() if p.grad is not None}
        assert got.keys() == grads[stage.index].keys()
        for name, grad in grads[stage.index].items():
            assert _max_rel(got[name], grad) < TOL, (stage.index, name)
        if compression == "subspace" and not (stage.is_tail and size == 2 and variant == "remote"):
            assert any("theta_head" in name for name in got)
        if stage_embedding:
            assert {"stage_embedding.table", "stage_embedding.up"} <= got.keys()


def test_lanes_round_like_the_one_process_wire_in_float64():
    """A bf16 wire (the default): the lanes' messages are rounded by the real codec, the one-graph model's by
    wire_round, forward and backward. In float64 the only rounding left is the wire's, the same in both
    (rounding a float64 to bf16 is deterministic), so they agree to float64 precision."""
    manifest = _manifest(4, "subspace", "paper", wire_dtype="bf16")
    stages, tokens = _stages(manifest, torch.float64), _tokens()
    loss, inputs, outputs, grads = _in_process(stages, tokens)
    stage = stages[1]
    lanes, result = _run_lanes(stage, tokens, inputs[1].detach(), outputs[1].grad)
    assert _max_rel(result, outputs[1].detach()) < 1e-12
    assert _max_rel(torch.cat([lane.input_grad() for lane in lanes], dim=1), outputs[0].grad) < 1e-10
    for lane in lanes:
        lane.apply_grads()
    for name, p in stage.named_parameters():
        assert _max_rel(p.grad, grads[1][name]) < 1e-10, name


def _two_lanes(compression="subspace", variant="remote"):
    manifest = _manifest(2, compression, variant)
    stage, tokens = _stages(manifest)[0], _tokens()
    return stage, [LaneTrip(stage, c, tokens[:, c * 16 : (c + 1) * 16]) for c in range(2)]


def test_a_missing_or_misshapen_message_is_refused_with_a_code_and_changes_nothing():
    stage, (first, second) = _two_lanes()
    layer = stage.first_layer
    z_k, z_v, theta = first.payload(layer)
    second.payload(layer)
    with pytest.raises(WireError) as missing:
        second.complete(layer, {})
    assert missing.value.code is ErrorCode.MALFORMED and "lacks lanes [0]" in str(missing.value)
    cases = [
        ({0: (z_k[:, :-1], z_v, theta)}, ErrorCode.WRONG_SHAPE),  # a chunk too short
        ({0: (z_v, z_k, theta)}, ErrorCode.WRONG_SHAPE),  # K and V swapped (r_k ≠ r_v)
        ({0: (z_k, z_v, None)}, ErrorCode.WRONG_SHAPE),  # θ missing
        ({0: (z_k, z_v)}, ErrorCode.MALFORMED),
        ({0: (z_k, z_v, theta), 1: (z_k, z_v, theta)}, ErrorCode.MALFORMED),  # a lane that is not earlier
    ]
    for received, code in cases:
        with pytest.raises(WireError) as refused:
            second.complete(layer, received)
        assert refused.value.code is code
    second.complete(layer, {0: (z_k, z_v, theta)})  # the right message still completes the layer
    with pytest.raises(RuntimeError, match="once"):
        second.complete(layer, {0: (z_k, z_v, theta)})


def test_backward_refuses_missing_gradients_and_calls_out_of_order():
    stage, lanes = _two_lanes("none")
    with pytest.raises(ValueError, match="exceed the model's context"):  # 64 tokens at most
        LaneTrip(stage, 1, torch.zeros(BATCH, 40, dtype=torch.long))
    with pytest.raises(RuntimeError, match="out of order"):
        lanes[0].payload(stage.first_layer + 1)
    for layer in lanes[0].order:
        sent = lanes[0].payload(layer)
        lanes[1].payload(layer)
        lanes[0].complete(layer, {})
        lanes[1].complete(layer, {0: sent})
    with pytest.raises(RuntimeError, match="needs output"):
        lanes[0].backward_output(torch.zeros(BATCH, 16, 64))
    with pytest.raises(RuntimeError, match="out of order"):
        lanes[0].payload(stage.first_layer)  # every layer is complete
    top = lanes[0].order[-1]
    out = lanes[0].output()[0]
    with pytest.raises(RuntimeError, match="out of order"):
        lanes[0].backward_layer(top, {})
    with pytest.raises(WireError) as wrong:
        lanes[0].backward_output(torch.zeros(BATCH, 15, 64))
    assert wrong.value.code is ErrorCode.WRONG_SHAPE
    lanes[0].backward_output(torch.ones_like(out))
    with pytest.raises(WireError) as missing:
        lanes[0].backward_layer(top, {})  # lane 1's gradient of lane 0's K/V is missing
    assert missing.value.code is ErrorCode.MALFORMED


def test_each_layers_graph_is_freed_by_its_backward():
    stage, lanes = _two_lanes()
    for layer in lanes[0].order:
        sent = lanes[0].payload(layer)
        lanes[1].payload(layer)
        lanes[0].complete(layer, {})
        lanes[1].complete(layer, {0: sent})
    top, below = lanes[1].order[-1], lanes[1].order[0]
    outputs = {layer: weakref.ref(lanes[1].layers[layer].out) for layer in lanes[1].order}
    lanes[1].output()
    lanes[1].backward_output(torch.ones(BATCH, 16, 64))
    back = lanes[1].backward_layer(top, {})
    assert set(back) == {0} and outputs[top]() is None and outputs[below]() is not None


def _trip_with_a_step_between(stage, tokens, hidden, out_grad, step) -> tuple[dict, torch.Tensor, int]:
    """Two lanes' forward, then `step` changes the weights in place (as an optimizer step on the same thread
    would), then their backward: the trip's gradient buffers, the input gradient and how many layers were
    recomputed."""
    lanes = [LaneTrip(stage, c, tokens[:, c * 16 : (c + 1) * 16], hidden[:, c * 16 : (c + 1) * 16]) for c in range(2)]
    codec, sent = _codec(stage, tokens), {"forward": [0] * 6, "backward": [0] * 6}
    lanes_forward(lanes, codec, sent)
    for c, lane in enumerate(lanes):
        lane.output()
        lane.backward_output(out_grad[:, c * 16 : (c + 1) * 16])
    with torch.no_grad():
        for param in stage.parameters():
            step(param)
    recomputed = []
    for lane in lanes:
        original = lane._recompute
        lane._recompute = lambda layer, original=original: recomputed.append(layer) or original(layer)
    lanes_backward(lanes, codec, sent)
    grads = {p: sum(lane.grads[p] for lane in lanes if p in lane.grads) for p in stage.parameters()}
    return grads, torch.cat([lane.input_grad() for lane in lanes], dim=1), len(recomputed)


def test_an_optimizer_step_between_forward_and_backward_recomputes_the_layer():
    """An in-place change of the weights (an optimizer step of another trip) makes autograd refuse the
    layer's saved graph; the lane recomputes that layer from its kept input and received messages with the
    current weights. With a step that changes nothing but the version counters, the gradients are exactly
    those of the trip without a step, and the U accumulator gets each projection-hook term once."""
    manifest = _manifest(2, "subspace", "paper").model_copy(update={"subspace_update_interval": 10})
    stages, tokens = _stages(manifest), _tokens()
    _, inputs, outputs, _ = _in_process(stages, tokens)
    stage, hidden, out_grad = stages[1], inputs[1].detach(), outputs[1].grad
    assert stage.u_accumulator is not None
    stage.u_accumulator.reset()  # the one-graph backward's hooks added their terms
    plain, plain_input, none = _trip_with_a_step_between(stage, tokens, hidden, out_grad, lambda p: None)
    terms = stage.u_accumulator.snapshot()
    stage.u_accumulator.reset()
    # only the query weights: the layer's backward gets past the MLP's w2 (whose hook adds a U term) before
    # autograd refuses the graph, so the terms of the failed try must be taken back
    queries = {p for block in stage.layers for p in block.attn.wq.parameters()}
    bump = lambda p: p.add_(0) if p in queries else None  # noqa: E731
    bumped, bumped_input, recomputed = _trip_with_a_step_between(stage, tokens, hidden, out_grad, bump)
    assert none == 0 and recomputed == 4  # 2 layers x 2 lanes
    assert torch.equal(bumped_input, plain_input)
    assert all(torch.equal(bumped[p], plain[p]) for p in plain)
    assert torch.equal(stage.u_accumulator.snapshot()[0], terms[0]) and stage.u_accumulator.terms == terms[1]
    moved, _, _ = _trip_with_a_step_between(stage, tokens, hidden, out_grad, lambda p: p.mul_(1.01))
    assert any(not torch.equal(moved[p], plain[p]) for p in plain)  # recomputed with the new weights
