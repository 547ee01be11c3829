"""Context parallelism (issue 16): exact block-wise attention, compressed K/V, the wire, the bases."""

from __future__ import annotations

import dataclasses
import json
import math
import struct

import pytest
import torch

from swarm.context_parallel import (
    ContextParallelSpec,
    CPBasis,
    block_attention,
    orthonormality_error,
    rotated_basis,
)
from swarm.cp_model import CPDecoder, cp_manifest
from swarm.cp_modes import CP_MODES, compress_kv, expand_kv
from swarm.cp_wire import CP_MAGIC, CPCodec, decode_kv, encode_kv, wire_step
from swarm.manifest import ModelShape, even_stages
from swarm.model import Block, PipelineStage, build_stages, next_token_loss
from swarm.wire import ErrorCode, WireError

SHAPE = ModelShape(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, vocab_size=256, max_seq_len=64)
SEQ = 32
PINNED_BASIS_SHA256 = "e1605a695edcdb236099dd9c50fbf978da7a1b55673d2cd4142f6a42064883b5"  # CPBasis(11, 2, 64, 4, 8)


def _tokens(batch: int = 2, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(7))


def _randomise_theta_heads(model: CPDecoder) -> None:
    """θ heads start at zero; give them weight so the rotation really moves."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for block in model.layers:
            head = block.attn.theta_head
            if head is not None:
                head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * 0.5)
                head.bias.copy_(torch.randn(head.bias.shape, generator=generator) * 0.5)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _max_rel(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30)) for n in a)


# ---------------------------------------------------------------------------- 1. exact dense CP


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_dense_cp_equals_one_full_causal_attention(dtype, tol, size):
    """Logits and every parameter's gradient equal swarm.model.Block's full causal attention (GQA:
    2 KV heads for 4 query heads; RoPE at each chunk's absolute positions)."""
    model = CPDecoder(SHAPE, ContextParallelSpec(size=size), seed=1).to(dtype)
    reference = torch.nn.ModuleList(Block(SHAPE) for _ in range(SHAPE.n_layers)).to(dtype)
    for ref, block in zip(reference, model.layers, strict=True):
        ref.load_state_dict(block.state_dict())
    tokens = _tokens()
    logits = model(tokens, round_wire=False)
    next_token_loss(logits, tokens).backward()
    ours = _grads(model)
    model.zero_grad()
    x = model.enter(None, tokens)
    for ref in reference:
        x = ref(x, model.rope_cos, model.rope_sin)
    ref_logits = model.lm_head(model.final_norm(x))
    next_token_loss(ref_logits, tokens).backward()
    theirs = {n: p.grad for n, p in model.named_parameters() if not n.startswith("layers.")}
    theirs.update({f"layers.{i}.{n}": p.grad for i, ref in enumerate(reference) for n, p in ref.named_parameters()})
    assert float((logits - ref_logits).detach().abs().max() / ref_logits.detach().abs().max()) <= tol
    assert len(ours) == len(theirs) == len(list(model.parameters()))
    assert _max_rel(ours, theirs) <= tol


def test_the_cp_model_is_the_pipeline_stage_with_cp_attention():
    """CPDecoder is a one-stage PipelineStage of `swarm.model`'s Block: for one seed it starts with the
    parameters (names and values) of the same run without context parallelism and of any stage split of it,
    θ heads (zero at the start, the fixed basis) aside, so the one-process CP benchmark trains the swarm's model."""
    spec = ContextParallelSpec(size=2, compression="subspace")  # rotating: every attention has a θ head
    model = CPDecoder(SHAPE, spec, seed=3)
    assert isinstance(model, PipelineStage) and all(type(block) is Block for block in model.layers)
    theta = {n: p for n, p in model.named_parameters() if ".attn.theta_head." in n}
    assert len(theta) == 2 * SHAPE.n_layers and all(not p.any() for p in theta.values())
    ours = {n: p for n, p in model.named_parameters() if n not in theta}
    plain = cp_manifest(SHAPE, spec, 3).model_copy(update={"context_parallel": None})
    one = dict(PipelineStage(plain, 0).named_parameters())
    assert ours.keys() == one.keys() and all(torch.equal(p, one[n]) for n, p in ours.items())
    head, tail = build_stages(plain.model_copy(update={"stages": even_stages(SHAPE.n_layers, 2)}))
    split = dict(head.named_parameters()) | {n.replace("layers.0.", "layers.1."): p for n, p in tail.named_parameters()}
    assert split.keys() == ours.keys() and all(torch.equal(p, split[n]) for n, p in ours.items())


def _lse_merged_attention(q, blocks):
    """Ring attention's way: each block's softmax output and log-sum-exp, merged by their weights."""
    outs, lses = [], []
    for i, (k, v) in enumerate(blocks):
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        if i == len(blocks) - 1:
            scores = scores.masked_fill(torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        outs.append(torch.exp(scores - lse) @ v)
        lses.append(lse)
    total = torch.logsumexp(torch.stack(lses), dim=0)
    return sum(torch.exp(lse - total) * out for lse, out in zip(lses, outs, strict=True))


def test_one_sdpa_over_the_prefix_equals_the_lse_merge():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, 16, dtype=torch.float64, generator=generator, requires_grad=True)
    blocks = [
        (
            torch.randn(2, 2, 8, 16, dtype=torch.float64, generator=generator, requires_grad=True),
            torch.randn(2, 2, 8, 16, dtype=torch.float64, generator=generator, requires_grad=True),
        )
        for _ in range(3)
    ]
    merged, prefix = _lse_merged_attention(q, blocks), block_attention(q, blocks)
    assert torch.allclose(merged, prefix, atol=1e-13, rtol=0)
    inputs = [q, *[t for b in blocks for t in b]]
    g1 = torch.autograd.grad(merged.square().sum(), inputs)
    g2 = torch.autograd.grad(prefix.square().sum(), inputs)
    assert all(torch.allclose(a, b, atol=1e-12, rtol=0) for a, b in zip(g1, g2, strict=True))


# ---------------------------------------------------------------------------- 2. compressed K/V


def test_rotation_is_closed_form_and_near_orthonormal():
    basis = CPBasis(seed=5, n_layers=1, d_kv=32, r_k=4, r_v=8, n_generators=2)
    for which in ("k", "v"):
        ubar, gens = basis.ubar[0, which].double(), basis.gens[0, which].double()
        rank = ubar.shape[1]
        columns = torch.cat([ubar, *gens], dim=1)  # Ū, M_1, M_2: orthonormal together
        assert orthonormality_error(columns) < 1e-6
        theta = torch.tensor([[0.3, -0.2], [0.0, 0.0], [0.5, 0.5]], dtype=torch.float64)
        u = rotated_basis(ubar, gens, theta)
        sq = theta.square().sum(-1)
        gram = u.transpose(1, 2) @ u
        expected = (1 + sq.square() / 4)[:, None, None] * torch.eye(rank, dtype=torch.float64)
        assert torch.allclose(gram, expected, atol=1e-6)
        # R(θ)Ū with the explicit second-order R = I + S + ½S², S = Σ θ_i (M_i Ūᵀ − Ū M_iᵀ)
        for row in range(theta.shape[0]):
            s = sum(theta[row, i] * (gens[i] @ ubar.T - ubar @ gens[i].T) for i in range(2))
            r = torch.eye(32, dtype=torch.float64) + s + 0.5 * s @ s
            assert torch.allclose(r @ ubar, u[row], atol=1e-6)
        k = torch.randn(3, 10, 32, dtype=torch.float64)
        z = compress_kv(k, u)
        assert z.shape == (3, 10, rank)
        assert torch.allclose(expand_kv(z, u), k @ u @ u.transpose(1, 2))


def test_theta_is_bounded_by_theta_max():
    spec = ContextParallelSpec(size=4, compression="subspace", theta_max=0.3)
    model = CPDecoder(SHAPE, spec, seed=1)
    with torch.no_grad():
        model.layers[0].attn.theta_head.weight.fill_(1e3)
    xn = model.layers[0].attn_norm(model.enter(None, _tokens()))
    theta = model.layers[0].attn.project(xn, spec.mode)[3]
    assert theta.shape == (2, 2) and float(theta.detach().abs().max()) <= 0.3 * (1 + 1e-6)  # float32 rounding of θ_max


@pytest.mark.parametrize(
    "compression, variant, wire_dtype",
    [
        ("none", "remote", "bf16"),
        ("subspace", "paper", "bf16"),
        ("subspace", "remote", "bf16"),
        ("subspace", "paper", "fp32"),
        ("subspace", "remote", "fp32"),
    ],
)
def test_wire_step_gradients_equal_the_one_graph_model(compression, variant, wire_dtype):
    """Every chunk its own graph, K/V through encode/decode, received Z and θ as leaves whose gradients
    are the backward messages: every parameter gradient equals the one-graph model's (float64 model,
    so the only rounding is the wire's, the same in both)."""
    spec = ContextParallelSpec(size=4, compression=compression, variant=variant, wire_dtype=wire_dtype)
    model = CPDecoder(SHAPE, spec, seed=2).double()
    _randomise_theta_heads(model)
    tokens = _tokens()
    loss = next_token_loss(model(tokens), tokens)
    loss.backward()
    graph = _grads(model)
    model.zero_grad(set_to_none=True)
    wire_loss, sent = wire_step(model, tokens, CPCodec(spec, SHAPE, SEQ, 2, "run-t", model.cp_basis))
    assert abs(wire_loss - float(loss)) < 1e-12
    assert _max_rel(_grads(model), graph) <= 1e-12
    if compression == "subspace":  # the θ heads are trained through the wire too
        assert any("theta_head" in name for name in graph)
    assert all(b > 0 for b in sent["forward"] + sent["backward"])


def test_compressed_bytes_match_the_formula_and_are_under_5_percent_of_dense():
    shape = ModelShape(d_model=256, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=256, max_seq_len=1024)
    results = {}
    for compression in ("none", "subspace"):
        spec = ContextParallelSpec(size=4, compression=compression)
        model = CPDecoder(shape, spec, seed=0)
        tokens = _tokens(batch=2, seq=1024)
        _, sent = wire_step(model, tokens, CPCodec(spec, shape, 1024, 2, "run-b", model.cp_basis))
        per_token = sent["forward"][0] / tokens.numel()
        formula = spec.payload_bytes_per_token(shape, 1024)
        expected = formula["compressed" if spec.compressed else "dense"]
        assert expected <= per_token <= 1.05 * expected  # headers cost less than 5%
        assert sent["backward"][0] == pytest.approx(sent["forward"][0], rel=0.01)
        results[compression] = per_token
    assert results["subspace"] / results["none"] <= 0.05


# ---------------------------------------------------------------------------- 3. the bases


def test_seed_basis_is_reproducible_and_pinned():
    a, b = CPBasis(11, 2, 64, 4, 8), CPBasis(11, 2, 64, 4, 8)
    assert a.sha256 == b.sha256 and a.version == 0
    assert CPBasis(12, 2, 64, 4, 8).sha256 != a.sha256
    # pinned: a platform that derives other bytes from the same seed must fail here
    assert a.sha256 == PINNED_BASIS_SHA256
    for key in a.ubar:
        assert orthonormality_error(a.ubar[key]) < 1e-6


def test_pca_warm_start_switches_version_and_hash():
    spec = ContextParallelSpec(size=2, compression="subspace", warm_start_steps=1)
    model = CPDecoder(SHAPE, spec, seed=4)
    before = model.cp_basis.sha256
    model.compress_active = False
    model.start_collecting()
    with torch.no_grad():
        model(_tokens())
    info = model.warm_start()
    assert info["version"] == 1 == model.cp_basis.version and info["sha256"] != before and model.compressed
    for key, ubar in model.cp_basis.ubar.items():
        assert orthonormality_error(ubar) < 1e-6
        assert info["energy_kept"][f"{key[0]}{key[1]}"] > ubar.shape[1] / ubar.shape[0]  # beats a random basis


def test_basis_switch_refuses_bad_bases():
    basis = CPBasis(1, 1, 16, 2, 3)
    good = {key: u.clone() for key, u in basis.ubar.items()}
    with pytest.raises(ValueError, match="version"):
        basis.switch(good, 2)
    for broken in (lambda u: u * 2, lambda u: u.new_full(u.shape, float("nan")), lambda u: u[:, :1]):
        bad = dict(good)
        bad[0, "k"] = broken(good[0, "k"])
        with pytest.raises(ValueError):
            basis.switch(bad, 1)
    assert basis.version == 0
    basis.switch(good, 1)
    assert basis.version == 1


# ---------------------------------------------------------------------------- the spec


@pytest.mark.parametrize(
    "kwargs, seq, match",
    [
        (dict(size=3), 32, "divisible"),
        (dict(compression="subspace", r_k=40), 32, "r_k"),
        (dict(compression="subspace", r_v=17, n_generators=1), 32, "r_v"),
    ],
)
def test_spec_validation_against_the_shape(kwargs, seq, match):
    with pytest.raises(ValueError, match=match):
        ContextParallelSpec(**kwargs).validate(SHAPE, seq)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(size=0),
        dict(compression="lossy"),
        dict(variant="x"),
        dict(r_k=0),
        dict(theta_max=2.0),
        dict(wire_dtype="int8"),
        dict(size=True),
    ],
)
def test_spec_refuses_bad_values(kwargs):
    with pytest.raises(ValueError):
        ContextParallelSpec(**kwargs)


# ---------------------------------------------------------------------------- the codec


def _message(kind="forward", **header_changes):
    spec = ContextParallelSpec(size=4, compression="subspace", theta_max=0.5)
    basis = CPBasis.for_spec(spec, SHAPE, seed=9)
    codec = CPCodec(spec, SHAPE, SEQ, 2, "run-c", basis)
    owner, src, dst = (1, 1, 3) if kind == "forward" else (1, 3, 1)
    header = dataclasses.replace(codec.header(kind, 1, owner, src, dst, 2, spec.mode), **header_changes)
    z_k, z_v, theta = torch.randn(2, 8, spec.r_k), torch.randn(2, 8, spec.r_v), torch.full((2, 2), 0.25)
    return codec, header, (z_k, z_v, theta)


def _reheader(blob: bytes, **changes) -> bytes:
    (length,) = struct.unpack_from("<I", blob, 4)
    head = json.loads(blob[8 : 8 + length])
    head.update(changes)
    raw = json.dumps(head).encode()
    return CP_MAGIC + struct.pack("<I", len(raw)) + raw + blob[8 + length :]


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_codec_round_trip(kind):
    codec, header, (z_k, z_v, theta) = _message(kind)
    blob = encode_kv(header, z_k, z_v, theta)
    got, d_k, d_v, d_theta = decode_kv(blob, codec.expectation(kind, header.dst, CP_MODES["subspace"]))
    assert got == header
    assert torch.equal(d_k, z_k.bfloat16().float()) and torch.equal(d_v, z_v.bfloat16().float())
    assert torch.equal(d_theta, theta)


@pytest.mark.parametrize(
    "changes, code",
    [
        (dict(run_id="other"), ErrorCode.WRONG_RUN),
        (dict(cp_sha256="f" * 64), ErrorCode.WRONG_CP_HASH),
        (dict(cp_version=1), ErrorCode.WRONG_CP_VERSION),
        (dict(cp_version=1, cp_sha256="f" * 64), ErrorCode.WRONG_CP_VERSION),
        (dict(stage=1), ErrorCode.WRONG_STAGE),
        (dict(layer=2), ErrorCode.WRONG_STAGE),
        (dict(kind="backward"), ErrorCode.WRONG_KIND),
        (dict(dst=2), ErrorCode.WRONG_STAGE),
        (dict(owner=0), ErrorCode.MALFORMED),
        (dict(src=3), ErrorCode.MALFORMED),
        (dict(dtype="fp32"), ErrorCode.WRONG_DTYPE),
        (dict(width_k=5), ErrorCode.WRONG_SHAPE),
        (dict(chunk_len=16), ErrorCode.WRONG_SHAPE),
        (dict(n_theta=0), ErrorCode.WRONG_SHAPE),
        (dict(batch=3), ErrorCode.WRONG_SHAPE),
        (dict(batch=1), ErrorCode.MALFORMED),
        (dict(layer="1"), ErrorCode.MALFORMED),
        (dict(layer=True), ErrorCode.MALFORMED),
        (dict(extra=1), ErrorCode.MALFORMED),
    ],
)
def test_codec_refuses_every_wrong_claim(changes, code):
    codec, header, payload = _message()
    blob = _reheader(encode_kv(header, *payload), **changes)
    with pytest.raises(WireError) as caught:
        decode_kv(blob, codec.expectation("forward", 3, CP_MODES["subspace"]))
    assert caught.value.code == code


def test_codec_refuses_bad_bytes_and_values():
    codec, header, (z_k, z_v, theta) = _message()
    expect = codec.expectation("forward", 3, CP_MODES["subspace"])
    blob = encode_kv(header, z_k, z_v, theta)
    cases = [
        (b"XXXX" + blob[4:], ErrorCode.MALFORMED),
        (blob[:-1], ErrorCode.MALFORMED),
        (blob + b"\0", ErrorCode.MALFORMED),
        (blob[:8] + b"[" + blob[9:], ErrorCode.MALFORMED),
        (blob + b"\0" * expect.max_bytes, ErrorCode.TOO_LARGE),
    ]
    nan_theta = bytearray(blob)
    nan_theta[-4:] = struct.pack("<f", float("nan"))
    big_theta = bytearray(blob)
    big_theta[-4:] = struct.pack("<f", 0.6)
    start = len(blob) - 2 * 2 * 4 - 2 * 8 * (z_k.shape[-1] + z_v.shape[-1]) * 2
    inf_z = bytearray(blob)
    inf_z[start : start + 2] = torch.tensor([float("inf")], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    huge_z = bytearray(blob)
    huge_z[start : start + 2] = torch.tensor([1e30], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    cases += [
        (bytes(nan_theta), ErrorCode.NOT_FINITE),
        (bytes(big_theta), ErrorCode.OUT_OF_RANGE),
        (bytes(inf_z), ErrorCode.NOT_FINITE),
        (bytes(huge_z), ErrorCode.OUT_OF_RANGE),
    ]
    for bad, code in cases:
        with pytest.raises(WireError) as caught:
            decode_kv(bad, expect)
        assert caught.value.code == code, bad[:40]


def test_codec_does_not_send_what_it_would_refuse():
    _, header, (z_k, z_v, theta) = _message()
    with pytest.raises(WireError):
        encode_kv(header, z_k * float("nan"), z_v, theta)
    with pytest.raises(ValueError):
        encode_kv(header, z_k[:, :4], z_v, theta)


# ---------------------------------------------------------------------------- the modes


def test_modes_answer_what_crosses():
    """`none` ships K/V as they are; `subspace` ships Z = K U and rebuilds exactly what lies in span(U);
    only `subspace`'s paper variant builds the owner's block from its own message."""
    dense, sub = CP_MODES["none"], CP_MODES["subspace"]
    assert (dense.compressed, sub.compressed) == (False, True)
    assert dense.widths(4, 8, 32) == (32, 32) and sub.widths(4, 8, 32) == (4, 8)
    basis = CPBasis(seed=3, n_layers=1, d_kv=32, r_k=4, r_v=8)
    bases = (basis.ubar[0, "k"].double().unsqueeze(0), basis.ubar[0, "v"].double().unsqueeze(0))
    generator = torch.Generator().manual_seed(1)
    k = torch.randn(2, 5, 4, dtype=torch.float64, generator=generator) @ bases[0][0].T  # in span(U_k)
    v = torch.randn(2, 5, 32, dtype=torch.float64, generator=generator)
    z_k, z_v = sub.encode(k, v, bases)
    assert z_k.shape == (2, 5, 4) and z_v.shape == (2, 5, 8)
    rebuilt_k, rebuilt_v = sub.decode(z_k, z_v, bases)
    assert torch.allclose(rebuilt_k, k, atol=1e-12) and not torch.allclose(rebuilt_v, v, atol=1e-3)
    assert all(a is b for a, b in zip(dense.decode(*dense.encode(k, v, None), None), (k, v), strict=True))
    assert [sub.owner_uses_message(x) for x in ("paper", "remote")] == [True, False]
    assert not dense.owner_uses_message("paper")
