"""AdamW that keeps constrained tensors in span(U) (DESIGN.md §2.5).

For a constrained tensor the second moment is one scalar per slice along the d axis (per column
of W in torch layout, per row of T_S), so each slice's update is a scalar times its projected
first moment and never leaves span(U). Decoupled weight decay scales the tensor, which also
stays in span(U). After the step the tensor is re-projected to wash out float drift. Groups
without `subspace_axis` get plain AdamW.

A step whose gradients are not finite is skipped whole (no parameter or moment moves): in a swarm
the gradients a step applies may be an average with other peers', and one NaN there would make
every weight NaN for good. Finite gradients whose squares are finite keep Adam's moments finite
(a convex combination of finite values), so finite parameters stay finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from swarm.model import PipelineStage

Projector = Callable[[torch.Tensor, int], torch.Tensor]


class SubspaceAdamW(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable,
        projector: Projector | None = None,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, subspace_axis=None)
        super().__init__(params, defaults)
        if projector is None and any(g["subspace_axis"] is not None for g in self.param_groups):
            raise ValueError("constrained parameter groups need a projector")
        self.projector = projector
        self.skipped_steps = 0  # steps refused because their gradients were not finite

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for group in self.param_groups for p in group["params"]]
        if not math.isfinite(grad_norm(params)):
            self.skipped_steps += 1
            return loss
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            axis = group["subspace_axis"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                if axis is not None:
                    grad = self.projector(grad, axis)
                state = self.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param)
                    shape = list(param.shape)
                    if axis is not None:
                        shape[axis] = 1
                    state["exp_avg_sq"] = torch.zeros(shape, dtype=param.dtype, device=param.device)
                state["step"] += 1
                step = state["step"].item()
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.lerp_(grad, 1 - beta1)
                squared = grad * grad
                if axis is not None:
                    squared = squared.mean(dim=axis, keepdim=True)
                exp_avg_sq.mul_(beta2).add_(squared, alpha=1 - beta2)
                bias1 = 1 - beta1**step
                bias2 = 1 - beta2**step
                denom = (exp_avg_sq / bias2).sqrt_().add_(group["eps"])
                if group["weight_decay"]:
                    param.mul_(1 - group["lr"] * group["weight_decay"])
                param.addcdiv_(exp_avg, denom, value=-group["lr"] / bias1)
                if axis is not None:
                    param.copy_(self.projector(param, axis))
        return loss

    def reproject_state(self) -> None:
        """After U moves, first moments of constrained tensors must follow it into span(U')."""
        with torch.no_grad():
            for group in self.param_groups:
                axis = group["subspace_axis"]
                if axis is None:
                    continue
                for param in group["params"]:
                    state = self.state.get(param)
                    if state:
                        state["exp_avg"].copy_(self.projector(state["exp_avg"], axis))


def parameter_groups(stage: PipelineStage, subspace_aware: bool = True) -> list[dict]:
    """Constrained tensors grouped by their d axis, everything else in one plain group.

    With `subspace_aware=False` every tensor goes to plain AdamW (the ablation that shows why the
    special second moment is needed).
    """
    constrained = {id(item.param): item.axis for item in stage.constrained} if subspace_aware else {}
    by_axis: dict[int | None, list[torch.nn.Parameter]] = {}
    for param in stage.parameters():
        if param.requires_grad:
            by_axis.setdefault(constrained.get(id(param)), []).append(param)
    # ordered by the axis's text (None after the numbers), which fixes the order the state averager sends them in
    ordered = sorted(by_axis.items(), key=lambda item: str(item[0]))
    return [{"params": params, "subspace_axis": axis} for axis, params in ordered]


def make_optimizer(stage: PipelineStage, params: Iterable | None = None, subspace_aware: bool = True) -> SubspaceAdamW:
    spec = stage.manifest.optimizer
    return SubspaceAdamW(
        parameter_groups(stage, subspace_aware) if params is None else params,
        projector=stage.subspace.project,
        lr=spec.lr,
        betas=(spec.beta1, spec.beta2),
        eps=spec.eps,
        weight_decay=spec.weight_decay,
    )


def lr_at(step: int, base_lr: float, warmup_steps: int) -> float:
    """Linear warm-up, then constant: runs have no fixed length, so no decay schedule."""
    if warmup_steps and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    return base_lr


def _norm(grads: list[torch.Tensor]) -> float:
    """Each tensor's sum of squares in float32 (inf when a square overflows), summed in float64 on the
    gradients' device: one device-to-host copy per call, not one per parameter (each is a GPU sync)."""
    if not grads:
        return 0.0
    squares = torch.stack([g.float().pow(2).sum() for g in grads])
    return math.sqrt(float(squares.double().sum()))


def grad_norm(parameters: Iterable[torch.nn.Parameter]) -> float:
    """L2 norm of all gradients together: NaN if one is NaN, inf if one is infinite or a square
    overflows float32 (so a finite result means every gradient and its square are finite)."""
    return _norm([p.grad for p in parameters if p.grad is not None])


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """Scale gradients down to `max_norm` and return their norm before clipping.

    A non-finite norm (NaN or inf, see `grad_norm`) is returned as it is and the gradients are left
    untouched: scaling cannot repair them, so the caller must refuse them (and never step on them).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    total = _norm(grads)
    if not math.isfinite(total):
        return total
    if max_norm and total > max_norm:
        for g in grads:
            g.mul_(max_norm / (total + 1e-6))
    return total
