"""`subspace` (the Protocol Models paper, arXiv 2506.01260): `W_o`, `W_down` of every layer upstream
of the last boundary and `T_S` are constrained to span(U). Gradient hooks project them, and
`swarm/optim.py`'s AdamW keeps one second-moment scalar per column (per row of `T_S`) so every
update stays in span(U). With the gradient driver, U moves by the constrained weights' gradients,
which the tail, holding none, does not contribute to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from swarm.modes.base import CompressionMode, ConstrainedParameter

if TYPE_CHECKING:
    from swarm.model import PipelineStage


class SubspaceMode(CompressionMode):
    name = "subspace"
    weight_terms = True

    def constrained_weights(self, stage: PipelineStage) -> list[ConstrainedParameter]:
        if stage.is_tail:
            return []
        found = []
        for i, block in enumerate(stage.layers):
            found.append(ConstrainedParameter(f"layers.{i}.attn.wo.weight", block.attn.wo.weight, axis=0))
            found.append(ConstrainedParameter(f"layers.{i}.mlp.w2.weight", block.mlp.w2.weight, axis=0))
        return found

    def stage_has_gradient_terms(self, stage: int, num_stages: int) -> bool:
        return stage < num_stages - 1
