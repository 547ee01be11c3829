"""The LLaMA-style stages: which tensors are constrained in each mode, shapes, causality, and that
splitting the model into stages does not change the function it computes."""

from __future__ import annotations

import math

import pytest
import torch
from builders import tiny_manifest

from swarm.model import (
    PipelineStage,
    apply_rope,
    build_stages,
    next_token_loss,
    rope_tables,
)
from swarm.subspace import initial_basis, relative_error, tensor_sha256

D, K, V, SEQ = 64, 4, 256, 32


def small(compression: str = "subspace", n_layers: int = 2, stages: int = 2, **overrides):
    return tiny_manifest(compression, n_layers, stages, **overrides)


def tokens(batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def chain(stages, toks):
    hidden = None
    for stage in stages:
        hidden = stage(hidden, toks)
    return hidden


def _names(stage: PipelineStage) -> set[str]:
    return {item.name for item in stage.constrained}


def test_constrained_tensors_subspace_mode():
    stages = build_stages(small("subspace", n_layers=3, stages=3))
    assert _names(stages[0]) == {"t_s", "layers.0.attn.wo.weight", "layers.0.mlp.w2.weight"}
    assert _names(stages[1]) == {"layers.0.attn.wo.weight", "layers.0.mlp.w2.weight"}
    assert _names(stages[2]) == set()  # the tail writes into a stream that never leaves the peer
    axes = {item.name: item.axis for item in stages[0].constrained}
    assert axes == {"t_s": 1, "layers.0.attn.wo.weight": 0, "layers.0.mlp.w2.weight": 0}
    for stage in stages:
        assert not stage.projects_boundary


def test_constrained_tensors_boundary_mode():
    stages = build_stages(small("boundary", n_layers=3, stages=3))
    assert [_names(s) for s in stages] == [{"t_s"}, set(), set()]
    assert [s.projects_boundary for s in stages] == [True, True, False]


def test_nothing_constrained_in_dense_mode_or_single_stage():
    assert all(not s.constrained for s in build_stages(small("none")))
    assert not PipelineStage(small("subspace", stages=1), 0).constrained


def test_constrained_tensors_start_in_span():
    for stage in build_stages(small("subspace", n_layers=3, stages=3))[:2]:
        assert stage.subspace_residual() < 1e-6
        for item in stage.constrained:
            assert item.param.norm() > 0


def test_stage_shapes_and_roles():
    manifest = small("subspace", n_layers=3, stages=3)
    head, middle, tail = build_stages(manifest)
    assert (head.is_head, head.is_tail, tail.is_head, tail.is_tail) == (True, False, False, True)
    assert hasattr(head, "t_s") and not hasattr(middle, "t_s") and hasattr(tail, "lm_head")
    toks = tokens()
    hidden = head(None, toks)
    assert hidden.shape == (2, SEQ, D)
    hidden = middle(hidden, toks)
    assert hidden.shape == (2, SEQ, D)
    assert tail(hidden, toks).shape == (2, SEQ, V)
    with pytest.raises(ValueError, match="needs the residual stream"):
        middle(None, toks)
    with pytest.raises(ValueError, match="out of range"):
        PipelineStage(manifest, 3)


def test_initial_loss_is_near_uniform():
    loss = next_token_loss(chain(build_stages(small()), tokens()), tokens()).item()
    assert abs(loss - math.log(V)) < 0.3


def test_next_token_loss_shifts_targets():
    toks = torch.tensor([[1, 2, 3]])
    logits = torch.full((1, 3, 5), -1e4)
    logits[0, 0, 2] = logits[0, 1, 3] = 0.0  # predicts the next token perfectly
    assert next_token_loss(logits, toks).item() < 1e-3
    logits[0, 2, 0] = 50.0  # the last position's prediction has no target
    assert next_token_loss(logits, toks).item() < 1e-3


def test_attention_is_causal():
    stages = build_stages(small("none"))
    toks = tokens(1)
    changed = toks.clone()
    changed[0, 20:] = (changed[0, 20:] + 1) % V
    with torch.no_grad():
        a, b = chain(stages, toks), chain(stages, changed)
    assert torch.allclose(a[:, :20], b[:, :20], atol=1e-5)
    assert not torch.allclose(a[:, 20:], b[:, 20:], atol=1e-3)


def test_rope_is_a_rotation():
    cos, sin = rope_tables(16, 64, 10000.0)
    x = torch.randn(2, 3, 10, 16)
    rotated = apply_rope(x, cos, sin)
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert torch.allclose(rotated[..., 0, :], x[..., 0, :])  # position 0 is not rotated
    assert not torch.allclose(rotated[..., 5, :], x[..., 5, :])


def test_split_does_not_change_the_function():
    """Per-layer seeded init: in dense mode the same layers give the same logits whatever the split (without
    stage embeddings: a table per stage makes the split part of the model)."""
    toks = tokens()
    whole = build_stages(small("none", stages=1, stage_embedding_rank=0))
    split = build_stages(small("none", stages=2, stage_embedding_rank=0))
    with torch.no_grad():
        assert relative_error(chain(split, toks), chain(whole, toks)) < 1e-5
    assert torch.equal(whole[0].layers[1].attn.wq.weight, split[1].layers[0].attn.wq.weight)


def test_boundary_mode_projects_residual():
    stage = build_stages(small("boundary"))[0]
    with torch.no_grad():
        for block in stage.layers:  # full-rank weights that write well outside span(U)
            block.mlp.w2.weight.mul_(30)
        toks = tokens()
        r = stage(None, toks) - stage.subspace.t_fixed[toks]
        basis = stage.subspace.basis
        assert r.norm() > 0
        assert relative_error((r @ basis) @ basis.T, r) < 1e-5


def test_gradient_hooks_project_constrained_gradients():
    stages = build_stages(small("subspace"))
    toks = tokens()
    next_token_loss(chain(stages, toks), toks).backward()
    basis = stages[0].subspace.basis
    for item in stages[0].constrained:
        grad = item.param.grad
        assert grad is not None and grad.norm() > 0
        projected = stages[0].subspace.project(grad, item.axis)
        assert relative_error(projected, grad) < 1e-5
    # unconstrained tensors keep their full gradient
    wq = stages[0].layers[0].attn.wq.weight.grad
    assert relative_error(basis @ (basis.T @ wq), wq) > 0.5


def test_subspace_state_hashes_and_basis_update():
    manifest = small()
    stage = PipelineStage(manifest, 0)
    state = stage.subspace
    assert state.version == 0
    assert state.basis_sha256 == tensor_sha256(initial_basis(manifest.seed, D, K)) == manifest.u_sha256
    assert state.t_fixed_sha256 == manifest.t_fixed_sha256
    new = initial_basis(9, D, K)
    state.set_basis(new, 1)
    assert state.version == 1 and torch.equal(state.basis, new)
    assert state.basis_sha256 == tensor_sha256(new) != manifest.u_sha256
    x = torch.randn(3, D)
    assert torch.allclose(state.project(x, -1), (x @ new) @ new.T)
    w = torch.randn(D, 7)
    assert torch.allclose(state.project(w, 0), new @ (new.T @ w))
    with pytest.raises(ValueError):
        state.project(torch.randn(2, D, 3), 1)


def test_reproject_washes_out_drift():
    stage = PipelineStage(small(), 0)
    with torch.no_grad():
        stage.t_s.add_(torch.randn_like(stage.t_s) * 0.01)
    assert stage.subspace_residual() > 1e-2
    stage.reproject_()
    assert stage.subspace_residual() < 1e-6


def test_same_manifest_same_weights():
    a, b = PipelineStage(small(), 0), PipelineStage(small(), 0)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    c = PipelineStage(small(seed=1), 0)
    assert not torch.equal(a.t_s, c.t_s)


@pytest.mark.parametrize("compression", ["subspace", "boundary", "none"])
@pytest.mark.parametrize("rank", [8, D])
def test_stage_embeddings_are_read_by_the_layers_and_leave_the_boundary_exact(compression, rank):
    """Every stage adds its own token table at its input and takes it out before its boundary: the layers
    read it (the output moves with it), and in the compressed modes what crosses still lies in
    T_fixed[tok] + span(U) exactly (subspace mode has no projection to hide a leak), however large it is."""
    manifest = small(compression, n_layers=3, stages=3, stage_embedding_rank=rank)
    stages, toks = build_stages(manifest), tokens()
    full = rank == D
    for stage in stages:
        table = stage.stage_embedding.table
        assert table.shape == (V, D if full else rank) and (stage.stage_embedding.up is None) == full
    with torch.no_grad():
        before = chain(stages[:2], toks)
        for stage in stages:
            stage.stage_embedding.table.mul_(100)
        hidden = chain(stages[:2], toks)
    assert relative_error(hidden, before) > 1e-3
    if compression != "none":
        state = stages[1].subspace
        residual = hidden - state.t_fixed[toks]
        # float32 rounding of adding and subtracting a table 100x its init (measured 2.4e-5); a leak is O(1)
        assert relative_error(state.project(residual, axis=-1), residual) < 1e-4
    next_token_loss(chain(stages, toks), toks).backward()
    for stage in stages:  # trained like any parameter, never constrained
        assert stage.stage_embedding.table.grad.norm() > 0
        assert all(item.name != "stage_embedding.table" for item in stage.constrained)


def test_stage_embeddings_are_seeded_per_stage_and_absent_at_rank_zero():
    assert all(stage.stage_embedding is None for stage in build_stages(small("boundary", stage_embedding_rank=0)))
    first, second = build_stages(small("boundary", stage_embedding_rank=D))
    again = build_stages(small("boundary", stage_embedding_rank=D))[0]
    assert torch.equal(first.stage_embedding.table, again.stage_embedding.table)
    assert not torch.equal(first.stage_embedding.table, second.stage_embedding.table)
    assert "stage_embedding.table" in first.state_dict()  # checkpointed and averaged with the stage


def test_a_stale_graph_is_run_again_and_other_errors_pass():
    """`PipelineStage.backward_or_recompute`, the one rule for a trip whose weights an optimizer step changed
    in place between its forward and its backward: autograd refuses the saved graph, the ∂/∂U terms the
    projection hooks added before it did are taken back, and the backward runs again from a fresh forward
    (the same gradients and terms as a clean backward); any other error is the caller's, and not retried."""
    stage = build_stages(small("subspace", subspace_update_interval=10))[0]
    toks, params = tokens(), [p for p in stage.parameters() if p.requires_grad]
    grad_out = torch.ones(2, SEQ, D)
    clean = torch.autograd.grad(stage(None, toks), params, grad_out)
    terms = stage.u_accumulator.snapshot()
    assert terms[1] > 0
    stage.u_accumulator.reset()
    saved, tries = stage(None, toks), []

    def backward(stale: bool) -> tuple[torch.Tensor, ...]:
        tries.append(stale)
        return torch.autograd.grad(stage(None, toks) if stale else saved, params, grad_out)

    with torch.no_grad():  # the MLP's w2 hook runs before autograd reaches the query weights and refuses
        stage.layers[0].attn.wq.weight.add_(0)
    again = stage.backward_or_recompute(backward)
    assert tries == [False, True] and all(torch.equal(a, b) for a, b in zip(again, clean, strict=True))
    assert torch.equal(stage.u_accumulator.snapshot()[0], terms[0]) and stage.u_accumulator.terms == terms[1]

    def other(stale: bool) -> None:
        tries.append(stale)
        raise RuntimeError("not a stale graph")

    tries.clear()
    with pytest.raises(RuntimeError, match="not a stale graph"):
        stage.backward_or_recompute(other)
    assert tries == [False]
