"""The Grassmann step: deterministic, orthonormal, tangent; and contributions that match autograd."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from swarm import subspace as ss
from swarm.subspace_update import (
    combine,
    matrix_from_bytes,
    matrix_to_bytes,
    next_basis,
    receiver_term,
    sender_term,
    subspace_driver,
)

GRADIENT, ENERGY = subspace_driver("gradient"), subspace_driver("energy")


def test_step_is_deterministic_orthonormal_and_moves():
    basis = ss.initial_basis(0, 32, 3).double().numpy()
    direction = np.random.default_rng(0).standard_normal((32, 3))
    new = next_basis(basis, direction, GRADIENT, 0.1)
    assert np.array_equal(new, next_basis(basis, direction, GRADIENT, 0.1))
    assert np.abs(new.T @ new - np.eye(3)).max() < 1e-12
    assert np.abs(new @ new.T - basis @ basis.T).max() > 1e-3  # the subspace moved
    # a direction inside span(U) has no tangent component: the subspace stays
    same = next_basis(basis, basis @ np.ones((3, 3)), GRADIENT, 0.5)
    assert np.abs(same @ same.T - basis @ basis.T).max() < 1e-6


def test_step_bytes_agree_across_processes():
    code = (
        "import numpy as np, hashlib; from swarm import subspace as ss; "
        "from swarm.subspace_update import next_basis, subspace_driver; "
        "b = ss.initial_basis(3, 64, 4).double().numpy(); d = np.cos(np.arange(256.0)).reshape(64, 4); "
        "print(hashlib.sha256(next_basis(b, d, subspace_driver('energy'), 0.07).astype('<f4').tobytes()).hexdigest())"
    )
    here = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    basis = ss.initial_basis(3, 64, 4).double().numpy()
    direction = np.cos(np.arange(256.0)).reshape(64, 4)
    import hashlib

    assert (
        here.strip() == hashlib.sha256(next_basis(basis, direction, ENERGY, 0.07).astype("<f4").tobytes()).hexdigest()
    )


def test_step_size_is_the_rotation_not_the_gradient_scale():
    basis = ss.initial_basis(1, 48, 2).double().numpy()
    direction = np.random.default_rng(1).standard_normal((48, 2))
    small, large = next_basis(basis, direction, GRADIENT, 0.05), next_basis(basis, 1e6 * direction, GRADIENT, 0.05)
    assert np.abs(small - large).max() < 1e-9


def test_gradient_descends_energy_ascends():
    basis = ss.initial_basis(2, 16, 2).double().numpy()
    target = np.linalg.qr(np.random.default_rng(2).standard_normal((16, 2)))[0]
    s_matrix = target @ target.T  # energy tr(Uᵀ S U) is largest at span(target)
    u = basis
    for _ in range(60):
        u = next_basis(u, s_matrix @ u, ENERGY, 0.1)
    assert np.trace(u.T @ s_matrix @ u) > 1.9
    with pytest.raises(ValueError, match="unknown subspace driver 'sideways'"):
        subspace_driver("sideways")


def test_boundary_terms_are_the_derivative_of_the_boundary_map():
    """Rᵀ(GU) + Gᵀ(RU) equals autograd's ∂/∂U of ⟨G, U Uᵀ R⟩, the two halves the two sides compute."""
    torch.manual_seed(0)
    d, k, n = 12, 3, 20
    basis = ss.initial_basis(4, d, k).double().requires_grad_(True)
    residual, grad = torch.randn(n, d, dtype=torch.float64), torch.randn(n, d, dtype=torch.float64)
    ((residual @ basis @ basis.T) * grad).sum().backward()
    halves = sender_term(residual, grad @ basis.detach()) + receiver_term(grad, residual @ basis.detach())
    assert torch.allclose(halves, basis.grad, atol=1e-10)


def test_combine_means_peers_then_sums_stages_and_bytes_round_trip():
    a, b, c = (np.full((4, 2), v) for v in (1.0, 3.0, 10.0))
    assert np.array_equal(combine({1: [c], 0: [a, b]}), np.full((4, 2), 12.0))
    assert np.array_equal(matrix_from_bytes(matrix_to_bytes(a), 4, 2), a.astype(np.float32))
    with pytest.raises(ValueError):
        matrix_from_bytes(b"\0" * 7, 4, 2)
    with pytest.raises(ValueError):
        matrix_from_bytes(matrix_to_bytes(np.full((4, 2), np.nan)), 4, 2)


def test_accumulator_means_over_microbatches_and_restores():
    from swarm.subspace_update import UpdateAccumulator

    acc = UpdateAccumulator(3, 2)
    acc.add(torch.ones(3, 2))
    acc.add(torch.ones(3, 2))  # two halves of one microbatch keep their full weight
    acc.finish_microbatch()
    snap = acc.snapshot()
    acc.add(torch.full((3, 2), 5.0))
    acc.restore(snap)
    acc.add(torch.full((3, 2), 4.0))
    acc.finish_microbatch()
    assert np.allclose(acc.mean(), 3.0)
    acc.reset()
    assert acc.terms == 0 and acc.microbatches == 0
