"""Moving the shared subspace (DESIGN.md §2.7): what each stage contributes, and the step every peer
recomputes bit for bit.

Contributions are d×k matrices, Euclidean derivatives with respect to U of the loss (driver
"gradient") or of the boundary-gradient energy tr(Uᵀ S U) (driver "energy"), accumulated during
backward passes:

- `subspace` mode: a constrained W (d×n, columns in span U) is W = U Z with Z = UᵀW, so
  ∂L/∂U += G Wᵀ U; for T_S (V×d, rows in span U), ∂L/∂U += Gᵀ T_S U, with G the raw gradient.
- `boundary` mode: the boundary map x ↦ T + U Uᵀ (x − T) gives ∂L/∂U = Rᵀ(G U) + Gᵀ(R U); the
  sender holds R = x − T and receives G U, the receiver holds G and received R U = c, so each side
  adds its own term.
- `energy`: the receiver of a boundary holds G and adds Gᵀ(G U) = S U.

The step U' = orth(U + step · (I − P) D / ‖(I − P) D‖) with D = −Σ contributions (gradient) or
+Σ (energy) uses only correctly rounded float64 operations in a fixed order, so every peer that
reads the same contribution bytes derives the same U' bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

import numpy as np
import torch

from swarm.subspace import orthonormalize

if TYPE_CHECKING:  # a driver is asked about a mode; the modes never ask about drivers
    from swarm.modes import CompressionMode

SubspaceDriverName = Literal["gradient", "energy"]


class SubspaceDriver:
    """What moves U (the manifest's `subspace_driver`): the terms a stage accumulates, the stages that
    contribute, and the sign of the step. The model, the simulator and the U agreement ask it, so none
    of them tests the driver's name."""

    name: ClassVar[str]
    # whether a boundary's receiver adds Gᵀ (G U), the energy of its input gradient, whatever the mode
    receiver_energy: ClassVar[bool] = False

    def weight_terms(self, mode: CompressionMode) -> bool:
        """Whether the constrained weights' gradient hooks add their terms (`weight_term`)."""
        return False

    def boundary_terms(self, mode: CompressionMode) -> bool:
        """Whether a boundary's sender and receiver add their halves of ∂L/∂U (`sender_term`,
        `receiver_term` against the received coefficients)."""
        return False

    def stage_contributes(self, mode: CompressionMode, stage: int, num_stages: int) -> bool:
        """Whether `stage` has a term for a move of U, so the others wait for its contribution."""
        raise NotImplementedError

    def direction(self, contribution: np.ndarray) -> np.ndarray:
        """D, the float64 direction U moves along, from the combined contributions."""
        raise NotImplementedError


class GradientDriver(SubspaceDriver):
    """Descend the loss: the terms are ∂L/∂U, through what the mode constrains or projects."""

    name = "gradient"

    def weight_terms(self, mode: CompressionMode) -> bool:
        return mode.weight_terms

    def boundary_terms(self, mode: CompressionMode) -> bool:
        return mode.boundary_terms

    def stage_contributes(self, mode: CompressionMode, stage: int, num_stages: int) -> bool:
        return mode.stage_has_gradient_terms(stage, num_stages)

    def direction(self, contribution: np.ndarray) -> np.ndarray:
        return -np.asarray(contribution, dtype=np.float64)


class EnergyDriver(SubspaceDriver):
    """Ascend the boundary-gradient energy tr(Uᵀ S U): every stage that receives a boundary gradient
    (all but the head) adds S U, in any mode."""

    name = "energy"
    receiver_energy = True

    def stage_contributes(self, mode: CompressionMode, stage: int, num_stages: int) -> bool:
        return stage > 0

    def direction(self, contribution: np.ndarray) -> np.ndarray:
        return np.asarray(contribution, dtype=np.float64)


DRIVERS: dict[str, SubspaceDriver] = {driver.name: driver for driver in (GradientDriver(), EnergyDriver())}


def subspace_driver(name: str) -> SubspaceDriver:
    """The driver a manifest names; ValueError naming the known ones for any other name."""
    try:
        return DRIVERS[name]
    except KeyError:
        raise ValueError(f"unknown subspace driver {name!r}; choose one of {tuple(DRIVERS)}") from None


class UpdateAccumulator:
    """Sums a stage's d×k contribution between updates (float64, on the CPU), per microbatch.

    A microbatch may add several terms (one per constrained tensor, or a boundary's two halves on a
    middle stage); they are summed, and the mean is taken over microbatches, so every term of ∂L/∂U
    keeps its weight.
    """

    def __init__(self, d_model: int, k: int):
        self.total = torch.zeros(d_model, k, dtype=torch.float64)
        self.terms = 0
        self.microbatches = 0

    def add(self, term: torch.Tensor) -> None:
        self.total += term.detach().to("cpu", torch.float64)
        self.terms += 1

    def finish_microbatch(self) -> None:
        self.microbatches += 1

    def snapshot(self) -> tuple[torch.Tensor, int]:
        return self.total.clone(), self.terms

    def restore(self, snapshot: tuple[torch.Tensor, int]) -> None:
        """Undo the terms of a backward pass that failed half way and is run again."""
        self.total.copy_(snapshot[0])
        self.terms = snapshot[1]

    def mean(self) -> np.ndarray:
        return (self.total / max(self.microbatches, 1)).numpy()

    def reset(self) -> None:
        self.total.zero_()
        self.terms = 0
        self.microbatches = 0


def weight_term(grad: torch.Tensor, weight: torch.Tensor, basis: torch.Tensor, axis: int) -> torch.Tensor:
    """∂L/∂U through a constrained tensor, from its raw gradient (axis = the d axis)."""
    u = basis.to(grad.dtype)
    if axis == 0:  # W (d×n) = U Z → G Zᵀ = G Wᵀ U
        return grad @ (weight.detach().T @ u)
    return grad.T @ (weight.detach() @ u)  # T_S (V×d) = Z Uᵀ → Gᵀ Z = Gᵀ T_S U


def sender_term(residual: torch.Tensor, grad_coefficients: torch.Tensor) -> torch.Tensor:
    """Rᵀ (G U): the boundary sender's half, from its residual and the received gradient message."""
    return (
        residual.reshape(-1, residual.shape[-1]).T.double()
        @ grad_coefficients.reshape(-1, grad_coefficients.shape[-1]).double()
    )


def receiver_term(grad: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
    """Gᵀ (R U) (boundary gradient) or Gᵀ (G U) (energy): the receiver's half."""
    return grad.reshape(-1, grad.shape[-1]).T.double() @ coefficients.reshape(-1, coefficients.shape[-1]).double()


def matrix_to_bytes(matrix: np.ndarray) -> bytes:
    return np.ascontiguousarray(matrix, dtype="<f4").tobytes()


def matrix_from_bytes(data: bytes, d_model: int, k: int) -> np.ndarray:
    if len(data) != d_model * k * 4:
        raise ValueError(f"a d×k matrix needs {d_model * k * 4} bytes, got {len(data)}")
    matrix = np.frombuffer(data, dtype="<f4").reshape(d_model, k)
    if not np.isfinite(matrix).all():
        raise ValueError("matrix holds non-finite values")
    return matrix


def combine(per_stage: dict[int, list[np.ndarray]]) -> np.ndarray:
    """Mean over each stage's peers, summed over stages, in a fixed order (float64)."""
    total = None
    for stage in sorted(per_stage):
        items = per_stage[stage]
        stage_sum = np.zeros_like(items[0], dtype=np.float64)
        for item in items:
            stage_sum = stage_sum + np.asarray(item, dtype=np.float64)
        stage_mean = stage_sum / len(items)
        total = stage_mean if total is None else total + stage_mean
    if total is None:
        raise ValueError("no contributions")
    return total


def next_basis(basis: np.ndarray, contribution: np.ndarray, driver: SubspaceDriver, step: float) -> np.ndarray:
    """U' = orth(U + step · t/‖t‖), t = (I − P) D: a step of fixed size along the Grassmann tangent."""
    basis = np.asarray(basis, dtype=np.float64)
    direction = driver.direction(contribution)
    k = basis.shape[1]
    tangent = direction.copy()
    for j in range(k):  # (I − U Uᵀ) D, column by column, without BLAS
        for i in range(k):
            tangent[:, j] -= np.sum(basis[:, i] * direction[:, j]) * basis[:, i]
    norm = np.sqrt(np.sum(tangent * tangent))
    if not norm > 1e-30:
        return orthonormalize(basis)
    return orthonormalize(basis + (step / norm) * tangent)


def basis_from_contributions(
    basis: np.ndarray, contributions: dict[int, list[bytes]], driver: SubspaceDriver, step: float
) -> np.ndarray:
    """U' from every stage's contributions as they cross the network (d×k float32 bytes each, in the order
    given): the one derivation the simulator and every peer run, so all derive the same bytes. Raises
    ValueError if a contribution is malformed."""
    d_model, k = basis.shape
    per_stage = {
        stage: [matrix_from_bytes(data, d_model, k) for data in blobs] for stage, blobs in contributions.items()
    }
    return next_basis(basis, combine(per_stage), driver, step)
