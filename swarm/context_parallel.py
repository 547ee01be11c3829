"""Context parallelism with mixtures of subspaces (issue 16, part 1): the spec, the shared bases, the math.

A sequence of S tokens is cut into P chunks of n = S/P tokens; chunk c's queries attend to its own
K/V (causally) and to every earlier chunk's K/V. Dense CP ships K and V (n × d_kv each) of every
layer to every later chunk; compressed CP ships `Z = K U(θ)` (n × r) and θ instead, and the
receiver rebuilds `K = Z U(θ)ᵀ` (the same for V, with its own rank).

Choices (the paper leaves them open; see the report of issue 16):

- **Compressed before RoPE.** Z is a projection of the pre-RoPE K; positions are derived from the
  chunk index, and the receiver applies RoPE at the sender chunk's absolute positions. RoPE does not
  commute with a fixed basis, so compressing after it would need a basis per position.
- **One basis per layer over all K/V heads jointly** (d_kv = n_kv_heads · head_dim), one for K
  (rank r_k) and one for V (rank r_v); rank is shared out across heads by the data (PCA warm start).
- **θ per (layer, chunk, K or V), one scalar per generator** (`n_generators`, default 1), predicted
  by a linear head (zero-initialised, so training starts at the fixed basis) from the mean of the
  chunk's normalised attention input: θ = θ_max · tanh(w·mean(x) + b). One number per layer is what
  the paper's ablation found sufficient, and per head would need per-head bases.
- **Generators A_i = M_i Ūᵀ − Ū M_iᵀ**, with M_i (d_kv × r) orthonormal, orthogonal to Ū and to each
  other: the Gram-Schmidt completion (swarm.subspace.orthonormalize, float64, bit-reproducible) of
  [Ū | G] where G comes from the run seed (swarm.subspace's PCG64 stream). For such A the second
  order rotation is closed-form: `U(θ) = R(θ) Ū = Ū (1 − ½‖θ‖²) + Σ θ_i M_i` (since A Ū = M,
  A² Ū = −Ū), every direction of span(Ū) tilts by the same angle atan(‖θ‖ / (1 − ½‖θ‖²)) and
  `U(θ)ᵀU(θ) = (1 + ¼‖θ‖⁴) I` exactly: with θ_max = 0.5 the basis is orthonormal to 0.4%.
  A random skew-symmetric A would spend part of θ rotating span(Ū) into itself (no effect) and
  would need a d_kv × d_kv matrix on every receiver; this A needs only Ū and M.
- **Bound:** |θ_i| ≤ θ_max (tanh), checked again on decode.

What crosses is the compression mode's business (`swarm.cp_modes`: `none` ships K/V, `subspace`
ships Z and θ). Variants of `subspace`: `paper` (every block, the owner's diagonal one included,
uses the rebuilt K/V) and `remote` (a chunk's own block keeps its full-rank K/V; only what crosses
to later chunks is compressed).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from pydantic import ConfigDict

from swarm.cp_modes import CP_MODES, KVCompression
from swarm.subspace import _uniform_pm1, orthonormalize, tensor_sha256
from swarm.wire_dtype import CAST_DTYPES, WireDType, wire_dtype

VARIANTS = ("paper", "remote")
THETA_WIRE = wire_dtype("fp32")  # θ always travels in float32
_CP_STREAM = 0xC70000  # PCG64 streams of the CP bases: distinct from T_fixed's and U's
ORTHONORMAL_TOL = 1e-5


@dataclass(frozen=True)
class ContextParallelSpec:
    """What a run's context parallelism is: the manifest field `context_parallel` (absent = off)."""

    __pydantic_config__: ClassVar[ConfigDict] = ConfigDict(extra="forbid")  # an unknown key is refused

    size: int = 1  # P, chunks per sequence
    compression: str = "none"  # none | subspace
    variant: str = "remote"  # paper (every block compressed) | remote (only cross-chunk K/V)
    r_k: int = 4
    r_v: int = 8
    theta_max: float = 0.5  # 0 = the fixed basis Ū (no mixture)
    n_generators: int = 1
    wire_dtype: str = "bf16"  # Z's dtype on the wire; θ is float32
    warm_start_steps: int = 0  # dense steps before the PCA basis is switched in (0 = seed basis)
    basis_sha256: str = ""  # CPBasis v0 derived from the run seed (filled in by swarm.presets.with_hashes)

    def __post_init__(self):
        ints = (self.size, self.r_k, self.r_v, self.n_generators, self.warm_start_steps)
        if any(not isinstance(v, int) or isinstance(v, bool) for v in ints):
            raise ValueError("context_parallel: size, r_k, r_v, n_generators, warm_start_steps must be integers")
        if self.size < 1:
            raise ValueError(f"context_parallel.size must be at least 1, got {self.size}")
        if self.compression not in CP_MODES:
            raise ValueError(
                f"context_parallel.compression must be one of {tuple(CP_MODES)}, got {self.compression!r}"
            )
        if self.variant not in VARIANTS:
            raise ValueError(f"context_parallel.variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.r_k < 1 or self.r_v < 1:
            raise ValueError(f"context_parallel.r_k and r_v must be at least 1, got {self.r_k}, {self.r_v}")
        if not (isinstance(self.theta_max, (int, float)) and 0.0 <= self.theta_max <= 1.0):
            raise ValueError(f"context_parallel.theta_max must lie in [0, 1], got {self.theta_max!r}")
        if self.n_generators < 1:
            raise ValueError(f"context_parallel.n_generators must be at least 1, got {self.n_generators}")
        if self.wire_dtype not in CAST_DTYPES:  # K/V are rounded by a cast: no per-token scale crosses
            raise ValueError(f"context_parallel.wire_dtype must be one of {CAST_DTYPES}, got {self.wire_dtype!r}")
        if self.warm_start_steps < 0:
            raise ValueError("context_parallel.warm_start_steps must be >= 0")
        digest = self.basis_sha256
        if digest and (len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest)):
            raise ValueError("context_parallel.basis_sha256 must be 64 lowercase hex digits")

    @property
    def mode(self) -> KVCompression:
        """The compression mode's answers (`swarm.cp_modes`): what a chunk's K/V message holds."""
        return CP_MODES[self.compression]

    @property
    def wire(self) -> WireDType:
        """The K/V messages' wire dtype (`swarm/wire_dtype.py`): a cast, never int8."""
        return wire_dtype(self.wire_dtype)

    @property
    def compressed(self) -> bool:
        return self.mode.compressed

    @property
    def rotates(self) -> bool:
        return self.compressed and self.theta_max > 0

    @property
    def n_theta(self) -> int:
        """θ values per sequence in one K/V message: n_generators for K, then for V."""
        return 2 * self.n_generators if self.rotates else 0

    def validate(self, shape, seq_len: int) -> None:
        """Check against a model shape (swarm.manifest.ModelShape or anything with its fields)."""
        d_kv = kv_width(shape)
        if seq_len % self.size:
            raise ValueError(f"batch.seq_len ({seq_len}) must be divisible by context_parallel.size ({self.size})")
        if seq_len // self.size < 1:
            raise ValueError("context_parallel: chunks must hold at least one token")
        if seq_len > shape.max_seq_len:
            raise ValueError(f"batch.seq_len ({seq_len}) must not exceed model.max_seq_len ({shape.max_seq_len})")
        if self.compressed:
            columns = (self.n_generators + 1) if self.rotates else 1
            for name, rank in (("r_k", self.r_k), ("r_v", self.r_v)):
                if rank * columns > d_kv:
                    raise ValueError(
                        f"context_parallel.{name} ({rank}) x (n_generators + 1) ({columns}) must not exceed "
                        f"d_kv = n_kv_heads * head_dim ({d_kv})"
                    )

    def chunk_len(self, seq_len: int) -> int:
        return seq_len // self.size

    def widths(self, shape) -> tuple[int, int]:
        """Values per token per message for K and V: the ranks, or d_kv when dense."""
        return self.mode.widths(self.r_k, self.r_v, kv_width(shape))

    def message_widths(self, mode: KVCompression, d_kv: int) -> tuple[int, int, int]:
        """Values per token of a K/V message's K and V parts in `mode` (a layer's own, which may differ from the
        spec's), and θ values per sequence."""
        width_k, width_v = mode.widths(self.r_k, self.r_v, d_kv)
        return width_k, width_v, self.n_theta if mode.compressed else 0

    def payload_bytes_per_token(self, shape, seq_len: int, batch: int = 1) -> dict:
        """Formula: payload bytes per token per layer, forward (backward is the same size): each
        chunk's message goes to the P−1−c later chunks, so a token crosses (P−1)/2 times on average."""
        width_k, width_v = self.widths(shape)
        n = self.chunk_len(seq_len)
        crossings = (self.size - 1) / 2
        per_message_token = (width_k + width_v) * self.wire.itemsize + self.n_theta * THETA_WIRE.itemsize / n
        dense = 2 * kv_width(shape) * self.wire.itemsize
        return {"compressed": crossings * per_message_token, "dense": crossings * dense}


def kv_bytes_per_token(heartbeats: Iterable[dict], lanes: int) -> float | None:
    """Context parallelism's K/V bytes per token of the whole sequence, measured: from the counters each lane
    peer writes in its heartbeat (`stage`, `lane`, `kv_bytes`, `kv_tokens`; `peer/daemon.py`).

    Each peer's ratio uses its own two counters (bytes and chunk tokens of the same lane trips), so heartbeats
    written at different moments, trips still in flight and trips that failed elsewhere do not skew it; a
    driver's token count against other peers' byte counts did (a stale heartbeat dropped half a trip's bytes).
    A lane's chunk is 1/`lanes` of the sequence, so the slots' bytes per chunk token, summed and divided by
    `lanes`, is the swarm's bytes per sequence token; peers sharing a slot are averaged. None until every
    slot that wrote a heartbeat has a peer that finished a lane trip."""
    ratios: dict[tuple[int, int], list[float]] = defaultdict(list)
    for beat in heartbeats:
        if "lane" not in beat:
            continue  # not a lane peer (the tracker, or a peer without context parallelism)
        slot, tokens = ratios[int(beat["stage"]), int(beat["lane"])], int(beat.get("kv_tokens", 0))
        if tokens > 0:
            slot.append(int(beat["kv_bytes"]) / tokens)
    if not ratios or not all(ratios.values()):
        return None
    return sum(sum(slot) / len(slot) for slot in ratios.values()) / lanes


def kv_width(shape) -> int:
    return shape.n_kv_heads * (shape.d_model // shape.n_heads)


# ---------------------------------------------------------------------------- the shared bases


def _seed_columns(seed: int, stream: int, rows: int, cols: int) -> np.ndarray:
    return _uniform_pm1(seed, stream, rows * cols).reshape(rows, cols)


def derive_generators(seed: int, layer: int, which: str, ubar: torch.Tensor, n_generators: int) -> torch.Tensor:
    """M_i (n_generators × d_kv × r), orthonormal and orthogonal to Ū, bit-reproducible from Ū's float32 bytes."""
    d_kv, rank = ubar.shape
    stream = _CP_STREAM + 0x8000 + 4 * layer + (0 if which == "k" else 1)
    raw = _seed_columns(seed, stream, d_kv, rank * n_generators)
    base = ubar.detach().to(torch.float32).cpu().numpy().astype(np.float64)
    completed = orthonormalize(np.concatenate([base, raw], axis=1))[:, rank:]
    return (
        torch.from_numpy(completed.astype(np.float32)).reshape(d_kv, n_generators, rank).permute(1, 0, 2).contiguous()
    )


def seed_basis(seed: int, layer: int, which: str, d_kv: int, rank: int) -> torch.Tensor:
    stream = _CP_STREAM + 4 * layer + (0 if which == "k" else 1)
    return torch.from_numpy(orthonormalize(_seed_columns(seed, stream, d_kv, rank)).astype(np.float32))


def orthonormality_error(basis: torch.Tensor) -> float:
    gram = basis.double().T @ basis.double()
    return float((gram - torch.eye(gram.shape[0], dtype=torch.float64)).abs().max())


class CPBasis:
    """Ū and the generators of every layer (K and V), their version and one SHA-256 over all of them.

    Version 0 comes from the run seed; `switch` installs a new Ū (the PCA warm start), checked for
    shape, finiteness and orthonormality, re-derives the generators and bumps the version.
    """

    def __init__(self, seed: int, n_layers: int, d_kv: int, r_k: int, r_v: int, n_generators: int = 1):
        self.seed, self.n_layers, self.d_kv, self.n_generators = seed, n_layers, d_kv, n_generators
        self.ranks = {"k": r_k, "v": r_v}
        self.version = 0
        self.ubar: dict[tuple[int, str], torch.Tensor] = {}
        self.gens: dict[tuple[int, str], torch.Tensor] = {}
        for layer in range(n_layers):
            for which, rank in self.ranks.items():
                self.ubar[layer, which] = seed_basis(seed, layer, which, d_kv, rank)
        self._derive()

    @classmethod
    def for_spec(cls, spec: ContextParallelSpec, shape, seed: int) -> CPBasis:
        return cls(seed, shape.n_layers, kv_width(shape), spec.r_k, spec.r_v, spec.n_generators)

    def _derive(self) -> None:
        self._copies: dict[tuple, tuple[torch.Tensor, ...]] = {}
        with_gens = (self.n_generators + 1) * max(self.ranks.values()) <= self.d_kv
        for (layer, which), ubar in self.ubar.items():
            if with_gens:
                self.gens[layer, which] = derive_generators(self.seed, layer, which, ubar, self.n_generators)
            else:  # no room for a rotation: the spec's validation refuses theta_max > 0 here
                self.gens[layer, which] = torch.zeros(self.n_generators, *ubar.shape)
        digest = hashlib.sha256(f"cp-basis:{self.n_layers}:{self.d_kv}:{self.n_generators}:".encode())
        for key in sorted(self.ubar):
            digest.update(f"{key[0]}{key[1]}".encode())
            digest.update(tensor_sha256(self.ubar[key]).encode())
            digest.update(tensor_sha256(self.gens[key]).encode())
        self.sha256 = digest.hexdigest()

    def switch(self, ubars: dict[tuple[int, str], torch.Tensor], version: int) -> None:
        """Install new bases for every (layer, 'k'|'v'); refuses anything malformed, changes nothing then."""
        if version != self.version + 1:
            raise ValueError(f"CP basis version must go from {self.version} to {self.version + 1}, got {version}")
        if set(ubars) != set(self.ubar):
            raise ValueError("a CP basis switch must give a basis for every layer's K and V")
        checked = {}
        for key, ubar in ubars.items():
            ubar = ubar.detach().to(torch.float32).cpu().contiguous()
            if tuple(ubar.shape) != (self.d_kv, self.ranks[key[1]]):
                raise ValueError(
                    f"basis {key} has shape {tuple(ubar.shape)}, expected {(self.d_kv, self.ranks[key[1]])}"
                )
            if not torch.isfinite(ubar).all():
                raise ValueError(f"basis {key} is not finite")
            error = orthonormality_error(ubar)
            if error > ORTHONORMAL_TOL:
                raise ValueError(f"basis {key} is not orthonormal (max |UᵀU − I| = {error:.2e})")
            checked[key] = ubar
        self.ubar = checked
        self.version = version
        self._derive()

    def tensors(self, layer: int, which: str, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Ū and the generators of (layer, which) on `like`'s device and dtype, copied once per basis version
        (a copy from host memory per use would stall a GPU on every chunk of every layer)."""
        key = (layer, which, like.device, like.dtype)
        if key not in self._copies:
            self._copies[key] = tuple(
                store[layer, which].to(device=like.device, dtype=like.dtype) for store in (self.ubar, self.gens)
            )
        return self._copies[key]


def pca_basis(second_moment: torch.Tensor, rank: int) -> torch.Tensor:
    """Top-`rank` principal directions of Σ kᵀk (uncentred: we represent K itself), orthonormalised
    by swarm.subspace's Gram-Schmidt, float32. The result is published as data (with its hash); it
    need not be bit-reproducible, every receiver checks its hash and orthonormality."""
    values, vectors = torch.linalg.eigh(second_moment.double())
    top = vectors[:, torch.argsort(values, descending=True)[:rank]]
    return torch.from_numpy(orthonormalize(top.numpy()).astype(np.float32))


# ---------------------------------------------------------------------------- the mixture


def rotated_basis(ubar: torch.Tensor, gens: torch.Tensor, theta: torch.Tensor | None) -> torch.Tensor:
    """U(θ) = Ū (1 − ½‖θ‖²) + Σ θ_i M_i per sequence: (B, d_kv, r); Ū itself (1, d_kv, r) without θ."""
    if theta is None:
        return ubar.unsqueeze(0)
    shrink = 1 - 0.5 * theta.pow(2).sum(-1)
    return ubar.unsqueeze(0) * shrink[:, None, None] + torch.einsum("bg,gdr->bdr", theta, gens)


class _WireRound(torch.autograd.Function):
    """What a message does to a tensor: rounds it to the wire dtype forward and, when it is a
    received tensor whose gradient goes back in a message, rounds the gradient too."""

    @staticmethod
    def forward(ctx, x, dtype, round_grad):
        ctx.dtype, ctx.round_grad = dtype, round_grad
        return x.to(dtype).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return (grad.to(ctx.dtype).to(grad.dtype) if ctx.round_grad else grad), None, None


def wire_round(x: torch.Tensor, dtype: torch.dtype, round_grad: bool = True) -> torch.Tensor:
    if x.dtype == dtype:
        return x
    return _WireRound.apply(x, dtype, round_grad)


# ---------------------------------------------------------------------------- attention


def _expand_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    repeat = n_heads // x.shape[1]
    return x if repeat == 1 else x.repeat_interleave(repeat, dim=1)


def block_attention(q: torch.Tensor, blocks: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Exact causal attention of one chunk's queries over its own and every earlier chunk's K/V.

    q: (B, H, n, hd), RoPE applied. blocks: [(k, v)] of (B, H_kv, m, hd), RoPE applied, in order;
    every block is fully visible except the last, the chunk's own (diagonal), which is causal.
    One SDPA over the concatenated blocks with that mask: the same function as merging per-block
    partial outputs by log-sum-exp (what ring attention does; the tests check one against the
    other), and on a GPU one fused kernel instead of a score matrix per block.
    """
    n_heads, seq = q.shape[1], q.shape[2]
    if len(blocks) == 1:  # the first chunk (or P = 1): exactly swarm.model.Attention's causal SDPA
        k, v = blocks[0]
        return torch.nn.functional.scaled_dot_product_attention(
            q, _expand_heads(k, n_heads), _expand_heads(v, n_heads), is_causal=True
        )
    k = _expand_heads(torch.cat([k for k, _ in blocks], dim=2), n_heads)
    v = _expand_heads(torch.cat([v for _, v in blocks], dim=2), n_heads)
    visible = torch.ones(seq, k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - seq)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible)
