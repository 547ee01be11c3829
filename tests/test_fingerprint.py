"""A weights fingerprint: equal weights give equal numbers, and their distance estimates the weights' distance."""

import torch

from swarm.fingerprint import relative_distance, weights_fingerprint, weights_version


def tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(300, 400, generator=generator), torch.randn(1000, generator=generator),
            torch.randn(700, 300, generator=generator)]


def test_equal_weights_give_equal_fingerprints_and_a_seed_draws_others():
    a = tensors(0)
    assert weights_fingerprint(a) == weights_fingerprint([t.clone() for t in a])
    assert relative_distance(weights_fingerprint(a), weights_fingerprint(a)) == 0.0
    assert weights_fingerprint(a, seed=1) != weights_fingerprint(a)


def test_the_distance_of_two_fingerprints_estimates_the_relative_distance_of_the_weights():
    a = tensors(0)
    for scale in (0.01, 0.1, 1.0):
        b = [t + scale * torch.randn(t.shape, generator=torch.Generator().manual_seed(7)) for t in a]
        moved = sum(((x - y) ** 2).sum() for x, y in zip(a, b, strict=True))
        true = float(moved**0.5 / sum((x**2).sum() for x in a) ** 0.5)
        estimate = relative_distance(weights_fingerprint(a), weights_fingerprint(b))
        assert 0.5 * true < estimate < 1.5 * true  # 16 directions: typically within a quarter


def test_small_weights_are_taken_whole_and_a_change_in_one_tensor_is_seen():
    a = [torch.ones(10), torch.zeros(5)]
    b = [torch.ones(10), torch.full((5,), 0.5)]  # the second tensor only
    fa, fb = weights_fingerprint(a, sample=100), weights_fingerprint(b, sample=100)
    assert len(fa) == 16 and relative_distance(fa, fb) > 0
    assert weights_fingerprint([]) == [0.0] * 16
    assert relative_distance([0.0] * 16, fb) is None and relative_distance(fa, fa[:4]) is None


def test_the_weights_version_counts_in_place_changes_only():
    """A lane forward compares it before and after (peer/lane_trip.py): an optimizer step changes it, reading the
    weights or filling their gradients does not."""
    layer = torch.nn.Linear(4, 4)
    params = list(layer.parameters())
    before = weights_version(params)
    layer(torch.ones(1, 4)).sum().backward()
    assert weights_version(params) == before
    torch.optim.SGD(params, lr=0.1).step()
    assert weights_version(params) > before
