"""The run's loss from what drivers publish: a robust average that no single record can steer."""

from __future__ import annotations

from collections.abc import Sequence


def weighted_median(values: Sequence[tuple[float, float]]) -> float | None:
    """The lower weighted median of (value, weight) pairs with positive weights; None if there are none.

    Unlike a weighted mean, one value with a huge weight moves it only if that weight is half the total,
    and a value far from the rest does not pull it at all."""
    pairs = sorted((v, w) for v, w in values if w > 0)
    total = sum(w for _, w in pairs)
    if not pairs:
        return None
    acc = 0.0
    for value, weight in pairs:
        acc += weight
        if acc >= total / 2:
            return value
    return pairs[-1][0]


def capped_weights(values: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """(value, weight) pairs with each weight capped at the lower median weight. The plausible-hardware
    clamp (`credited_tokens`) is generous (2 PFLOP/s per peer): a fresh liar still gets ~a minute of it,
    far more than honest drivers have trained. Capped at the typical driver's weight, no single record
    outweighs the others, so a lie moves the weighted median only with half of the drivers behind it."""
    if not values:
        return []
    weights = sorted(w for _, w in values)
    cap = weights[(len(weights) - 1) // 2]
    return [(v, min(w, cap)) for v, w in values]


def plausible_loss(loss: float | None, bound: float) -> bool:
    """A published loss the tracker averages: finite and within [0, `plausible_loss_bound`]."""
    return loss is not None and 0.0 <= loss <= bound
