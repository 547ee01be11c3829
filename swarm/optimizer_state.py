"""Whether an optimizer state another peer served can be this stage's (issue 26).

A peer that joins or falls behind takes a stage's state from another peer: its parameters, which the stage's
records vouch for (`peer/state_load.py`), and its optimizer state, which no record hashes (replicas' moments
differ: only parameters are averaged). hivemind's format for it is a flat list (`dump_optimizer_state`): one
entry per leaf of `state_dict()`, either a plain value or the index of a tensor streamed beside it, and hivemind
loads it with `load_state_dict`. A hostile donor could hand us hyperparameters (a weight decay of 100, an eps of
1e-30, a constrained group without its `subspace_axis`, which lets the tensor leave span(U), a learning rate of
1e6 or a tensor in its place), point several moments at one tensor or at another parameter's, and send moments
of its choosing. So a served state is taken only in the canonical form, and what it carries is checked:

- its entries are ours one for one: the k-th tensor entry names tensor k (the stream already forced every
  tensor's dtype and shape to ours), every other entry is a plain value (`canonical_leaves`);
- every hyperparameter but the learning rate equals ours, and the learning rate is not taken at all: the
  state is loaded with our own values (`optimizer_state_refusal` checks, the caller substitutes), and the
  schedule moves ours to the loaded epoch;
- each parameter's step count is a whole number ≥ 1 and its second moment is finite and ≥ 0;
- each first moment lies within what Adam's own recurrences allow of its second moment. With
  m = (1-β1) Σ β1^k g_k and v = (1-β2) Σ β2^k g_k² over t steps, Cauchy-Schwarz gives
  m² ≤ (1-β1)²/(1-β2) · Σ_{k<t} (β1²/β2)^k · v, a bound that stays finite as t grows because the manifest
  requires β1² < β2. A constrained tensor's second moment is the mean of g² over a slice of n elements
  (`SubspaceAdamW`), and projecting the first moment onto span(U) only shrinks the slice, so there the
  slice's Σ m² ≤ the same factor times n·v.

So the first step after a load moves a weight (a constrained slice: its root mean square) by at most the
learning rate times sup_t √(B(t)(1-β2^t))/(1-β1^t) — 1.17 at the default betas (0.9, 0.95), 7.3 at (0.9, 0.999)
— as an honest state's can. Not caught: honest-looking moments that point a chosen way, or a second moment
inflated to slow the stage, until Adam's averages forget them (tens of steps).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

SCHEDULED = frozenset({"lr"})  # set by the learning-rate schedule; a loaded state keeps ours
TOLERANCE = 1e-3  # relative slack on the moment bound for float32 rounding of the recurrences
FLOOR = 1e-30  # absolute slack: where v underflows in float32, m² is below this


def canonical_leaves(ours: Sequence[object], served: object, tensors: Sequence[torch.Tensor]) -> list[object]:
    """The served flat metadata as leaves (values, and its tensors in place of their indices), if it is ours entry
    for entry: our k-th tensor entry is served as tensor k, each other entry as a plain value. Raises ValueError
    otherwise. `ours` is our own `dump_optimizer_state` metadata."""
    if not isinstance(served, list) or len(served) != len(ours):
        raise ValueError(f"{len(served) if isinstance(served, list) else 'no'} entries, ours has {len(ours)}")
    leaves = []
    for position, (own, entry) in enumerate(zip(ours, served, strict=True)):
        if not isinstance(entry, dict):
            raise ValueError(f"entry {position} is not an entry")
        if own["type"] == "tensor":
            if entry.get("type") != "tensor" or type(entry.get("index")) is not int or entry["index"] != own["index"]:
                raise ValueError(f"entry {position} is not tensor {own['index']}")
            leaves.append(tensors[own["index"]])
        elif entry.get("type") == "value" and "value" in entry and not isinstance(entry["value"], torch.Tensor):
            leaves.append(entry["value"])
        else:
            raise ValueError(f"entry {position} is not a plain value")
    return leaves


def moment_bound_squared(beta1: float, beta2: float, steps: int) -> float:
    """The largest m²/v Adam's recurrences allow after `steps` steps (the module docstring; β1² < β2)."""
    ratio = beta1 * beta1 / beta2
    return (1 - beta1) ** 2 / (1 - beta2) * (1 - ratio**steps) / (1 - ratio)


def optimizer_state_refusal(ours: dict, theirs: dict) -> str | None:
    """Why `theirs` (a served state dict, rebuilt from `canonical_leaves` into the structure of `ours`: the same
    parameters and state keys) cannot be loaded into our optimizer, or None if it can."""
    for index, (group, their_group) in enumerate(zip(ours["param_groups"], theirs["param_groups"], strict=True)):
        for key, value in group.items():
            if key not in SCHEDULED and (type(their_group[key]) is not type(value) or their_group[key] != value):
                return f"group {index}: {key} is {str(their_group[key])[:40]}, the run's is {value!r}"
    betas = {p: group["betas"] for group in ours["param_groups"] for p in group["params"]}
    for param, state in theirs["state"].items():
        why = _moments_refusal(state, *betas[param])
        if why is not None:
            return f"parameter {param}: {why}"
    return None


def _moments_refusal(state: dict, beta1: float, beta2: float) -> str | None:
    step, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
    steps = float(step)
    if not (math.isfinite(steps) and steps >= 1 and steps == int(steps)):
        return f"step count {steps} is not a whole number of steps"
    m, v = m.float(), v.float()
    if not (torch.isfinite(v).all() and (v >= 0).all() and torch.isfinite(m).all()):
        return "moments are not finite, or the second moment is negative"
    slice_sum = (m * m).sum_to_size(v.shape)  # a constrained tensor's slices share one second moment
    allowed = moment_bound_squared(beta1, beta2, int(steps)) * (m.numel() // v.numel()) * v
    if (slice_sum > allowed * (1 + TOLERANCE) + FLOOR).any():
        ratio = (slice_sum / allowed.clamp_min(FLOOR)).max().item()
        return f"first moment {math.sqrt(ratio):.3g}× what Adam allows of its second moment"
    return None
