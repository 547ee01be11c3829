"""What crosses between context-parallel chunks: the K/V compression modes, by the manifest's name.

A mode answers the questions the CP attention, the wire codec and the byte formula ask: whether
K/V cross as Z = K U(θ) (and θ with them) or as themselves, how wide a message's rows are, how a
sender turns its K/V into a payload and a receiver turns a payload back into K/V, and whether a
chunk's own (diagonal) block is built from its own message. Nothing else looks at the name. A new
mode is one class here and one entry in `CP_MODES`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

Bases = tuple[torch.Tensor, torch.Tensor]  # U_k(θ), U_v(θ): (B or 1, d_kv, r)


def compress_kv(full: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """(B, n, d_kv) → Z = K U(θ): (B, n, r)."""
    return full @ basis


def expand_kv(z: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Z → K = Z U(θ)ᵀ: (B, n, d_kv)."""
    return z @ basis.transpose(-1, -2)


class KVCompression(ABC):
    name: ClassVar[str]
    compressed: ClassVar[bool]  # Z in a subspace (and θ) cross, not K/V themselves; needs bases

    @abstractmethod
    def widths(self, r_k: int, r_v: int, d_kv: int) -> tuple[int, int]:
        """Values per token of a message's K part and V part."""

    @abstractmethod
    def encode(self, k_full: torch.Tensor, v_full: torch.Tensor, bases: Bases | None) -> Bases:
        """A sender's K/V (B, n, d_kv) → the payload it sends."""

    @abstractmethod
    def decode(self, p_k: torch.Tensor, p_v: torch.Tensor, bases: Bases | None) -> Bases:
        """A received payload → the K/V the receiver attends to."""

    @abstractmethod
    def owner_uses_message(self, variant: str) -> bool:
        """Whether a chunk's own block is rebuilt from its own message (so every block is compressed)."""


class DenseKV(KVCompression):
    """Plain context parallelism: K and V cross as they are (in the wire dtype)."""

    name = "none"
    compressed = False

    def widths(self, r_k: int, r_v: int, d_kv: int) -> tuple[int, int]:
        return d_kv, d_kv

    def encode(self, k_full, v_full, bases):
        return k_full, v_full

    def decode(self, p_k, p_v, bases):
        return p_k, p_v

    def owner_uses_message(self, variant: str) -> bool:
        return False


class SubspaceKV(KVCompression):
    """Mixtures of subspaces: Z_k = K U_k(θ), Z_v = V U_v(θ) cross with θ; K = Z_k U_k(θ)ᵀ on arrival.
    The `paper` variant builds the owner's diagonal block from its own message too; `remote` keeps it
    full-rank, so only what crosses the wire is constrained."""

    name = "subspace"
    compressed = True

    def widths(self, r_k: int, r_v: int, d_kv: int) -> tuple[int, int]:
        return r_k, r_v

    def encode(self, k_full, v_full, bases):
        return compress_kv(k_full, bases[0]), compress_kv(v_full, bases[1])

    def decode(self, p_k, p_v, bases):
        return expand_kv(p_k, bases[0]), expand_kv(p_v, bases[1])

    def owner_uses_message(self, variant: str) -> bool:
        return variant == "paper"


CP_MODES: dict[str, KVCompression] = {mode.name: mode for mode in (DenseKV(), SubspaceKV())}
DENSE_KV = CP_MODES["none"]
