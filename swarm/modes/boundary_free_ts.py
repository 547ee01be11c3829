"""`boundary-free-ts`: the boundary projection with `T_S` free — the other half of the gap to dense
(issue 18).

Every non-tail stage ends with `boundary`'s projection `x ← T_fixed[tok] + P (x − T_fixed[tok])`,
which puts the output in `T_fixed[tok] + span(U)` whatever `T_S` holds, so k coefficients and the
token ids cross exactly as in `boundary`; only the constraint on `T_S` is dropped (it trains with
plain AdamW, full-rank). Against `none` it measures what the projection alone costs. U moves as in
`boundary`, by the boundary terms.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from swarm.modes.base import ConstrainedParameter
from swarm.modes.boundary import BoundaryMode

if TYPE_CHECKING:
    from swarm.model import PipelineStage


class BoundaryFreeEmbeddingMode(BoundaryMode):
    name = "boundary-free-ts"

    def constrained(self, stage: PipelineStage) -> list[ConstrainedParameter]:
        return []
