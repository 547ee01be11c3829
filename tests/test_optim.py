"""The subspace-preserving AdamW (DESIGN.md §2.5): constrained tensors stay in span(U) where plain
AdamW leaves it; unconstrained groups are exactly AdamW; state_dict and weight decay behave."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from builders import tiny_manifest

from swarm.manifest import OptimizerSpec
from swarm.model import build_stages, next_token_loss
from swarm.optim import SubspaceAdamW, clip_grad_norm, grad_norm, lr_at, make_optimizer, parameter_groups
from swarm.subspace import initial_basis, project

D, K, V, SEQ = 64, 4, 256, 32


def small(compression: str = "subspace", weight_decay: float = 0.0, lr: float = 2e-3):
    return tiny_manifest(compression, optimizer=OptimizerSpec(lr=lr, weight_decay=weight_decay))


def _train(stages, optimizers, steps: int, seed: int = 0) -> list[float]:
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        toks = torch.randint(0, 32, (2, SEQ), generator=generator)  # a small alphabet: learnable
        hidden = None
        for stage in stages:
            hidden = stage(hidden, toks)
        loss = next_token_loss(hidden, toks)
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _head_residual(stages) -> float:
    return stages[0].subspace_residual()


@pytest.mark.parametrize("compression", ["subspace", "boundary"])
def test_subspace_adamw_stays_in_span_for_200_steps(compression):
    stages = build_stages(small(compression, weight_decay=0.1))
    optimizers = [make_optimizer(stage) for stage in stages]
    start = [p.detach().clone() for p in stages[0].parameters()]
    losses = _train(stages, optimizers, 200)
    assert _head_residual(stages) < 1e-6
    # the weights really moved and the model learned
    pairs = zip(stages[0].parameters(), start, strict=True)
    moved = max((p - s).norm().item() / s.norm().item() for p, s in pairs)
    assert moved > 0.1
    assert sum(losses[-20:]) / 20 < sum(losses[:20]) / 20 - 0.5


def test_plain_adamw_leaves_span():
    """The gradients are projected either way (hooks); AdamW's per-element second moment breaks span(U)."""
    stages = build_stages(small("subspace"))
    spec = stages[0].manifest.optimizer
    optimizers = [torch.optim.AdamW(stage.parameters(), lr=spec.lr, betas=(spec.beta1, spec.beta2),
                                    eps=spec.eps, weight_decay=spec.weight_decay) for stage in stages]
    _train(stages, optimizers, 200)
    assert _head_residual(stages) > 1e-3


def test_subspace_unaware_groups_also_leave_span():
    stages = build_stages(small("subspace"))
    optimizers = [make_optimizer(stage, subspace_aware=False) for stage in stages]
    assert all(g["subspace_axis"] is None for g in optimizers[0].param_groups)
    _train(stages, optimizers, 30)
    assert _head_residual(stages) > 1e-3


def test_parameter_groups():
    head, tail = build_stages(small("subspace"))
    groups = {g["subspace_axis"]: g["params"] for g in parameter_groups(head)}
    assert set(groups) == {0, 1, None}
    assert [p is head.t_s for p in groups[1]] == [True]
    assert len(head.layers) == 1
    assert {id(p) for p in groups[0]} == {id(head.layers[0].attn.wo.weight), id(head.layers[0].mlp.w2.weight)}
    total = sum(len(v) for v in groups.values())
    assert total == len(list(head.parameters()))
    assert [g["subspace_axis"] for g in parameter_groups(tail)] == [None]


def test_second_moment_is_constant_along_d():
    head = build_stages(small("subspace"))[0]
    optimizer = make_optimizer(head)
    toks = torch.randint(0, V, (2, SEQ))
    (head(None, toks).pow(2).mean()).backward()
    optimizer.step()
    assert optimizer.state[head.t_s]["exp_avg_sq"].shape == (V, 1)
    assert optimizer.state[head.layers[0].attn.wo.weight]["exp_avg_sq"].shape == (1, D)
    wq = head.layers[0].attn.wq.weight
    assert optimizer.state[wq]["exp_avg_sq"].shape == wq.shape


def test_constrained_group_projects_raw_gradients_itself():
    """No hooks here: the optimizer must project the gradient and keep the tensor in span(U)."""
    basis = initial_basis(0, D, K)
    weight = torch.nn.Parameter(project(torch.randn(D, 16).T, basis).T.contiguous())
    assert (weight - basis @ (basis.T @ weight)).norm() < 1e-5
    optimizer = SubspaceAdamW([{"params": [weight], "subspace_axis": 0}],
                              projector=lambda t, axis: basis @ (basis.T @ t), lr=0.1, weight_decay=0.5)
    for _ in range(10):
        weight.grad = torch.randn(D, 16)
        optimizer.step()
    residual = (weight - basis @ (basis.T @ weight)).norm() / weight.norm()
    assert residual < 1e-6


def test_constrained_group_needs_projector():
    with pytest.raises(ValueError, match="projector"):
        SubspaceAdamW([{"params": [torch.nn.Parameter(torch.zeros(3))], "subspace_axis": 0}])


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_plain_group_matches_torch_adamw(weight_decay):
    torch.manual_seed(0)
    ours = torch.nn.Parameter(torch.randn(8, 5))
    theirs = torch.nn.Parameter(ours.detach().clone())
    start = ours.detach().clone()
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    opt_ours = SubspaceAdamW([ours], **kwargs)
    opt_theirs = torch.optim.AdamW([theirs], **kwargs)
    for _ in range(6):
        grad = torch.randn(8, 5)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt_ours.step()
        opt_theirs.step()
    assert (ours - theirs).abs().max().item() < 1e-6
    assert (ours - start).abs().max().item() > 1e-2  # they moved, together


def test_weight_decay_keeps_span_and_shrinks():
    stages = build_stages(small("subspace", weight_decay=0.0))
    head = stages[0]
    decayed = make_optimizer(head, params=[dict(g, weight_decay=0.5) for g in parameter_groups(head)])
    t_s_before = head.t_s.norm().item()
    for _ in range(5):
        for item in head.constrained:
            item.param.grad = torch.zeros_like(item.param)  # decay alone
        decayed.step()
    assert head.subspace_residual() < 1e-6
    assert head.t_s.norm().item() == pytest.approx(t_s_before * (1 - 2e-3 * 0.5) ** 5, rel=1e-4)


def test_state_dict_round_trip_continues_identically():
    a = build_stages(small("subspace", weight_decay=0.1))
    opt_a = [make_optimizer(stage) for stage in a]
    _train(a, opt_a, 5, seed=1)
    saved_weights = [copy.deepcopy(stage.state_dict()) for stage in a]
    saved_optim = [copy.deepcopy(opt.state_dict()) for opt in opt_a]

    b = build_stages(small("subspace", weight_decay=0.1))
    for stage, weights in zip(b, saved_weights, strict=True):
        stage.load_state_dict(weights)
    opt_b = [make_optimizer(stage) for stage in b]
    for opt, state in zip(opt_b, saved_optim, strict=True):
        opt.load_state_dict(state)
    assert opt_b[0].state[b[0].t_s]["exp_avg_sq"].shape == (V, 1)
    axes = [g["subspace_axis"] for g in opt_a[0].param_groups]
    assert [g["subspace_axis"] for g in opt_b[0].param_groups] == axes

    _train(a, opt_a, 3, seed=2)
    _train(b, opt_b, 3, seed=2)
    for sa, sb in zip(a, b, strict=True):
        for (name, pa), (_, pb) in zip(sa.named_parameters(), sb.named_parameters(), strict=True):
            assert torch.allclose(pa, pb, atol=1e-7, rtol=0), name
    assert opt_a[0].state[a[0].t_s]["step"].item() == opt_b[0].state[b[0].t_s]["step"].item() == 8


def test_state_dict_round_trip_differs_from_fresh_optimizer():
    """The round-trip test above could not pass by accident: a fresh optimizer ends elsewhere."""
    a = build_stages(small("subspace"))
    opt_a = [make_optimizer(stage) for stage in a]
    _train(a, opt_a, 5, seed=1)
    b = build_stages(small("subspace"))
    for sa, sb in zip(a, b, strict=True):
        sb.load_state_dict(sa.state_dict())
    opt_b = [make_optimizer(stage) for stage in b]
    _train(a, opt_a, 3, seed=2)
    _train(b, opt_b, 3, seed=2)
    assert not torch.allclose(a[0].t_s, b[0].t_s, atol=1e-6)


def test_reproject_state_follows_new_basis():
    stages = build_stages(small("subspace"))
    optimizers = [make_optimizer(stage) for stage in stages]
    _train(stages, optimizers, 2)
    head = stages[0]
    head.subspace.set_basis(initial_basis(5, D, K), 1)
    optimizers[0].reproject_state()
    head.reproject_()
    for item in head.constrained:
        exp_avg = optimizers[0].state[item.param]["exp_avg"]
        assert (exp_avg - head.subspace.project(exp_avg, item.axis)).norm() <= 1e-5 * exp_avg.norm()
    _train(stages, optimizers, 3)
    assert head.subspace_residual() < 1e-6


def test_lr_schedule():
    assert lr_at(0, 1.0, 10) == pytest.approx(0.1)
    assert lr_at(9, 1.0, 10) == pytest.approx(1.0)
    assert lr_at(50, 1.0, 10) == 1.0
    assert lr_at(0, 0.5, 0) == 0.5


def test_clip_grad_norm():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    a.grad, b.grad = torch.full((3,), 3.0), torch.full((4,), 4.0)
    total = clip_grad_norm([a, b], max_norm=1.0)
    assert total == pytest.approx((27 + 64) ** 0.5)
    assert torch.cat([a.grad, b.grad]).norm().item() == pytest.approx(1.0, rel=1e-4)
    assert clip_grad_norm([a, b], max_norm=10.0) == pytest.approx(1.0, rel=1e-4)  # below: untouched
    assert torch.cat([a.grad, b.grad]).norm().item() == pytest.approx(1.0, rel=1e-4)
    assert clip_grad_norm([torch.nn.Parameter(torch.zeros(2))], 1.0) == 0.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 3.3e38])
def test_clip_grad_norm_never_passes_non_finite_through(bad):
    """A NaN norm compared `> max_norm` is False: the old clip let NaN gradients through silently.
    Now the non-finite norm is returned for the caller to refuse, and the gradients are not scaled
    (scaling an inf by max_norm/inf would have turned it into NaN)."""
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    a.grad, b.grad = torch.full((3,), 3.0), torch.full((4,), 4.0)
    b.grad[1] = bad  # 3.3e38 is finite, but its square overflows float32
    before = [a.grad.clone(), b.grad.clone()]
    total = clip_grad_norm([a, b], max_norm=1.0)
    assert not math.isfinite(total)
    assert math.isnan(total) == math.isnan(bad)
    assert torch.equal(a.grad, before[0])  # left as they were: the caller refuses them
    assert torch.equal(b.grad[[0, 2, 3]], before[1][[0, 2, 3]])
    assert not math.isfinite(grad_norm([a, b]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 3.3e38])
def test_subspace_adamw_skips_a_step_with_non_finite_gradients(bad):
    """Gradients averaged with other peers reach the optimizer directly: one NaN must move nothing."""
    stages = build_stages(small())
    optimizer = make_optimizer(stages[0])
    toks = torch.randint(0, 32, (2, SEQ), generator=torch.Generator().manual_seed(0))
    next_token_loss(stages[1](stages[0](None, toks), toks), toks).backward()
    optimizer.step()  # a first, finite step: moments exist
    optimizer.zero_grad(set_to_none=True)
    next_token_loss(stages[1](stages[0](None, toks), toks), toks).backward()
    params = [p.detach().clone() for p in stages[0].parameters()]
    moments = copy.deepcopy(optimizer.state_dict()["state"])
    stages[0].layers[0].mlp.w1.weight.grad[0, 0] = bad
    optimizer.step()
    assert optimizer.skipped_steps == 1
    assert all(torch.equal(p, q) for p, q in zip(stages[0].parameters(), params, strict=True))
    after = optimizer.state_dict()["state"]
    assert all(torch.equal(after[i][key], moments[i][key]) for i in moments for key in moments[i])
    stages[0].layers[0].mlp.w1.weight.grad[0, 0] = 0.0  # the same step with finite gradients moves
    optimizer.step()
    assert optimizer.skipped_steps == 1
    assert not all(torch.equal(p, q) for p, q in zip(stages[0].parameters(), params, strict=True))
