"""A served optimizer state is loaded only in our own layout, with the run's hyperparameters (and our learning
rate) and moments Adam can produce (`swarm/optimizer_state.py`, `peer/state_load.py`)."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from builders import tiny_manifest
from hivemind.optim.state_averager import dump_optimizer_state, load_optimizer_state
from hivemind.utils.nested import nested_pack

from peer.state_load import VerifiedStateLoad, _metadata_of
from swarm.manifest import OptimizerSpec
from swarm.model import PipelineStage
from swarm.optim import make_optimizer
from swarm.optimizer_state import canonical_leaves, moment_bound_squared, optimizer_state_refusal


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
    leaves = canonical_leaves(dump_optimizer_state(opt)[0], metadata, tensors)
    return optimizer_state_refusal(ours, nested_pack(leaves, structure=ours))


def _fits(opt: torch.optim.Optimizer, metadata: list, tensors: list[torch.Tensor]) -> tuple[bool, dict]:
    """`VerifiedStateLoad._optimizer_state_fits` on a served state (an averager of `opt` with no parameters)."""
    averager = SimpleNamespace(main_parameters=[], extra_tensors=[])
    served, ours = {"optimizer_metadata": metadata}, opt.state_dict()
    return VerifiedStateLoad._optimizer_state_fits(averager, served, tensors, "donor", ours, _metadata_of(ours)), served


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


def test_a_state_not_in_our_layout_is_refused_never_raised():
    # a tensor where a value belongs (it made the comparison raise, and hivemind retried the load for ever), one
    # moment named twice or in another parameter's place (shared tensors broke the optimizer for good)
    _, opt = _trained()
    metadata, tensors = _served(opt)
    slots = [i for i, entry in enumerate(metadata) if entry["type"] == "tensor"]
    values = [i for i, entry in enumerate(metadata) if entry["type"] == "value"]
    swapped = copy.deepcopy(metadata)
    swapped[slots[0]]["index"], swapped[slots[1]]["index"] = metadata[slots[1]]["index"], metadata[slots[0]]["index"]
    shared = copy.deepcopy(metadata)
    shared[slots[1]]["index"] = metadata[slots[0]]["index"]
    tensor_value = copy.deepcopy(metadata)
    tensor_value[values[0]] = {"type": "tensor", "index": 1}
    boxed = copy.deepcopy(metadata)
    boxed[values[0]] = {"type": "value", "value": torch.ones(1)}
    flag = copy.deepcopy(metadata)
    flag[slots[0]]["index"] = True if metadata[slots[0]]["index"] == 1 else metadata[slots[0]]["index"] + 0.0
    for name, bad in {"none": None, "text": "x", "short": metadata[:-1], "long": metadata + [metadata[-1]],
                      "swapped": swapped, "shared": shared, "tensor as a value": tensor_value,
                      "a value that is a tensor": boxed, "index not an int": flag,
                      "not an entry": [None] + metadata[1:]}.items():
        assert _fits(opt, bad, tensors)[0] is False, name
        with pytest.raises(ValueError):
            canonical_leaves(dump_optimizer_state(opt)[0], bad, tensors)


def test_a_state_that_fits_is_loaded_with_our_values_and_learning_rate():
    _, ours = _trained(steps=3, seed=2)
    _, donor = _trained(steps=12, seed=1)
    for group in donor.param_groups:
        group["lr"] = 1e6  # honest moments, a learning rate that would wreck one step
    metadata, tensors = _served(donor)
    fits, served = _fits(ours, metadata, tensors)
    assert fits and served["optimizer_metadata"] == dump_optimizer_state(ours)[0]
    own_lrs = [group["lr"] for group in ours.param_groups]
    load_optimizer_state(ours, served["optimizer_metadata"], tensors)  # what hivemind then does
    assert [group["lr"] for group in ours.param_groups] == own_lrs
    assert torch.equal(ours.state_dict()["state"][0]["exp_avg"], donor.state_dict()["state"][0]["exp_avg"])


def test_the_run_must_have_bounded_moments():
    assert OptimizerSpec(beta1=0.9, beta2=0.999) and OptimizerSpec(beta1=0.0, beta2=0.01)
    for beta1, beta2 in ((0.9, 0.8), (0.5, 0.0), (0.99, 0.95)):
        with pytest.raises(ValueError, match="beta1"):
            OptimizerSpec(beta1=beta1, beta2=beta2)
