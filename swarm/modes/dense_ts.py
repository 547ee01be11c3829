"""`dense-ts`: the dense wire with only `T_S` constrained — one half of the gap to dense (issue 18).

The head's `T_S` rows are kept in span(U) as in `boundary` (same hooks, same per-row second moment
in `swarm/optim.py`), but no stage projects its output, so the layers' full-rank output makes the
boundary residual leave `T_fixed[tok] + span(U)`: the full residual crosses (bf16, fp32, or int8
like `none`), and U has nothing to carry, so it never moves. Against `none` it measures what
constraining the embedding alone costs; against `boundary`, what the projection adds on top.
"""

from __future__ import annotations

from swarm.modes.base import CompressionMode


class DenseConstrainedEmbeddingMode(CompressionMode):
    name = "dense-ts"
    compressed = False
