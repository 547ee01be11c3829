"""`none`: the dense baseline, the same model unconstrained, full activations on the wire (bf16, fp32,
or per-token absmax int8 as SWARM does). Nothing is constrained or projected, and U never moves."""

from __future__ import annotations

from typing import TYPE_CHECKING

from swarm.modes.base import CompressionMode, ConstrainedParameter

if TYPE_CHECKING:
    from swarm.model import PipelineStage


class DenseMode(CompressionMode):
    name = "none"
    compressed = False

    def constrained(self, stage: PipelineStage) -> list[ConstrainedParameter]:
        return []
