"""What a compression mode answers: the questions the model, the codec, the wire and the U agreement ask.

A mode says which tensors must stay in span(U), whether a stage ends by projecting its output,
what crosses a boundary (k coefficients per token, or the full residual), whether U can move,
and where ∂L/∂U has terms (the subspace driver decides which of them move U). Every wire dtype
carries either (int8 with a per-token absmax scale, `swarm/wire_dtype.py`). Nothing else in the
code looks at the mode's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from torch import nn

if TYPE_CHECKING:  # a mode is asked about a stage; it never builds one
    from swarm.model import PipelineStage


@dataclass(frozen=True)
class ConstrainedParameter:
    name: str
    param: nn.Parameter
    axis: int  # the axis of length d that must lie in span(U)


class CompressionMode:
    name: ClassVar[str]
    compressed: ClassVar[bool] = True  # k coefficients and the token ids cross a boundary, not the residual
    # where ∂L/∂U has terms, which the gradient driver accumulates (`swarm/subspace_update.py`): through the
    # constrained weights' gradients, and through the boundary activations and their gradients
    weight_terms: ClassVar[bool] = False
    boundary_terms: ClassVar[bool] = False

    def constrained(self, stage: PipelineStage) -> list[ConstrainedParameter]:
        """The tensors of `stage` kept in span(U): with more than one stage, the head's `T_S` rows (what lets
        the embedding's trainable part cross as coefficients), and what `constrained_weights` adds."""
        if stage.manifest.num_stages == 1:
            return []
        found = [ConstrainedParameter("t_s", stage.t_s, axis=1)] if stage.is_head else []
        return found + self.constrained_weights(stage)

    def constrained_weights(self, stage: PipelineStage) -> list[ConstrainedParameter]:
        return []

    def projects_boundary(self, stage: PipelineStage) -> bool:
        """Whether `stage` ends by projecting its output residual onto T_fixed[tok] + span(U)."""
        return False

    @property
    def moves_u(self) -> bool:
        """Whether U can move during the run (a mode that sends the full residual has nothing to move)."""
        return self.compressed

    def stage_has_gradient_terms(self, stage: int, num_stages: int) -> bool:
        """Whether `stage` holds any of the mode's ∂L/∂U terms (with the gradient driver, whether it contributes)."""
        return True
