"""The shared subspace: `U` (d×k, orthonormal columns) and the frozen embedding `T_fixed` (V×d).

Every peer derives both from the run seed, so nothing has to be downloaded and a wrong peer can
be detected by hash. The bytes must be identical on every platform, so the generator avoids
anything whose last bit may differ between machines: raw PCG64 output (a stream numpy
guarantees across versions), uniform values made with exact integer arithmetic, and a
Gram-Schmidt orthonormalisation in float64 that only uses correctly rounded operations before
rounding to float32. BLAS/LAPACK (whose summation order varies) never touch the canonical bytes.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

_T_FIXED_STREAM = 0x7F1  # distinct PCG64 streams for T_fixed and U, both from the run seed
_U_STREAM = 0x0B5
T_FIXED_STD = 0.02  # the standard deviation of manifests that do not name one (older runs)


def _uniform_pm1(seed: int, stream: int, count: int) -> np.ndarray:
    """`count` float64 values uniform on [-1, 1), exactly reproducible from (seed, stream).

    Top 53 bits of each raw word are exact in float64; scaling by a power of two and the
    subtraction are exact too.
    """
    bits = np.random.PCG64(np.random.SeedSequence(entropy=seed, spawn_key=(stream,))).random_raw(count)
    return (bits >> np.uint64(11)).astype(np.float64) * (2.0 / 2.0**53) - 1.0


def _t_fixed_rows(seed: int, vocab_size: int, d_model: int, std: float, rows_per_chunk: int = 4096):
    """T_fixed in row blocks, so large vocabularies can be hashed without holding the table twice. The
    values are the same uniform draws whatever `std` is; only the (float32) scale differs."""
    scale = np.float32(std * np.sqrt(3.0))
    generator = np.random.PCG64(np.random.SeedSequence(entropy=seed, spawn_key=(_T_FIXED_STREAM,)))
    for first in range(0, vocab_size, rows_per_chunk):
        rows = min(rows_per_chunk, vocab_size - first)
        top53 = (generator.random_raw(rows * d_model) >> np.uint64(11)).astype(np.float64)
        yield ((top53 * (2.0 / 2.0**53) - 1.0).astype(np.float32) * scale).reshape(rows, d_model)


def t_fixed_table(seed: int, vocab_size: int, d_model: int, std: float = T_FIXED_STD) -> torch.Tensor:
    """Frozen, full-rank token table; uniform with standard deviation `std` (the manifest's `t_fixed_std`)."""
    return torch.from_numpy(np.concatenate(list(_t_fixed_rows(seed, vocab_size, d_model, std))))


def t_fixed_sha256(seed: int, vocab_size: int, d_model: int, std: float = T_FIXED_STD) -> str:
    """Same as tensor_sha256(t_fixed_table(...)), streamed."""
    digest = hashlib.sha256(f"f32:{vocab_size}x{d_model}:".encode())
    for block in _t_fixed_rows(seed, vocab_size, d_model, std):
        digest.update(block.astype("<f4", copy=False).tobytes())
    return digest.hexdigest()


def orthonormalize(columns: np.ndarray) -> np.ndarray:
    """Modified Gram-Schmidt in float64, reproducible bit for bit (no BLAS reductions).

    Used both for the initial basis and for retractions of subspace updates, so that every peer
    derives the same `U'` from the same inputs.
    """
    q = np.array(columns, dtype=np.float64, copy=True)
    d, k = q.shape
    for j in range(k):
        for i in range(j):
            q[:, j] -= np.sum(q[:, i] * q[:, j]) * q[:, i]
        norm = np.sqrt(np.sum(q[:, j] * q[:, j]))
        if not norm > 1e-12:
            raise ValueError(f"column {j} is linearly dependent on the previous ones")
        q[:, j] /= norm
    return q


def initial_basis(seed: int, d_model: int, k: int) -> torch.Tensor:
    """`U` version 0: orthonormal d×k, float32."""
    raw = _uniform_pm1(seed, _U_STREAM, d_model * k).reshape(d_model, k)
    return torch.from_numpy(orthonormalize(raw).astype(np.float32))


def tensor_sha256(tensor: torch.Tensor) -> str:
    """SHA-256 over the canonical byte form: shape header, then float32 little-endian, C order."""
    array = tensor.detach().to(torch.float32).contiguous().cpu().numpy().astype("<f4", copy=False)
    header = ("f32:" + "x".join(str(n) for n in array.shape) + ":").encode()
    return hashlib.sha256(header + array.tobytes()).hexdigest()


def project(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """P x along the last axis, P = U Uᵀ."""
    return (x @ basis) @ basis.T


def compress(x: torch.Tensor, tokens: torch.Tensor, basis: torch.Tensor, t_fixed: torch.Tensor) -> torch.Tensor:
    """Boundary activation → k coefficients per token: c = (x − T_fixed[tok]) U."""
    return (x - t_fixed[tokens]) @ basis


def decompress(
    coefficients: torch.Tensor, tokens: torch.Tensor, basis: torch.Tensor, t_fixed: torch.Tensor
) -> torch.Tensor:
    """Rebuild x = c Uᵀ + T_fixed[tok]; exact when x − T_fixed[tok] lies in span(U)."""
    return coefficients @ basis.T + t_fixed[tokens]


def compress_grad(grad: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Boundary gradient → g U. Upstream depends on x only through span(U), so this is lossless."""
    return grad @ basis


def decompress_grad(coefficients: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    return coefficients @ basis.T


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    denom = exact.float().norm().item()
    return (approx.float() - exact.float()).norm().item() / max(denom, 1e-30)
