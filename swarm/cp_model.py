"""The one-process context-parallel model, and the PCA warm start of its K/V bases.

`CPDecoder` is not a second decoder: it is a `swarm.model.PipelineStage` of a one-stage run with
context parallelism on (`cp_manifest`), so its blocks, their init, the embedding, the head and the loss
are the pipeline's, and a layer starts with the weights it has in any stage split of the same seed. It
is what the one-process benchmark and tests train, and what `swarm.cp_wire.wire_step` drives as P lanes.
Every layer's attention is a `swarm.cp_attention.CPAttention`.
"""

from __future__ import annotations

import torch

from swarm.context_parallel import ContextParallelSpec, CPBasis, pca_basis
from swarm.cp_attention import CPAttention
from swarm.cp_modes import DENSE_KV, KVCompression
from swarm.manifest import BatchSpec, Manifest, ModelShape, StageSpec
from swarm.model import PipelineStage


def cp_manifest(shape: ModelShape, spec: ContextParallelSpec, seed: int) -> Manifest:
    """A one-stage run of `shape` with context parallelism `spec`: no boundary, so no compression mode and
    nothing constrained (k is the smallest the manifest takes; nothing uses it); the batch fields only
    have to pass the manifest's checks (the longest sequence that splits into `spec.size` chunks)."""
    return Manifest(
        name="cp-decoder",
        model=shape,
        stages=(StageSpec(first_layer=0, end_layer=shape.n_layers),),
        k=1,
        compression="none",
        seed=seed,
        batch=BatchSpec(
            microbatch_size=1, seq_len=shape.max_seq_len - shape.max_seq_len % spec.size, target_batch_size=1
        ),
        context_parallel=spec,
    )


class CPDecoder(PipelineStage):
    """Embedding, context-parallel blocks, final norm and LM head in one process: the simulator's model.
    `forward` takes the tokens alone (the stage is the head); `kv_mode`/`compress_active` switch what crosses
    between chunks for a dense warm-up, and `start_collecting`/`warm_start` run the PCA warm start."""

    def __init__(self, shape: ModelShape, spec: ContextParallelSpec, seed: int):
        super().__init__(cp_manifest(shape, spec, seed), 0)

    @property
    def spec(self) -> ContextParallelSpec:
        return self.manifest.context_parallel

    @property
    def attentions(self) -> list[CPAttention]:
        return [block.attn for block in self.layers]

    @property
    def kv_mode(self) -> KVCompression:
        """What crosses between chunks now: the spec's mode, or none during a dense warm-up (`mode` is the
        stage's boundary compression mode, none here)."""
        return self.layers[0].attn.mode

    @property
    def compressed(self) -> bool:
        return self.kv_mode.compressed

    @property
    def compress_active(self) -> bool:
        return self.kv_mode is self.spec.mode

    @compress_active.setter
    def compress_active(self, on: bool) -> None:
        for attn in self.attentions:
            attn.mode = self.spec.mode if on else DENSE_KV

    def forward(self, tokens: torch.Tensor, round_wire: bool = True) -> torch.Tensor:
        """Tokens → logits; `round_wire=False` leaves every crossing unrounded (exact dense attention)."""
        return self.forward_with_residual(None, tokens, round_wire=round_wire)[0]

    def start_collecting(self) -> None:
        start_collecting(self.attentions)

    def warm_start(self) -> dict:
        return warm_start(self.attentions, [self.cp_basis])


def start_collecting(attentions: list[CPAttention]) -> None:
    """Sum Kᵀ K and Vᵀ V of every chunk from now on (forward passes), for the PCA warm start."""
    for attn in attentions:
        attn.stats = {which: torch.zeros(attn.d_kv, attn.d_kv, dtype=torch.float64) for which in ("k", "v")}


def warm_start(attentions: list[CPAttention], bases: list[CPBasis]) -> dict:
    """Switch to Ū = principal components of the K/V collected since start_collecting, in every basis
    copy (one per pipeline stage, every layer each: `attentions` must cover every layer), turn
    compression on, bump the basis version; returns what changed (version, hash, energy kept)."""
    ubars, kept = {}, {}
    for attn in attentions:
        if attn.stats is None:
            raise RuntimeError("warm_start needs K/V statistics: call start_collecting before the warm-up steps")
        for which, rank in (("k", attn.spec.r_k), ("v", attn.spec.r_v)):
            stats = attn.stats[which]
            ubars[attn.layer, which] = pca_basis(stats, rank)
            u = ubars[attn.layer, which].double()
            kept[f"{attn.layer}{which}"] = float(torch.trace(u.T @ stats @ u) / torch.trace(stats))
        attn.stats = None
    version = bases[0].version + 1
    for basis in bases:
        basis.switch(ubars, version)
    for attn in attentions:
        attn.mode = attn.spec.mode
    same = len({basis.sha256 for basis in bases}) == 1
    return {"version": version, "sha256": bases[0].sha256, "same_on_every_copy": same, "energy_kept": kept}
