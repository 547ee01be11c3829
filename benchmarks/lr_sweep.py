"""The rule by which every learning-rate sweep in `benchmarks/` picks its best learning rate.

One rule, so that the context-parallel table and the frontier compare points the same way: among the
learning rates run with as many seeds as the most complete one (a failed run is left out, so its lr has
fewer seeds, and a mean over other seeds would not be comparable), the lowest mean validation loss wins;
a non-finite loss (a diverged run) counts as +inf. The lr is picked on the validation batches whose loss
is reported, which flatters every point a little, compressed and dense alike.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence


def mean_loss(losses: Sequence[float]) -> float:
    """The mean, or +inf when any run diverged."""
    return statistics.fmean(losses) if all(math.isfinite(x) for x in losses) else math.inf


def best_lr(losses_by_lr: Mapping[float, Sequence[float]]) -> float:
    """The best learning rate of one point; `losses_by_lr` maps each lr tried to its runs' losses."""
    most = max(len(losses) for losses in losses_by_lr.values())
    complete = [lr for lr, losses in losses_by_lr.items() if len(losses) == most]
    return min(complete, key=lambda lr: mean_loss(losses_by_lr[lr]))
