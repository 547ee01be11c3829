"""A LLaMA-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention) cut into pipeline stages.

One `PipelineStage` is what one peer holds. The head stage embeds tokens as
`T_fixed[tok] + T_S[tok]`; the tail stage ends with the final norm, the LM head and the loss.
With the manifest's `stage_embedding_rank` set, every stage also adds its own learned embedding of
the token ids at its input and takes it out again before its boundary (`StageEmbedding`).
What keeps the boundary activations in span(U) is the manifest's compression mode
(`swarm/modes/`): which tensors are constrained (their gradients are projected by hooks, so every
consumer of `.grad`, our optimizer and hivemind's averager, sees `P G`) and whether a stage ends
by projecting its output. With the manifest's `context_parallel` set, every layer's attention is
`swarm.cp_attention.CPAttention`: the sequence is cut into P chunks whose K/V reach later chunks as
that field's K/V mode says (`swarm/cp_modes.py`), through the wire's rounding. The one-process
context-parallel model (`swarm.cp_model.CPDecoder`) is a one-stage `PipelineStage`, so there is one
block, one init and one loss.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from swarm.context_parallel import CPBasis
from swarm.cp_attention import CPAttention
from swarm.layers import RMSNorm, SwiGLU, apply_rope, rope_tables
from swarm.manifest import Manifest, ModelShape
from swarm.subspace import initial_basis, t_fixed_table, tensor_sha256
from swarm.subspace_update import UpdateAccumulator, receiver_term, sender_term, weight_term

Result = TypeVar("Result")


class SubspaceState(nn.Module):
    """`U` with its version and `T_fixed`: the frozen tensors a stage needs at its boundaries."""

    def __init__(self, manifest: Manifest, need_t_fixed: bool = True):
        super().__init__()
        shape = manifest.model
        self.version = 0
        self.register_buffer("basis", initial_basis(manifest.seed, shape.d_model, manifest.k), persistent=False)
        table = None
        if need_t_fixed:
            table = t_fixed_table(manifest.seed, shape.vocab_size, shape.d_model, manifest.t_fixed_std)
        self.register_buffer("t_fixed", table, persistent=False)
        self.basis_sha256 = tensor_sha256(self.basis)
        self.t_fixed_sha256 = manifest.t_fixed_sha256 or (tensor_sha256(table) if table is not None else "")

    def set_basis(self, basis: torch.Tensor, version: int) -> None:
        self.basis = basis.to(device=self.basis.device, dtype=self.basis.dtype).contiguous()
        self.version = version
        self.basis_sha256 = tensor_sha256(self.basis)

    def project(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        """Project along `axis` (the one of length d) onto span(U)."""
        u = self.basis.to(device=x.device, dtype=x.dtype)
        if axis == x.dim() - 1 or axis == -1:
            return (x @ u) @ u.T
        if axis == 0:
            return u @ (u.T @ x)
        raise ValueError(f"unsupported projection axis {axis}")


class Attention(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.n_heads, self.n_kv_heads = shape.n_heads, shape.n_kv_heads
        self.head_dim = shape.d_model // shape.n_heads
        self.wq = nn.Linear(shape.d_model, shape.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(shape.d_model, shape.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(shape.d_model, shape.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(shape.n_heads * self.head_dim, shape.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv_heads != self.n_heads:
            repeat = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    """One decoder layer; `attention` replaces the plain causal attention (the context-parallel one)."""

    def __init__(self, shape: ModelShape, attention: nn.Module | None = None):
        super().__init__()
        self.attn_norm = RMSNorm(shape.d_model, shape.norm_eps)
        self.attn = attention if attention is not None else Attention(shape)
        self.mlp_norm = RMSNorm(shape.d_model, shape.norm_eps)
        self.mlp = SwiGLU(shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, **attention: bool) -> torch.Tensor:
        """`attention`: options of a context-parallel attention (`round_wire`); the plain one takes none."""
        x = x + self.attn(self.attn_norm(x), cos, sin, **attention)
        return x + self.mlp(self.mlp_norm(x))


class StageEmbedding(nn.Module):
    """One stage's own learned embedding of the token ids (full V×d, or V×r · r×d when `rank` < d).

    The ids cross every boundary anyway, so this gives each stage full-rank token identity past a
    rank-k boundary at no wire cost. The stage adds it at its input and subtracts it again before
    its boundary (`PipelineStage.finish`): its layers read it, but the residual a stage sends is what
    it would be without it, so in `subspace` mode `x − T_fixed[tok]` stays in span(U) (the
    constrained layers' outputs are all that is left of the stage's own writes) and reconstruction
    stays exact; in `boundary` mode the projection would keep the output exact anyway, and
    subtracting first keeps the table local to its stage there too.
    """

    def __init__(self, vocab_size: int, d_model: int, rank: int, generator: torch.Generator):
        super().__init__()
        if rank >= d_model:
            self.table = nn.Parameter(torch.randn(vocab_size, d_model, generator=generator) * 0.02)
            self.up = None
        else:  # rows ~ N(0, 0.02²) per element, as the full table's
            self.table = nn.Parameter(torch.randn(vocab_size, rank, generator=generator) * 0.02)
            self.up = nn.Parameter(torch.randn(rank, d_model, generator=generator) / math.sqrt(rank))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.table[tokens]
        return rows if self.up is None else rows @ self.up


def _seeded(seed: int, *salt: int) -> torch.Generator:
    digest = hashlib.sha256(repr((seed, *salt)).encode()).digest()
    generator = torch.Generator()
    generator.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return generator


def _init_block(block: Block, seed: int, layer: int, n_layers: int) -> None:
    """Per-layer seeded init, so a layer starts the same whatever the stage split (and whether context
    parallelism is on: its θ head starts at zero, the fixed basis, and draws nothing)."""
    generator = _seeded(seed, 1, layer)
    for name, param in sorted(block.named_parameters()):
        if name.endswith("norm.weight") or name.startswith("attn.theta_head."):
            continue
        std = 0.02 / math.sqrt(2 * n_layers) if name in ("attn.wo.weight", "mlp.w2.weight") else 0.02
        with torch.no_grad():
            param.copy_(torch.randn(param.shape, generator=generator) * std)


class PipelineStage(nn.Module):
    """The layers of one stage, plus the embedding (head) or the norm, LM head and loss (tail)."""

    def __init__(self, manifest: Manifest, index: int):
        super().__init__()
        if not 0 <= index < manifest.num_stages:
            raise ValueError(f"stage {index} out of range: the run has {manifest.num_stages} stages")
        self.manifest, self.index = manifest, index
        shape = manifest.model
        self.is_head, self.is_tail = index == 0, index == manifest.num_stages - 1
        self.trip_activation_bytes = 0  # unknown until `measure_throughput`
        self.subspace = SubspaceState(manifest)
        layers = manifest.layers_of(index)
        self.first_layer = layers.start
        cp = manifest.context_parallel  # every layer's attention split into cp.size chunks
        self.cp_basis = None if cp is None else CPBasis.for_spec(cp, shape, manifest.seed)
        self.layers = nn.ModuleList(
            Block(shape, None if cp is None else CPAttention(shape, cp, layer, self.cp_basis)) for layer in layers
        )
        for layer, block in zip(layers, self.layers, strict=True):
            _init_block(block, manifest.seed, layer, shape.n_layers)
        cos, sin = rope_tables(shape.d_model // shape.n_heads, shape.max_seq_len, shape.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if self.is_head:
            self.t_s = nn.Parameter(
                torch.randn(shape.vocab_size, shape.d_model, generator=_seeded(manifest.seed, 2)) * 0.02
            )
        rank = manifest.stage_embedding_rank
        self.stage_embedding = (
            StageEmbedding(shape.vocab_size, shape.d_model, rank, _seeded(manifest.seed, 4, index)) if rank else None
        )
        if self.is_tail:
            self.final_norm = RMSNorm(shape.d_model, shape.norm_eps)
            self.lm_head = nn.Linear(shape.d_model, shape.vocab_size, bias=False)
            with torch.no_grad():
                self.lm_head.weight.copy_(
                    torch.randn(self.lm_head.weight.shape, generator=_seeded(manifest.seed, 3)) * 0.02
                )
        self.mode = manifest.mode
        self.constrained = self.mode.constrained(self)
        self.u_accumulator = UpdateAccumulator(shape.d_model, manifest.k) if manifest.updates_u else None
        with torch.no_grad():
            for item in self.constrained:
                item.param.copy_(self.subspace.project(item.param, item.axis))
        for item in self.constrained:
            item.param.register_hook(self._projector(item.param, item.axis))

    def _projector(self, param: nn.Parameter, axis: int):
        """Gradient hook: note the raw gradient's ∂L/∂U term if U is to move, then project."""

        def hook(grad: torch.Tensor) -> torch.Tensor:
            if self.u_accumulator is not None and self._weights_drive_updates:
                self.u_accumulator.add(weight_term(grad, param, self.subspace.basis, axis))
            return self.subspace.project(grad, axis)

        return hook

    @property
    def _weights_drive_updates(self) -> bool:
        return self.manifest.u_driver.weight_terms(self.mode)

    @property
    def projects_boundary(self) -> bool:
        return self.mode.projects_boundary(self)

    def forward(self, hidden: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor:
        """Head: tokens → residual. Middle: residual → residual. Tail: residual → logits."""
        return self.forward_with_residual(hidden, tokens)[0]

    def forward_with_residual(
        self, hidden: torch.Tensor | None, tokens: torch.Tensor, **attention: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Also returns x − T_fixed[tok] before the boundary projection (boundary mode, non-tail):
        the sender's half of a subspace update needs the part the projection removes. `attention` goes to
        every layer's attention (`round_wire=False`: a context-parallel one with nothing rounded)."""
        hidden = self.enter(hidden, tokens)
        for block in self.layers:
            hidden = block(hidden, self.rope_cos, self.rope_sin, **attention)
        return self.finish(hidden, tokens)

    def enter(self, hidden: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor:
        """What the first layer reads: on the head T_fixed[tok] + T_S[tok], elsewhere the received residual;
        plus the stage embedding if the run has one. Per token, so a chunk of a sequence enters alone."""
        if self.is_head:
            hidden = self.subspace.t_fixed[tokens] + self.t_s[tokens]
        elif hidden is None:
            raise ValueError(f"stage {self.index} needs the residual stream of stage {self.index - 1}")
        if self.stage_embedding is not None:
            hidden = hidden + self.stage_embedding(tokens)
        return hidden

    def finish(self, hidden: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After the last layer: the stage embedding taken out again (not on the tail), the boundary
        projection (and the residual it removes, when U moves), then the logits on the tail. Per token, so a
        context-parallel lane finishes its chunk alone."""
        residual = None
        if self.stage_embedding is not None and not self.is_tail:
            hidden = hidden - self.stage_embedding(tokens)
        if self.projects_boundary:
            anchor = self.subspace.t_fixed[tokens]
            if self.u_accumulator is not None:
                residual = (hidden - anchor).detach()
            hidden = anchor + self.subspace.project(hidden - anchor, axis=-1)
        if self.is_tail:
            return self.lm_head(self.final_norm(hidden)), None
        return hidden, residual

    def measure_throughput(self, microbatch_size: int, seq_len: int, repeats: int = 2) -> float:
        """Tokens/s of forward + backward on one random microbatch (no optimizer step): the speed a peer
        announces. The probe's gradients are not training signal: they and its U terms are dropped. Also sets
        `trip_activation_bytes`, what one trip's graph keeps here until its gradient returns (the tensors
        autograd saved, parameters and buffers not counted, each storage once; the probe's loss saves the output,
        as a trip holds it): what bounds the trips a peer holds (`peer/memory.py`)."""
        device = self.rope_cos.device
        tokens = torch.randint(0, self.manifest.model.vocab_size, (microbatch_size, seq_len), device=device)
        hidden = None if self.is_head else self.subspace.t_fixed[tokens].detach().clone().requires_grad_(True)
        weights = {t.untyped_storage().data_ptr() for t in [*self.parameters(), *self.buffers()]}
        saved: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in weights:
                saved[storage.data_ptr()] = storage.nbytes()
            return tensor

        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                output, _ = self.forward_with_residual(hidden, tokens)
                output.float().pow(2).mean().backward()
            best = min(best, time.perf_counter() - started)
            self.trip_activation_bytes, saved = sum(saved.values()), {}
        self.zero_grad(set_to_none=True)
        if self.u_accumulator is not None:
            self.u_accumulator.reset()
        return tokens.numel() / best

    def note_boundaries(
        self,
        tokens: torch.Tensor,
        input_hidden: torch.Tensor | None,
        input_grad: torch.Tensor | None,
        output_residual: torch.Tensor | None,
        output_grad: torch.Tensor | None,
    ) -> None:
        """After a trip's backward: add this stage's boundary halves of ∂/∂U to the accumulator and
        close the microbatch (the weight hooks of subspace mode have already added theirs)."""
        if self.u_accumulator is None:
            return
        basis, driver = self.subspace.basis, self.manifest.u_driver
        with torch.no_grad():
            if input_grad is not None and input_hidden is not None:
                grad = input_grad.float()
                if driver.receiver_energy:
                    self.u_accumulator.add(receiver_term(grad, grad @ basis))
                elif driver.boundary_terms(self.mode):
                    coefficients = (input_hidden.float() - self.subspace.t_fixed[tokens]) @ basis
                    self.u_accumulator.add(receiver_term(grad, coefficients))
            if output_residual is not None and output_grad is not None and driver.boundary_terms(self.mode):
                self.u_accumulator.add(sender_term(output_residual.float(), output_grad.float() @ basis))
            self.u_accumulator.finish_microbatch()

    def backward_or_recompute(self, backward: Callable[[bool], Result]) -> Result:
        """The one rule for a trip whose saved graph went stale: `backward(False)` runs the backward
        through the graph its forward saved; if an optimizer step changed a saved weight in place since
        then, autograd refuses that graph, what the projection hooks that already ran added to ∂/∂U is
        taken back, and `backward(True)` recomputes the forward with the current weights, then runs its
        backward (a `backward` that writes `.grad` clears what the refused try wrote there first). The
        test is torch's error text: autograd raises no narrower exception for it."""
        accumulator = self.u_accumulator
        snapshot = accumulator.snapshot() if accumulator is not None else None
        try:
            return backward(False)
        except RuntimeError as exc:
            if "modified by an inplace operation" not in str(exc):
                raise
        if snapshot is not None:
            accumulator.restore(snapshot)
        return backward(True)

    def apply_basis(self, basis: torch.Tensor, version: int, optimizer=None) -> None:
        """Switch to U': everything that lives in span(U) (constrained tensors, their first moments)
        is re-projected onto span(U'), and the accumulator starts over."""
        self.subspace.set_basis(basis, version)
        self.reproject_()
        if optimizer is not None and hasattr(optimizer, "reproject_state"):
            optimizer.reproject_state()
        if self.u_accumulator is not None:
            self.u_accumulator.reset()

    def reproject_(self) -> None:
        """Wash out float drift: W ← P W for every constrained tensor."""
        with torch.no_grad():
            for item in self.constrained:
                item.param.copy_(self.subspace.project(item.param, item.axis))

    def subspace_residual(self) -> float:
        """max ‖W − PW‖/‖W‖ over constrained tensors (0 when none)."""
        worst = 0.0
        with torch.no_grad():
            for item in self.constrained:
                w = item.param
                worst = max(
                    worst, ((w - self.subspace.project(w, item.axis)).norm() / w.norm().clamp_min(1e-30)).item()
                )
        return worst


def predicted_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of `targets` (B, T) from the first T positions of `logits` (B, ≥ T, V), computed in
    float32 at least (float64 stays float64, so a double-precision check stays exact). A whole sequence
    (`next_token_loss`) and a context-parallel lane's chunk (`swarm.cp_lane.LaneTrip.loss`) share it."""
    logits = logits[:, : targets.shape[1]].reshape(-1, logits.shape[-1])
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, targets.reshape(-1), reduction=reduction)


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting tokens[:, 1:] from logits[:, :-1]."""
    return predicted_loss(logits, tokens[:, 1:])


def build_stages(manifest: Manifest) -> list[PipelineStage]:
    return [PipelineStage(manifest, i) for i in range(manifest.num_stages)]
