"""The compression modes, by the name a manifest gives (`compression`). A new mode is one module in
this package and its entry here (an import and a line in `MODES`); `DEFAULT` is the mode a manifest
gets when it names none."""

from __future__ import annotations

from swarm.modes.base import CompressionMode, ConstrainedParameter
from swarm.modes.boundary import BoundaryMode
from swarm.modes.boundary_free_ts import BoundaryFreeEmbeddingMode
from swarm.modes.dense import DenseMode
from swarm.modes.dense_ts import DenseConstrainedEmbeddingMode
from swarm.modes.subspace import SubspaceMode

MODES: dict[str, CompressionMode] = {
    mode.name: mode
    for mode in (
        SubspaceMode(),
        BoundaryMode(),
        DenseMode(),
        DenseConstrainedEmbeddingMode(),
        BoundaryFreeEmbeddingMode(),
    )
}
DEFAULT = "boundary"

__all__ = ["DEFAULT", "MODES", "CompressionMode", "ConstrainedParameter"]
