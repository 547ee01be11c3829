"""The building blocks every attention variant shares: RMSNorm, RoPE and the SwiGLU MLP.

They live apart from `swarm.model` so that the pipeline model and the context-parallel attention
(`swarm.cp_attention`) can both use them without importing each other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, S, hd); rotates interleaved pairs."""
    seq = x.shape[-2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[:seq].to(x.dtype), sin[:seq].to(x.dtype)
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)


class SwiGLU(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.w1 = nn.Linear(shape.d_model, shape.d_ff, bias=False)
        self.w3 = nn.Linear(shape.d_model, shape.d_ff, bias=False)
        self.w2 = nn.Linear(shape.d_ff, shape.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
