"""Whether an optimizer state another peer served can be this stage's (issue 26).

A peer that joins or falls behind takes a stage's state from another peer: its parameters, which the stage's
records vouch for (`peer/state_load.py`), and its optimizer state, which no record hashes (replicas' moments
differ: only parameters are averaged). hivemind loads the optimizer state with `load_state_dict`, so a hostile
donor could hand us hyperparameters (a weight decay of 100, an eps of 1e-30, a constrained group without its
`subspace_axis`, which lets the tensor leave span(U)) and moments of its choosing. What is checked here:

- every hyperparameter but the learning rate (the schedule sets that at every epoch) equals ours;
- each parameter's step count is a whole number ≥ 1 and its second moment is finite and ≥ 0;
- each first moment lies within what Adam's own recurrences allow of its second moment. With
  m = (1-β1) Σ β1^k g_k and v = (1-β2) Σ β2^k g_k² over t steps, Cauchy-Schwarz gives
  m² ≤ (1-β1)²/(1-β2) · Σ_{k<t} (β1²/β2)^k · v. A constrained tensor's second moment is the mean of g² over a
  slice of n elements (`SubspaceAdamW`), and projecting the first moment onto span(U) only shrinks the slice,
  so there the slice's Σ m² ≤ the same factor times n·v.

So the first step after a load moves each weight by at most the learning rate times that bound (≈1.2 at the
default betas), as an honest state's does. Not caught: honest-looking moments that point a chosen way or a
second moment inflated to slow the stage, until Adam's averages forget them (tens of steps).
"""

from __future__ import annotations

import math

import torch

SCHEDULED = frozenset({"lr"})  # set by the learning-rate schedule at every epoch, whatever was loaded
TOLERANCE = 1e-3  # relative slack on the moment bound for float32 rounding of the recurrences


def moment_bound_squared(beta1: float, beta2: float, steps: int) -> float:
    """The largest m²/v Adam's recurrences allow after `steps` steps (the module docstring)."""
    ratio = beta1 * beta1 / beta2
    terms = steps if ratio == 1 else (1 - ratio**steps) / (1 - ratio)
    return (1 - beta1) ** 2 / (1 - beta2) * terms


def optimizer_state_refusal(ours: dict, theirs: dict) -> str | None:
    """Why `theirs` (a state dict served by a peer, packed into the structure of `ours`: the same parameters and
    state keys) cannot be loaded into our optimizer, or None if it can."""
    for index, (group, their_group) in enumerate(zip(ours["param_groups"], theirs["param_groups"], strict=True)):
        for key, value in group.items():
            if key not in SCHEDULED and their_group.get(key) != value:
                return f"group {index}: {key} is {their_group.get(key)!r}, the run's is {value!r}"
    betas = {p: group["betas"] for group in ours["param_groups"] for p in group["params"]}
    for param, state in theirs["state"].items():
        why = _moments_refusal(state, *betas[param])
        if why is not None:
            return f"parameter {param}: {why}"
    return None


def _moments_refusal(state: dict, beta1: float, beta2: float) -> str | None:
    step, m, v = state.get("step"), state.get("exp_avg"), state.get("exp_avg_sq")
    if not all(isinstance(t, torch.Tensor) for t in (step, m, v)) or step.numel() != 1:
        return "step, first and second moment are not all tensors"
    steps = float(step)
    if not (math.isfinite(steps) and steps >= 1 and steps == int(steps)):
        return f"step count {steps} is not a whole number of steps"
    m, v = m.double(), v.double()
    if not (torch.isfinite(v).all() and (v >= 0).all() and torch.isfinite(m).all()):
        return "moments are not finite, or the second moment is negative"
    try:
        slice_sum = (m * m).sum_to_size(v.shape)  # a constrained tensor's slices share one second moment
    except RuntimeError:
        return f"first moment {tuple(m.shape)} does not fit second moment {tuple(v.shape)}"
    per_slice = m.numel() // max(v.numel(), 1)
    allowed = moment_bound_squared(beta1, beta2, int(steps)) * per_slice * v
    excess = slice_sum - allowed * (1 + TOLERANCE)
    if (excess > 1e-30).any():
        ratio = (slice_sum / allowed.clamp_min(1e-300)).max().item()
        return f"first moment {math.sqrt(ratio):.3g}× what Adam allows of its second moment"
    return None
