"""A stage's last finite state, kept so that a non-finite one can be put back (issue 12).

Averaging with a hostile fellow peer, a download or a checkpoint can bring NaN or inf into a
stage's parameters or optimizer moments without any trip. `StageRuntime` checks after every
optimizer call and every load; when the state is not finite, the copy kept at the previous epoch
boundary (in CPU memory: parameters and Adam moments) is restored, re-projected onto the current U.
Every refusal is counted and the counts are logged at most once a minute, so an attacker cannot
fill the log.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import torch

from swarm.model import PipelineStage

logger = logging.getLogger("peer.runtime")


def _copy(value, device):
    return value.detach().to(device, copy=True) if torch.is_tensor(value) else value


class FiniteStateGuard:
    def __init__(self, stage: PipelineStage, optimizer, device: torch.device, label: str):
        """`optimizer` is the stage's hivemind Optimizer: its `.opt` holds the moments and its state
        averager's lock keeps a joiner from downloading a half-restored state."""
        self.stage, self.optimizer, self.device, self.label = stage, optimizer, device, label
        self.refused_updates: Counter[str] = Counter()  # why microbatches or states were refused, ever
        self._unreported: Counter[str] = Counter()
        self._report_at = 0.0
        self._finite_state: tuple[list[torch.Tensor], list[dict]] | None = None

    def moments(self) -> list[dict]:
        """The optimizer's per-parameter state, in the order of `stage.parameters()`."""
        state = self.optimizer.opt.state
        return [state.get(param, {}) for param in self.stage.parameters()]

    def is_finite(self) -> bool:
        """Whether parameters and moments are all finite (min and max propagate NaN and show inf:
        two reductions per tensor, ~7x cheaper than `isfinite` on CPU)."""
        tensors = list(self.stage.parameters())
        tensors += [v for moments in self.moments() for v in moments.values() if torch.is_tensor(v)]
        with torch.no_grad():
            extremes = [x.to(self.device, torch.float32) for t in tensors if t.numel() for x in torch.aminmax(t)]
            return bool(torch.isfinite(torch.stack(extremes)).all())

    def keep(self) -> None:
        """Copy parameters and moments to CPU memory, if they are finite: what a restore puts back."""
        if not self.is_finite():
            return
        with torch.no_grad(), self.optimizer.state_averager.lock_optimizer:
            params = [p.detach().to("cpu", copy=True) for p in self.stage.parameters()]
            moments = [{k: _copy(v, "cpu") for k, v in m.items()} for m in self.moments()]
        self._finite_state = (params, moments)

    def restore(self, why: str) -> None:
        """Put back the last finite parameters and moments (re-projected onto the current U)."""
        self.report(why)
        if self._finite_state is None:  # cannot happen: the initial state is finite
            raise RuntimeError(f"{self.label} parameters are not finite and no finite state was kept")
        params, moments = self._finite_state
        state = self.optimizer.opt.state
        with torch.no_grad(), self.optimizer.state_averager.lock_optimizer:
            for param, saved, saved_moments in zip(self.stage.parameters(), params, moments, strict=True):
                param.copy_(saved)
                devices = {k: v.device for k, v in state.get(param, {}).items() if torch.is_tensor(v)}
                state.pop(param, None)
                if saved_moments:
                    state[param] = {k: _copy(v, devices.get(k, param.device)) for k, v in saved_moments.items()}
            # U may have switched since the copy: constrained tensors go back into the current span(U)
            self.stage.reproject_()
            if hasattr(self.optimizer.opt, "reproject_state"):
                self.optimizer.opt.reproject_state()

    def report(self, what: str) -> None:
        """Count a refusal; log the counts at most once a minute (an attacker must not fill the log)."""
        self.refused_updates[what] += 1
        self._unreported[what] += 1
        now = time.monotonic()
        if now >= self._report_at:
            counts = ", ".join(f"{n}× {reason}" for reason, n in sorted(self._unreported.items()))
            logger.warning("%s refused non-finite updates: %s", self.label, counts)
            self._unreported.clear()
            self._report_at = now + 60.0
