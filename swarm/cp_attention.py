"""One layer's attention split into context-parallel chunks (dense or compressed K/V).

`CPAttention.forward` is one layer's attention in one graph: every chunk's queries attend to their
own block and to every earlier chunk's K/V *as a receiver rebuilds them from a message*
(`wire_round` rounds Z to the wire dtype forward and its gradient backward, per sender-receiver
pair, θ to float32), so it computes the same function as `swarm.cp_wire.wire_step`, which cuts the
graph at every message and ships the bytes. With `round_wire=False` and compression none it is
plain causal attention. `swarm.model.Block` uses it as its attention when the manifest turns context
parallelism on; it lives apart from `swarm.cp_model` (the one-process decoder, a `PipelineStage`) so
that `swarm.model` can import it.

The attention keeps swarm.model.Attention's parameter names (wq/wk/wv/wo), so a dense stage's
weights load into it; the only new parameter is `theta_head` (rotating modes, zero at the start).
"""

from __future__ import annotations

import torch
from torch import nn

from swarm.context_parallel import ContextParallelSpec, CPBasis, block_attention, kv_width, rotated_basis, wire_round
from swarm.cp_modes import Bases, KVCompression
from swarm.layers import apply_rope


class CPAttention(nn.Module):
    """One layer's attention split into `spec.size` chunks; `mode` is what crosses between them (the
    spec's, or none during a dense warm-up); `tap`, when set, is told of every crossing (the
    simulator counts the messages the swarm would send)."""

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
        self.mode: KVCompression = spec.mode
        self.tap = None  # swarm.cp_traffic.CPTraffic while the simulator counts messages

    def project(self, xn: torch.Tensor, mode: KVCompression):
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
        if mode.compressed and self.theta_head is not None:
            theta = self.spec.theta_max * torch.tanh(self.theta_head(xn.mean(dim=1)))
        return q, k_full, v_full, theta

    def bases(self, theta: torch.Tensor | None, like: torch.Tensor) -> Bases:
        g = self.spec.n_generators
        out = []
        for which, part in (("k", slice(0, g)), ("v", slice(g, 2 * g))):
            ubar, gens = self.basis.tensors(self.layer, which, like)
            out.append(rotated_basis(ubar, gens, None if theta is None else theta[:, part]))
        return out[0], out[1]

    def payload(self, k_full, v_full, theta, mode: KVCompression) -> Bases:
        """What a chunk sends: Z_k, Z_v (B, n, r) when compressed, else K and V themselves."""
        return mode.encode(k_full, v_full, self.bases(theta, k_full) if mode.compressed else None)

    def rebuild(self, p_k, p_v, theta, mode: KVCompression) -> Bases:
        """What a receiver makes of a message: K = Z_k U_k(θ)ᵀ, V = Z_v U_v(θ)ᵀ (or the dense K, V)."""
        return mode.decode(p_k, p_v, self.bases(theta, p_k) if mode.compressed else None)

    def sends(self, chunk: int, mode: KVCompression) -> bool:
        """Whether chunk `chunk` builds a payload: it has receivers, or its own block is rebuilt from it."""
        return chunk < self.spec.size - 1 or mode.owner_uses_message(self.spec.variant)

    def own_block(self, k_full, v_full, p_k, p_v, theta, mode: KVCompression, round_wire: bool):
        """The chunk's own (diagonal) K/V: rebuilt from its own message in paper-style, full otherwise."""
        if not mode.owner_uses_message(self.spec.variant):
            return k_full, v_full
        if round_wire:  # the owner uses exactly what its receivers decode; no message goes back
            dtype = self.spec.wire.torch_dtype
            p_k, p_v = wire_round(p_k, dtype, False), wire_round(p_v, dtype, False)
            theta = None if theta is None else wire_round(theta, torch.float32, False)
        return self.rebuild(p_k, p_v, theta, mode)

    def forward(self, xn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, round_wire: bool = True):
        """The layer's attention for the whole normalised sequence (B, S, d), chunk by chunk, every
        crossing simulated: a receiver rebuilds K/V from the sender's payload as the wire rounds it."""
        spec, mode = self.spec, self.mode
        if xn.shape[1] % spec.size:
            raise ValueError(f"sequence of {xn.shape[1]} tokens does not split into {spec.size} chunks")
        dtype = spec.wire.torch_dtype
        sent, outs = [], []
        for c, chunk in enumerate(xn.split(xn.shape[1] // spec.size, dim=1)):
            q, k_full, v_full, theta = self.project(chunk, mode)
            p_k, p_v = self.payload(k_full, v_full, theta, mode) if self.sends(c, mode) else (None, None)
            blocks = []
            for j, (pk_j, pv_j, th_j, full_j) in enumerate(sent):
                received = (pk_j, pv_j, th_j)
                if round_wire:
                    received = (
                        wire_round(pk_j, dtype),
                        wire_round(pv_j, dtype),
                        None if th_j is None else wire_round(th_j, torch.float32),
                    )
                if self.tap is not None:  # each receiver's copy its own node, so its gradient is its message
                    received = tuple(None if t is None else t.view_as(t) for t in received)
                blocks.append(self.rebuild(*received, mode))
                if self.tap is not None:
                    self.tap.note(self, j, c, (pk_j, pv_j, th_j), received, blocks[-1], full_j)
            blocks.append(self.own_block(k_full, v_full, p_k, p_v, theta, mode, round_wire))
            outs.append(self.attend(q, blocks, cos, sin))
            sent.append((p_k, p_v, theta, (k_full, v_full)))
        return torch.cat(outs, dim=1)

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
