"""A served optimizer state is loaded only with the run's hyperparameters and moments Adam can produce
(`swarm/optimizer_state.py`, `peer/state_load.py packed_optimizer_state`)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from builders import tiny_manifest
from hivemind.optim.state_averager import dump_optimizer_state

from peer.state_load import packed_optimizer_state
from swarm.live_state import LiveStateError
from swarm.model import PipelineStage
from swarm.optim import make_optimizer
from swarm.optimizer_state import moment_bound_squared, optimizer_state_refusal


def _trained(steps: int = 12, seed: int = 0) -> tuple[PipelineStage, torch.optim.Optimizer]:
    """A stage whose optimizer took `steps` steps of gradients that change scale and sign (a hard case for the
    bound: a burst of large same-sign gradients after small ones), including a U switch's re-projection."""
    torch.manual_seed(seed)
    stage = PipelineStage(tiny_manifest("subspace", n_layers=2, stages=2), 0)
    opt = make_optimizer(stage)
    for step in range(steps):
        for param in stage.parameters():
            scale = 10.0 if step >= steps - 3 else 0.01
            param.grad = torch.randn_like(param) * scale
        opt.step()
        if step == steps // 2:
            opt.reproject_state()
    return stage, opt


def _served(opt: torch.optim.Optimizer) -> tuple[list, list[torch.Tensor]]:
    """What a donor streams of its optimizer (hivemind's format)."""
    metadata, tensors = dump_optimizer_state(opt)
    return copy.deepcopy(metadata), [t.clone() for t in tensors]


def _refusal(opt: torch.optim.Optimizer, metadata: list, tensors: list[torch.Tensor]) -> str | None:
    ours = opt.state_dict()
    return optimizer_state_refusal(ours, packed_optimizer_state(ours, metadata, tensors))


def _tensor_of(metadata: list, tensors: list[torch.Tensor], opt, param: int, key: str) -> torch.Tensor:
    """The served tensor that is state[param][key] (found by identity in the donor's own state dict)."""
    target = opt.state_dict()["state"][param][key]
    flat = dump_optimizer_state(opt)[1]
    index = next(i for i, t in enumerate(flat) if torch.equal(t, target) and t.shape == target.shape)
    return tensors[index]


def test_an_honest_state_passes_with_another_peers_learning_rate_and_step_count():
    _, donor = _trained(steps=12, seed=1)
    _, ours = _trained(steps=3, seed=2)
    for group in donor.param_groups:
        group["lr"] *= 0.37  # the donor is at another epoch of the schedule
    assert _refusal(ours, *_served(donor)) is None


@pytest.mark.parametrize("key,value", [("weight_decay", 100.0), ("eps", 1e-30), ("subspace_axis", None),
                                       ("betas", (0.0, 0.0))])
def test_a_state_with_other_hyperparameters_is_refused(key, value):
    _, opt = _trained()
    hostile = copy.deepcopy(opt)
    group = next(g for g in hostile.param_groups if g["subspace_axis"] is not None)
    group[key] = value
    why = _refusal(opt, *_served(hostile))
    assert why is not None and key in why


def test_moments_adam_cannot_produce_are_refused():
    _, opt = _trained()
    cases = {
        "first moment ×10": lambda t: t["exp_avg"].mul_(10),
        "second moment shrunk": lambda t: t["exp_avg_sq"].mul_(1e-4),
        "second moment negative": lambda t: t["exp_avg_sq"].neg_(),
        "non-finite": lambda t: t["exp_avg"].view(-1)[0].fill_(math.inf),
        "fractional step": lambda t: t["step"].fill_(2.5),
        "no step": lambda t: t["step"].fill_(0),
    }
    for name, hurt in cases.items():
        metadata, tensors = _served(opt)
        picked = {key: _tensor_of(metadata, tensors, opt, 0, key) for key in ("exp_avg", "exp_avg_sq", "step")}
        hurt(picked)
        assert _refusal(opt, metadata, tensors) is not None, name


def test_the_moment_bound_is_tight_enough_to_matter():
    # a first moment just inside the bound passes, just outside it does not: the tolerance is float slack only
    _, opt = _trained()
    state = opt.state_dict()["state"][0]
    beta1, beta2 = opt.param_groups[0]["betas"]
    steps = int(state["step"])
    per_slice = state["exp_avg"].numel() // state["exp_avg_sq"].numel()
    bound = math.sqrt(moment_bound_squared(beta1, beta2, steps) * per_slice)
    for factor, refused in ((0.99, False), (1.01, True)):
        metadata, tensors = _served(opt)
        m, v = (_tensor_of(metadata, tensors, opt, 0, key) for key in ("exp_avg", "exp_avg_sq"))
        # every slice of m exactly `factor` times the largest norm its second moment allows
        direction = torch.randn_like(m)
        slice_norm = (direction * direction).sum_to_size(v.shape).sqrt()
        m.copy_(direction / slice_norm * v.sqrt() * bound * factor)
        assert (_refusal(opt, metadata, tensors) is not None) == refused, factor
    # after many steps the bound approaches its limit, ≈1.2 times √v at the default betas
    assert 1.1 < math.sqrt(moment_bound_squared(0.9, 0.95, 10_000)) < 1.2


def test_a_malformed_served_state_is_an_error_not_a_crash():
    _, opt = _trained()
    ours = opt.state_dict()
    metadata, tensors = _served(opt)
    far, flag = {"type": "tensor", "index": 10**6}, {"type": "tensor", "index": True}
    for bad in (None, "x", metadata[:-1], metadata + [{"type": "value", "value": 1}],
                [far] + metadata[1:], [flag] + metadata[1:]):
        with pytest.raises(LiveStateError):
            packed_optimizer_state(ours, bad, tensors)
