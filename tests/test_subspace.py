"""Subspace math and exact reconstruction at a stage boundary (DESIGN.md §2.1–2.4, §2.8)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from swarm import subspace as ss
from swarm.codec import BoundaryCodec
from swarm.model import PipelineStage, build_stages
from swarm.presets import preset


def _orthonormality_error(basis: torch.Tensor) -> float:
    k = basis.shape[1]
    return (basis.double().T @ basis.double() - torch.eye(k, dtype=torch.float64)).abs().max().item()


# --- U, T_fixed, projections --------------------------------------------------------------------

def test_initial_basis_is_orthonormal_and_deterministic():
    basis = ss.initial_basis(0, 64, 4)
    assert basis.shape == (64, 4) and basis.dtype == torch.float32
    assert _orthonormality_error(basis) < 1e-6
    assert torch.equal(basis, ss.initial_basis(0, 64, 4))
    assert not torch.allclose(basis, ss.initial_basis(1, 64, 4))


def test_t_fixed_deterministic_and_seeded():
    assert torch.equal(ss.t_fixed_table(0, 256, 32), ss.t_fixed_table(0, 256, 32))
    assert not torch.equal(ss.t_fixed_table(0, 256, 32), ss.t_fixed_table(1, 256, 32))


def test_t_fixed_and_basis_use_distinct_streams():
    # U must not be a function of T_fixed's first entries (separate PCG64 streams)
    table = ss.t_fixed_table(0, 4, 8).flatten().double()
    raw = torch.from_numpy(ss._uniform_pm1(0, ss._U_STREAM, 32))
    assert not torch.allclose(table / table.abs().max(), raw / raw.abs().max())


def test_tensor_sha256_canonical_form():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert ss.tensor_sha256(t) == ss.tensor_sha256(t.double())  # canonical float32
    assert ss.tensor_sha256(t) == ss.tensor_sha256(t.T.contiguous().T)  # C order, whatever the strides
    assert ss.tensor_sha256(t) != ss.tensor_sha256(t.reshape(3, 2))  # shape is part of the hash
    t2 = t.clone()
    t2[1, 2] = torch.nextafter(t2[1, 2], torch.tensor(100.0))
    assert ss.tensor_sha256(t) != ss.tensor_sha256(t2)


def test_project_is_idempotent_and_symmetric():
    basis = ss.initial_basis(3, 32, 5)
    x = torch.randn(7, 32)
    px = ss.project(x, basis)
    assert torch.allclose(ss.project(px, basis), px, atol=1e-6)
    # residual is orthogonal to the subspace
    assert ((x - px) @ basis).abs().max() < 1e-5


def test_compress_decompress_exact_inside_span():
    torch.manual_seed(0)
    basis, table = ss.initial_basis(0, 64, 4), ss.t_fixed_table(0, 256, 64)
    tokens = torch.randint(0, 256, (3, 10))
    inside = torch.randn(3, 10, 4) @ basis.T
    x = table[tokens] + inside
    c = ss.compress(x, tokens, basis, table)
    assert c.shape == (3, 10, 4)
    assert ss.relative_error(ss.decompress(c, tokens, basis, table), x) < 1e-6


def test_compress_decompress_lossy_outside_span():
    torch.manual_seed(0)
    basis, table = ss.initial_basis(0, 64, 4), ss.t_fixed_table(0, 256, 64)
    tokens = torch.randint(0, 256, (3, 10))
    x = table[tokens] + torch.randn(3, 10, 64)
    rebuilt = ss.decompress(ss.compress(x, tokens, basis, table), tokens, basis, table)
    assert ss.relative_error(rebuilt, x) > 0.5


def test_compress_grad_keeps_what_upstream_needs():
    basis = ss.initial_basis(1, 48, 6)
    g = torch.randn(2, 5, 48)
    rebuilt = ss.decompress_grad(ss.compress_grad(g, basis), basis)
    assert torch.allclose(rebuilt, ss.project(g, basis), atol=1e-6)
    # anything whose output lies in span(U) sees the same gradient: (P g)·(U a) == g·(U a)
    direction = basis @ torch.randn(6)
    assert torch.allclose((rebuilt @ direction), (g @ direction), atol=1e-5)


def test_relative_error():
    a = torch.ones(10)
    assert ss.relative_error(a, a) == 0.0
    assert ss.relative_error(a * 1.1, a) == pytest.approx(0.1, rel=1e-5)
    assert ss.relative_error(torch.zeros(3), torch.zeros(3)) == 0.0


def test_orthonormalize_refuses_dependent_columns():
    cols = np.ones((5, 2))
    with pytest.raises(ValueError, match="linearly dependent"):
        ss.orthonormalize(cols)


# --- reconstruction through real stages and the real codec -----------------------------------------

def _stir(stage: PipelineStage, scale: float, seed: int) -> None:
    """Move every weight far from its init, then restore the constraints: a trained-looking stage."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in stage.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)
    stage.reproject_()


def _stages(compression: str, n_stages: int = 3, wire_dtype: str = "fp32") -> list[PipelineStage]:
    manifest = preset("tiny", stages=n_stages, compression=compression, wire_dtype=wire_dtype)
    stages = build_stages(manifest)
    for i, stage in enumerate(stages):
        _stir(stage, 0.05, seed=i)
    return stages


def _round_trip_errors(stages: list[PipelineStage], tokens: torch.Tensor) -> list[float]:
    """Push a microbatch through every stage, each boundary through encode/decode; errors per boundary."""
    errors = []
    hidden = None
    with torch.no_grad():
        for i, stage in enumerate(stages[:-1]):
            hidden = stage(hidden, tokens)
            sender, receiver = BoundaryCodec(stage.manifest, stage.subspace), BoundaryCodec(
                stages[i + 1].manifest, stages[i + 1].subspace)
            blob = sender.encode_forward(hidden, tokens, "trip", to_stage=i + 1)
            _, rebuilt, received_tokens = receiver.decode_forward(blob, stage=i + 1)
            assert torch.equal(received_tokens, tokens)
            errors.append(ss.relative_error(rebuilt, hidden))
            hidden = rebuilt
    return errors


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("compression", ["subspace", "boundary"])
def test_reconstruction_exact_after_constrained_blocks(compression, tokens):
    stages = _stages(compression)  # layers (0,1), (2), (3): two boundaries, three blocks upstream of the last
    errors = _round_trip_errors(stages, tokens)
    assert len(errors) == 2
    assert max(errors) < 1e-5, errors
    # the blocks wrote something substantial into the stream, so exactness is not trivial
    with torch.no_grad():
        hidden = stages[0](None, tokens)
        anchor = stages[0].subspace.t_fixed[tokens]
        assert (hidden - anchor).norm() > 0.5 * anchor.norm()


@pytest.mark.parametrize("compression", ["subspace", "boundary"])
def test_round_trip_of_tensor_outside_span_is_lossy(compression, tokens):
    stage = _stages(compression, n_stages=2)[0]
    codec = BoundaryCodec(stage.manifest, stage.subspace)
    with torch.no_grad():
        hidden = stage(None, tokens)
        noise = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1))
        outside = hidden + 0.5 * noise * hidden.std()
    _, rebuilt, _ = codec.decode_forward(codec.encode_forward(outside, tokens, "t", to_stage=1), stage=1)
    assert ss.relative_error(rebuilt, outside) > 0.1


def test_unconstrained_weights_break_reconstruction(tokens):
    """The same weights without the constraint: the subspace codec can no longer rebuild x."""
    dense = build_stages(preset("tiny", stages=2, compression="none", wire_dtype="fp32"))[0]
    _stir(dense, 0.05, seed=0)
    sub = PipelineStage(preset("tiny", stages=2, compression="subspace", wire_dtype="fp32"), 0)
    codec = BoundaryCodec(sub.manifest, sub.subspace)  # same seed: same U and T_fixed
    with torch.no_grad():
        hidden = dense(None, tokens)
    _, rebuilt, _ = codec.decode_forward(codec.encode_forward(hidden, tokens, "t", to_stage=1), stage=1)
    assert ss.relative_error(rebuilt, hidden) > 0.1


def test_dense_round_trip_exact_in_fp32(tokens):
    errors = _round_trip_errors(_stages("none"), tokens)
    assert errors == [0.0, 0.0]


@pytest.mark.parametrize("wire_dtype,bound", [("bf16", 2e-2), ("fp16", 2e-3)])
def test_half_precision_wire_is_close(wire_dtype, bound, tokens):
    errors = _round_trip_errors(_stages("subspace", n_stages=2, wire_dtype=wire_dtype), tokens)
    assert 0 < errors[0] < bound


def test_backward_message_rebuilds_projected_gradient(tokens):
    stages = _stages("subspace", n_stages=2)
    codec = BoundaryCodec(stages[1].manifest, stages[1].subspace)
    grad = torch.randn(2, 32, 256)
    blob = codec.encode_backward(grad, "t", to_stage=0, loss=1.5)
    header, rebuilt = BoundaryCodec(stages[0].manifest, stages[0].subspace).decode_backward(blob, stage=0)
    assert header.loss == 1.5 and header.shape == (2, 32, 4)
    assert ss.relative_error(rebuilt, ss.project(grad, stages[0].subspace.basis)) < 1e-6
    assert ss.relative_error(rebuilt, grad) > 0.5  # only k of d directions travel
