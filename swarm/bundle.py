"""An exported model file, loaded and run: the stages rebuilt from the bundle `swarm/export.py` wrote, chained
as the swarm chains them, and text sampled from them.

`load_bundle` trusts nothing in the file it did not check: the format and version, the manifest, the run id,
the frozen tensors against their hashes, and every stage's state dict against the shapes its manifest builds.
`chain_logits` runs the stages as a trip does (each stage's boundary projection is part of it; `wire=True` also
rounds every boundary through the real wire codec, the swarm's exact function); `generate_ids` samples.

Pure logic: a file in, tensors and token ids out; no networking and no processes.
"""

from __future__ import annotations

import json
import math
import pickle
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.codec import BoundaryCodec
from swarm.export import BUNDLE_FORMAT, BUNDLE_VERSION, ExportError, one_line
from swarm.manifest import Manifest, ManifestError, parse_manifest
from swarm.model import PipelineStage
from swarm.subspace import tensor_sha256


@dataclass
class LoadedModel:
    manifest: Manifest
    stages: list[PipelineStage]
    bundle: dict


def load_bundle(path: Path, device: str | torch.device = "cpu") -> LoadedModel:
    """The stages of an exported file, rebuilt from its manifest, its weights loaded, its frozen tensors
    (checked against the manifest's hashes) installed; in eval mode."""
    try:
        bundle = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        raise ExportError(
            f"{path} holds objects other than tensors and plain values; refusing to unpickle it"
        ) from None
    except Exception as exc:  # noqa: BLE001 - missing, truncated, not a torch file: one refusal
        raise ExportError(f"{path} cannot be read ({one_line(exc)})") from None
    if not isinstance(bundle, dict) or bundle.get("format") != BUNDLE_FORMAT:
        raise ExportError(f"{path} is not a model exported by `protocol-swarm export`")
    if bundle.get("version") != BUNDLE_VERSION:
        raise ExportError(
            f"{path} is export format version {bundle.get('version')}, this software reads {BUNDLE_VERSION}"
        )
    try:
        manifest = parse_manifest(json.loads(bundle["manifest"]))
    except (ManifestError, ValueError, TypeError, KeyError) as exc:
        raise ExportError(f"{path}: its manifest is unusable ({one_line(exc)})") from None
    if bundle.get("run_id") != manifest.run_id:
        raise ExportError(f"{path}: run_id {bundle.get('run_id')!r} does not match its manifest ({manifest.run_id})")
    t_fixed, u = bundle.get("t_fixed"), bundle.get("u")
    if not isinstance(t_fixed, torch.Tensor) or not isinstance(u, torch.Tensor):
        raise ExportError(f"{path}: the frozen tensors t_fixed and u are missing")
    if manifest.t_fixed_sha256 and tensor_sha256(t_fixed) != manifest.t_fixed_sha256:
        raise ExportError(f"{path}: its T_fixed does not match the manifest's T_fixed hash")
    if tensor_sha256(u) != bundle.get("u_sha256"):
        raise ExportError(f"{path}: its U does not match the U hash recorded in it")
    state_dict = bundle.get("state_dict")
    if not isinstance(state_dict, dict):
        raise ExportError(f"{path}: no state_dict")
    u_version = int(bundle.get("u_version", 0))
    stages = []
    for index in range(manifest.num_stages):
        prefix = f"stages.{index}."
        own = {name[len(prefix) :]: t for name, t in state_dict.items() if name.startswith(prefix)}
        stage = PipelineStage(manifest, index)
        try:
            stage.load_state_dict(own)
        except RuntimeError as exc:
            raise ExportError(f"{path}: stage {index} does not fit its manifest ({one_line(exc)})") from None
        stage.subspace.t_fixed = t_fixed  # the file's table, one copy shared by every stage
        stage.subspace.set_basis(u, u_version)
        stages.append(stage.to(device).eval())
    return LoadedModel(manifest, stages, bundle)


# --------------------------------------------------------------------------------------------- running it


def chain_logits(stages: Sequence[PipelineStage], tokens: torch.Tensor, wire: bool = True) -> torch.Tensor:
    """Logits of the chained stages for `tokens` (B, S): each stage's own boundary projection included;
    with `wire`, every boundary also goes through the swarm's codec (its wire dtype's rounding, exactly what a
    trip computes), without it the chain stays in float32."""
    hidden = None
    codecs = [BoundaryCodec(stage.manifest, stage.subspace) for stage in stages] if wire else []
    with torch.no_grad():
        for i, stage in enumerate(stages):
            if i > 0 and wire:
                hidden = _across_wire(codecs[i - 1], codecs[i], hidden, tokens, i)
            hidden, _ = stage.forward_with_residual(hidden, tokens)
    return hidden


def _across_wire(
    sender: BoundaryCodec, receiver: BoundaryCodec, hidden: torch.Tensor, tokens: torch.Tensor, stage: int
) -> torch.Tensor:
    """`hidden` as stage `stage` receives it: encoded and decoded by the real codec. The codec treats every token
    on its own (compression, rounding, int8 scales are per token), so a batch larger than a trip's travels in
    trip-sized pieces and a one-token window travels doubled (a message carries at least two tokens)."""
    if tokens.shape[1] < 2:
        doubled = _across_wire(sender, receiver, hidden.repeat(1, 2, 1), tokens.repeat(1, 2), stage)
        return doubled[:, :1]
    trip_id, pieces = uuid.uuid4().hex, []
    size = sender.manifest.batch.microbatch_size
    for part, ids in zip(hidden.split(size), tokens.split(size), strict=True):
        blob = sender.encode_forward(part, ids, trip_id, to_stage=stage)
        pieces.append(receiver.decode_forward(blob, stage=stage)[1])
    return torch.cat(pieces)


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """One token id from the last position's logits: greedy at temperature 0, else softmax(logits / T) over
    the top_k most likely (all when top_k is 0)."""
    logits = logits.float().cpu()
    if temperature <= 0:
        return int(logits.argmax())
    if 0 < top_k < logits.numel():
        floor = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < floor, -math.inf)
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def generate_ids(
    stages: Sequence[PipelineStage],
    prompt: Sequence[int],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 0,
    seed: int = 0,
    wire: bool = True,
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """The new token ids after `prompt`, recomputing the whole window for every token (no K/V cache: this is
    for looking at a trained model, not serving it); the window is the last max_seq_len tokens."""
    manifest = stages[0].manifest
    if manifest.context_parallel is not None:
        raise ExportError(
            "generate does not run context-parallel models: their attention is defined on sequences cut into "
            f"{manifest.context_parallel.size} equal chunks"
        )
    if not prompt:
        raise ExportError("the prompt is empty: give at least one token")
    device = stages[0].subspace.basis.device
    generator = torch.Generator().manual_seed(seed)
    ids, new = list(prompt), []
    for _ in range(max_new_tokens):
        window = torch.tensor([ids[-manifest.model.max_seq_len :]], dtype=torch.long, device=device)
        token = sample_next(chain_logits(stages, window, wire)[0, -1], temperature, top_k, generator)
        ids.append(token)
        new.append(token)
        if on_token is not None:
            on_token(token)
    return new
