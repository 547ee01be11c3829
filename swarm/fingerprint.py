"""A few numbers that say how far two replicas' weights are apart, without sending the weights.

Every replica of a stage should hold the same weights at the same epoch (the audits compare their replies on that
premise, `peer/audit.py`), but a stage's peers average in whatever groups form (`peer/stage_optimizer.py`), so they
may drift apart. To measure that from the peers' logs, each peer logs a fingerprint of its weights: a fixed random
projection of a fixed sample of their values (the same sample and projection on every peer of a run, from `seed`).
The distance between two fingerprints, over the norm of one, estimates the relative distance of the two weight
vectors (Johnson–Lindenstrauss: with `dims` directions, to within about 1/√`dims` of itself, over `sample` values
drawn uniformly, so a drift confined to a few tensors is seen in proportion to its share of the values).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

DIMS = 16
SAMPLE = 65536


def weights_fingerprint(tensors: Sequence[torch.Tensor], seed: int = 0, dims: int = DIMS,
                        sample: int = SAMPLE) -> list[float]:
    """`dims` numbers: the projection of `sample` values of `tensors` (flattened and joined, in order), the same
    values and directions for every caller with tensors of the same sizes and the same `seed`."""
    total = sum(t.numel() for t in tensors)
    if total == 0:
        return [0.0] * dims
    indices, directions = _draw(seed, total, min(sample, total), dims)
    values = torch.empty(len(indices))
    start, taken = 0, 0
    for tensor in tensors:
        end = start + tensor.numel()
        stop = int(torch.searchsorted(indices, end))
        if stop > taken:
            flat = tensor.detach().reshape(-1)  # only the sampled values leave the device
            values[taken:stop] = flat[(indices[taken:stop] - start).to(flat.device)].float().cpu()
            taken = stop
        start = end
    return (directions @ values).tolist()


@functools.lru_cache(maxsize=4)
def _draw(seed: int, total: int, count: int, dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled positions (sorted) and the directions: drawn once per run's stage (a peer logs one fingerprint
    an epoch)."""
    generator = torch.Generator().manual_seed(seed)
    indices = torch.randperm(total, generator=generator)[:count].sort().values
    return indices, torch.randn(dims, count, generator=generator) / math.sqrt(dims)


def weights_version(tensors: Sequence[torch.Tensor]) -> int:
    """How many in-place changes `tensors` have seen (torch counts them on each tensor): equal before and after a
    computation only if no step, average or download changed the weights in between."""
    return sum(t._version for t in tensors)


def relative_distance(a: Sequence[float], b: Sequence[float]) -> float | None:
    """‖a − b‖ / ‖a‖ of two fingerprints (about the relative distance of the two weight vectors); None where `a` is
    zero or the two are of different lengths."""
    if len(a) != len(b):
        return None
    norm = math.sqrt(sum(x * x for x in a))
    if norm == 0:
        return None
    return math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b, strict=True))) / norm
