"""A decoder whose attention is split into context-parallel chunks (dense or compressed K/V).

`CPDecoder.forward` is the one-graph model: every chunk's queries attend to their own block and to
every earlier chunk's K/V *as a receiver rebuilds them from a message* (`wire_round` rounds Z to the
wire dtype forward and its gradient backward, per sender-receiver pair, θ to float32), so it
computes the same function as `swarm.cp_wire.wire_step`, which cuts the graph at every message and
ships the bytes. With `round_wire=False` and compression none it is plain causal attention.

The blocks reuse swarm.model's RMSNorm, SwiGLU and RoPE and keep swarm.model.Block's parameter
names (attn.wq/wk/wv/wo, ...), so a dense pipeline stage's weights load into a CP block; the only
new parameter is `attn.theta_head` (rotating modes).
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from swarm.context_parallel import (
    WIRE_DTYPES,
    ContextParallelSpec,
    CPBasis,
    block_attention,
    compress_kv,
    expand_kv,
    kv_width,
    pca_basis,
    rotated_basis,
    wire_round,
)
from swarm.model import RMSNorm, SwiGLU, apply_rope, rope_tables


class CPAttention(nn.Module):
    def __init__(self, shape, spec: ContextParallelSpec, layer: int, basis: CPBasis):
        super().__init__()
        self.spec, self.layer, self.basis = spec, layer, basis
        self.n_heads, self.n_kv_heads = shape.n_heads, shape.n_kv_heads
        self.head_dim = shape.d_model // shape.n_heads
        self.d_kv = kv_width(shape)
        self.wq = nn.Linear(shape.d_model, shape.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(shape.d_model, self.d_kv, bias=False)
        self.wv = nn.Linear(shape.d_model, self.d_kv, bias=False)
        self.wo = nn.Linear(shape.n_heads * self.head_dim, shape.d_model, bias=False)
        self.theta_head = nn.Linear(shape.d_model, spec.n_theta) if spec.rotates else None
        if self.theta_head is not None:  # θ = 0 at the start: the fixed basis Ū
            nn.init.zeros_(self.theta_head.weight)
            nn.init.zeros_(self.theta_head.bias)
        self.stats: dict[str, torch.Tensor] | None = None  # Σ kᵀk, Σ vᵀv while collecting for PCA

    def project(self, xn: torch.Tensor, compressed: bool):
        """One chunk's normalised input (B, n, d) → q (B, H, n, hd) pre-RoPE, full K and V (B, n, d_kv)
        pre-RoPE, θ (B, n_theta) or None."""
        batch, seq, _ = xn.shape
        q = self.wq(xn).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k_full, v_full = self.wk(xn), self.wv(xn)
        if self.stats is not None:
            with torch.no_grad():
                self.stats["k"] += (k_full.flatten(0, 1).double().T @ k_full.flatten(0, 1).double()).cpu()
                self.stats["v"] += (v_full.flatten(0, 1).double().T @ v_full.flatten(0, 1).double()).cpu()
        theta = None
        if compressed and self.theta_head is not None:
            theta = self.spec.theta_max * torch.tanh(self.theta_head(xn.mean(dim=1)))
        return q, k_full, v_full, theta

    def _bases(self, theta: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.spec.n_generators
        out = []
        for which, part in (("k", slice(0, g)), ("v", slice(g, 2 * g))):
            ubar, gens = self.basis.tensors(self.layer, which, like)
            out.append(rotated_basis(ubar, gens, None if theta is None else theta[:, part]))
        return out[0], out[1]

    def payload(self, k_full, v_full, theta, compressed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """What a chunk sends: Z_k, Z_v (B, n, r) when compressed, else K and V themselves."""
        if not compressed:
            return k_full, v_full
        basis_k, basis_v = self._bases(theta, k_full)
        return compress_kv(k_full, basis_k), compress_kv(v_full, basis_v)

    def rebuild(self, p_k, p_v, theta, compressed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """What a receiver makes of a message: K = Z_k U_k(θ)ᵀ, V = Z_v U_v(θ)ᵀ (or the dense K, V)."""
        if not compressed:
            return p_k, p_v
        basis_k, basis_v = self._bases(theta, p_k)
        return expand_kv(p_k, basis_k), expand_kv(p_v, basis_v)

    def own_block(self, k_full, v_full, p_k, p_v, theta, compressed: bool, round_wire: bool):
        """The chunk's own (diagonal) K/V: rebuilt from its own message in paper-style, full otherwise."""
        if not (compressed and self.spec.variant == "paper"):
            return k_full, v_full
        if round_wire:  # the owner uses exactly what its receivers decode; no message goes back
            dtype = WIRE_DTYPES[self.spec.wire_dtype]
            p_k, p_v = wire_round(p_k, dtype, False), wire_round(p_v, dtype, False)
            theta = None if theta is None else wire_round(theta, torch.float32, False)
        return self.rebuild(p_k, p_v, theta, compressed)

    def attend(self, q, blocks: list[tuple[torch.Tensor, torch.Tensor]], cos, sin) -> torch.Tensor:
        """q of chunk c = len(blocks) − 1; blocks: pre-RoPE (K, V) of chunks 0..c, (B, n, d_kv) each."""
        batch, _, seq, _ = q.shape
        chunk = len(blocks) - 1
        q = apply_rope(q, cos[chunk * seq :], sin[chunk * seq :])
        roped = []
        for j, (k, v) in enumerate(blocks):
            k = k.view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
            v = v.view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
            roped.append((apply_rope(k, cos[j * seq :], sin[j * seq :]), v))
        out = block_attention(q, roped)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class CPBlock(nn.Module):
    def __init__(self, shape, spec: ContextParallelSpec, layer: int, basis: CPBasis):
        super().__init__()
        self.attn_norm = RMSNorm(shape.d_model, shape.norm_eps)
        self.attn = CPAttention(shape, spec, layer, basis)
        self.mlp_norm = RMSNorm(shape.d_model, shape.norm_eps)
        self.mlp = SwiGLU(shape)


def _generator(seed: int, *salt: int) -> torch.Generator:
    digest = hashlib.sha256(repr(("cp-decoder", seed, *salt)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


class CPDecoder(nn.Module):
    """Embedding, CP blocks, final norm and LM head in one process: the simulator's model."""

    def __init__(self, shape, spec: ContextParallelSpec, seed: int, basis: CPBasis | None = None):
        super().__init__()
        self.shape, self.spec, self.seed = shape, spec, seed
        self.basis = basis or CPBasis.for_spec(spec, shape, seed)
        self.compress_active = spec.compressed  # False during a dense warm-up
        self.embed = nn.Parameter(torch.randn(shape.vocab_size, shape.d_model, generator=_generator(seed, 0)) * 0.02)
        self.blocks = nn.ModuleList(CPBlock(shape, spec, i, self.basis) for i in range(shape.n_layers))
        self.final_norm = RMSNorm(shape.d_model, shape.norm_eps)
        self.lm_head = nn.Linear(shape.d_model, shape.vocab_size, bias=False)
        with torch.no_grad():
            for index, (name, param) in enumerate(sorted(self.named_parameters())):
                if name == "embed" or name.endswith("norm.weight") or "theta_head" in name:
                    continue
                std = 0.02 / math.sqrt(2 * shape.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
                param.copy_(torch.randn(param.shape, generator=_generator(seed, 1, index)) * std)
        cos, sin = rope_tables(shape.d_model // shape.n_heads, shape.max_seq_len, shape.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def compressed(self) -> bool:
        return self.compress_active and self.spec.compressed

    def layer_attention(self, block: CPBlock, x: torch.Tensor, round_wire: bool) -> torch.Tensor:
        """One layer's attention output for the whole sequence, chunk by chunk, messages simulated."""
        spec, attn, compressed = self.spec, block.attn, self.compressed
        chunks = block.attn_norm(x).split(x.shape[1] // spec.size, dim=1)
        dtype = WIRE_DTYPES[spec.wire_dtype]
        sent, outs = [], []
        for c, xn in enumerate(chunks):
            q, k_full, v_full, theta = attn.project(xn, compressed)
            needs_payload = c < spec.size - 1 or (compressed and spec.variant == "paper")
            p_k, p_v = attn.payload(k_full, v_full, theta, compressed) if needs_payload else (None, None)
            blocks = []
            for pk_j, pv_j, th_j in sent:
                if round_wire:
                    pk_j, pv_j = wire_round(pk_j, dtype), wire_round(pv_j, dtype)
                    th_j = None if th_j is None else wire_round(th_j, torch.float32)
                blocks.append(attn.rebuild(pk_j, pv_j, th_j, compressed))
            blocks.append(attn.own_block(k_full, v_full, p_k, p_v, theta, compressed, round_wire))
            outs.append(attn.attend(q, blocks, self.rope_cos, self.rope_sin))
            sent.append((p_k, p_v, theta))
        return torch.cat(outs, dim=1)

    def forward(self, tokens: torch.Tensor, round_wire: bool = True) -> torch.Tensor:
        if tokens.shape[1] % self.spec.size:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens does not split into {self.spec.size} chunks")
        x = self.embed[tokens]
        for block in self.blocks:
            x = x + self.layer_attention(block, x, round_wire)
            x = x + block.mlp(block.mlp_norm(x))
        return self.lm_head(self.final_norm(x))

    # -------------------------------------------------------------- the PCA warm start

    def start_collecting(self) -> None:
        for block in self.blocks:
            block.attn.stats = {
                "k": torch.zeros(block.attn.d_kv, block.attn.d_kv, dtype=torch.float64),
                "v": torch.zeros(block.attn.d_kv, block.attn.d_kv, dtype=torch.float64),
            }

    def warm_start(self) -> dict:
        """Switch to Ū = principal components of the K/V collected since start_collecting, turn
        compression on, bump the basis version; returns what changed (version, hash, energy kept)."""
        ubars, kept = {}, {}
        for i, block in enumerate(self.blocks):
            stats = block.attn.stats
            if stats is None:
                raise RuntimeError("warm_start needs K/V statistics: call start_collecting before the warm-up steps")
            for which, rank in (("k", self.spec.r_k), ("v", self.spec.r_v)):
                ubars[i, which] = pca_basis(stats[which], rank)
                u = ubars[i, which].double()
                kept[f"{i}{which}"] = float(torch.trace(u.T @ stats[which] @ u) / torch.trace(stats[which]))
            block.attn.stats = None
        self.basis.switch(ubars, self.basis.version + 1)
        self.compress_active = True
        return {"version": self.basis.version, "sha256": self.basis.sha256, "energy_kept": kept}


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    logits = logits[:, :-1].reshape(-1, logits.shape[-1])
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), tokens[:, 1:].reshape(-1))
