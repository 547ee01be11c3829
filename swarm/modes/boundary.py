"""`boundary` (our variant): every non-tail stage ends by projecting the residual,
`x ← T_fixed[tok] + P (x − T_fixed[tok])`. The projection is part of the model, so one process
and the swarm compute the same function; layers stay full-rank with plain AdamW and only `T_S`
is constrained. With the gradient driver, U moves by the boundary terms: the sender's residual
that the projection removed and the receiver's coefficients against its input gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from swarm.modes.base import CompressionMode

if TYPE_CHECKING:
    from swarm.model import PipelineStage


class BoundaryMode(CompressionMode):
    name = "boundary"
    boundary_terms = True

    def projects_boundary(self, stage: PipelineStage) -> bool:
        return not stage.is_tail
