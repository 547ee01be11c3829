"""Taking a trained model home: one file from a run's stage checkpoints, and text from that file.

A run's weights are scattered over its peers: each holds one stage and saves it to its
`--checkpoint-dir` as `<dir>/<run_id>/stage<N>.pt` (`peer/runtime.py`). `assemble` reads such files
(found under any folders given, e.g. the organiser's own peers' checkpoint dirs or a local swarm's
work dir), keeps one per stage (the newest epoch), verifies every piece against the manifest and
returns one self-contained bundle. The checks are the ones a peer makes before it trusts a stage,
since a wrong piece would give a model that loads fine and computes something else:

- the checkpoint is of this run (`run_id`) and of a stage of it, each stage present exactly once;
- its parameters have exactly the names and shapes a stage built from the manifest has, and are
  finite;
- the T_fixed hash and the U it was saved under, where the checkpoint records them
  (`t_fixed_sha256`, `u_version`, `u`), match the manifest and agree across stages; a run that moves U cannot be
  exported from checkpoints that do not say which U they were trained under;
- the tensors the compression mode keeps in span(U) are in span(U) (else the U is not theirs).

The bundle (`save_bundle`) is a plain dict that `torch.load(path, weights_only=True)` reads: the
stages' state dict keyed `stages.<i>.<name>` (as a module holding them in `self.stages = nn.ModuleList(...)`
names them: `nn.ModuleDict({"stages": nn.ModuleList(stages)})` loads it), the
canonical manifest JSON, and the frozen tensors the function needs but no state dict holds
(`t_fixed`, `u`), so the file is the whole model without this package's seed derivation.
`load_bundle` rebuilds the stages from it; `chain_logits` runs them as the swarm does (the boundary
projections are part of the stages; `wire=True` also rounds every boundary through the real wire
codec, the swarm's exact function), and `generate` samples text.

`llama_blockers` / `to_llama` write a Hugging Face `LlamaForCausalLM` state dict, but only where that
is the same function: T_fixed + T_S fold into one embedding table, while a boundary projection,
stage-local embeddings of a multi-stage run or context-parallel attention have no LLaMA equivalent.

Pure logic: files on disk in, tensors and dicts out; no networking and no processes.
"""

from __future__ import annotations

import json
import math
import pickle
import re
import struct
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from swarm.codec import BoundaryCodec
from swarm.manifest import Manifest, ManifestError, load_manifest, parse_manifest
from swarm.model import PipelineStage
from swarm.presets import verify_hashes
from swarm.subspace import initial_basis, t_fixed_table, tensor_sha256

BUNDLE_FORMAT = "protocol-swarm-model"
BUNDLE_VERSION = 1
CHECKPOINT_GLOB = "stage*.pt"
# A stage checkpoint holds what peer/runtime.py saves (run_id, stage, epoch, model, optimizer) and may also
# record `t_fixed_sha256` (the T_fixed the stage computed with) and the U it was trained under: `u_version`,
# `u` (the d×k tensor), `u_sha256`. Checked when present; a run whose U moves needs them (see `resolve_u`).
# how far a constrained tensor may stray from span(U) (relative): peers re-project every epoch, so float
# drift stays near 1e-6; a tensor trained under another U is off by order one
SUBSPACE_TOLERANCE = 1e-3
ORTHONORMAL_TOLERANCE = 1e-4
_RUN_ID = re.compile(r"^.+-[0-9a-f]{12}$")  # `Manifest.run_id`: name, dash, 12 hex digits


class ExportError(ValueError):
    """A reason not to export (or load, or generate); the message is one line that names the file or stage."""


def _one_line(exc: BaseException, limit: int = 200) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------------------------- reading


@dataclass
class StageCheckpoint:
    """One stage checkpoint as a peer saved it, with the optional records it may carry."""

    path: Path
    run_id: str
    stage: int
    epoch: int
    model: dict[str, torch.Tensor]
    mtime: float
    t_fixed_sha256: str | None = None
    u_version: int | None = None
    u: torch.Tensor | None = None
    u_sha256: str | None = None


def read_checkpoint(path: Path) -> StageCheckpoint:
    """Load a stage checkpoint without running any pickled code (weights_only) and memory-mapped (a large
    stage is paged in only as far as it is read); anything that is not one becomes an ExportError."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        raise ExportError(
            f"checkpoint {path} holds objects other than tensors and plain values; refusing to unpickle it"
        ) from None
    except Exception as exc:  # noqa: BLE001 - truncated, not a zip, a folder, no permission: all one refusal
        raise ExportError(f"checkpoint {path} cannot be read ({_one_line(exc)})") from None
    if not isinstance(state, dict):
        raise ExportError(f"{path} is not a stage checkpoint (it holds a {type(state).__name__}, not a dict)")
    missing = [key for key in ("run_id", "stage", "epoch", "model") if key not in state]
    if missing:
        raise ExportError(f"{path} is not a stage checkpoint (no {', '.join(missing)})")
    run_id, stage, epoch, model = state["run_id"], state["stage"], state["epoch"], state["model"]
    if not isinstance(run_id, str) or not isinstance(stage, int) or not isinstance(epoch, int):
        raise ExportError(f"{path} is not a stage checkpoint (run_id, stage or epoch of the wrong type)")
    if not isinstance(model, dict) or not all(isinstance(t, torch.Tensor) for t in model.values()):
        raise ExportError(f"{path} is not a stage checkpoint ('model' is not a dict of tensors)")
    u = state.get("u")
    if u is not None and not isinstance(u, torch.Tensor):
        raise ExportError(f"checkpoint {path}: 'u' is not a tensor")
    u_version = state.get("u_version")
    if u_version is not None and not (isinstance(u_version, int) and u_version >= 0):
        raise ExportError(f"checkpoint {path}: 'u_version' is not a version number")
    return StageCheckpoint(
        path=path,
        run_id=run_id,
        stage=stage,
        epoch=epoch,
        model=model,
        mtime=path.stat().st_mtime,
        t_fixed_sha256=state.get("t_fixed_sha256") or None,
        u_version=u_version,
        u=u,
        u_sha256=state.get("u_sha256") or None,
    )


@dataclass
class Selection:
    """One checkpoint per stage, and what was noticed on the way (skipped runs, older duplicates)."""

    chosen: dict[int, StageCheckpoint]
    notes: list[str] = field(default_factory=list)


def find_manifest(paths: Sequence[Path]) -> Path | None:
    """The `manifest.json` at the top of a given folder (a local swarm's work dir has one), if exactly one."""
    found = {p / "manifest.json" for p in paths if (p / "manifest.json").is_file()}
    return found.pop() if len(found) == 1 else None


def load_run_manifest(path: Path) -> Manifest:
    """The manifest file, with its recorded T_fixed/U hashes checked as a peer checks them."""
    try:
        manifest = load_manifest(path)
        verify_hashes(manifest)
    except ManifestError as exc:
        raise ExportError(str(exc)) from None
    return manifest


def select_checkpoints(manifest: Manifest, paths: Sequence[Path]) -> Selection:
    """Every checkpoint of this run under `paths` (files, or folders searched for `stage*.pt`), one per stage.

    A file named on the command line must be of this run; files found in folders that belong to another
    run are skipped (a peer's checkpoint dir keeps one folder per run) and counted in a note. Of several
    checkpoints of one stage the newest epoch wins (then the newest file), and a note says so."""
    if not paths:
        raise ExportError("no checkpoint files or folders given")
    explicit, scanned = [], []
    for path in paths:
        if path.is_file():
            explicit.append(path)
        elif path.is_dir():
            scanned.extend(sorted(path.rglob(CHECKPOINT_GLOB)))
        else:
            raise ExportError(f"{path} is neither a checkpoint file nor a folder")
    run_id, notes = manifest.run_id, []
    other_runs: Counter[str] = Counter()
    found: dict[int, list[StageCheckpoint]] = {}
    for path in [*explicit, *scanned]:
        named = path.parent.name
        if path not in explicit and named != run_id and _RUN_ID.match(named):
            other_runs[named] += 1  # a peer's folder of another run: not even opened
            continue
        checkpoint = read_checkpoint(path)
        if checkpoint.run_id != run_id:
            if path in explicit:
                raise ExportError(f"checkpoint {path} is of run {checkpoint.run_id}, not of {run_id}")
            other_runs[checkpoint.run_id] += 1
            continue
        if not 0 <= checkpoint.stage < manifest.num_stages:
            raise ExportError(
                f"checkpoint {path} is of stage {checkpoint.stage}, but run {run_id} has stages "
                f"0..{manifest.num_stages - 1}"
            )
        found.setdefault(checkpoint.stage, []).append(checkpoint)
    if other_runs:
        runs = ", ".join(f"{run} ({count})" for run, count in sorted(other_runs.items()))
        notes.append(f"skipped checkpoints of other runs: {runs}")
    missing = [s for s in range(manifest.num_stages) if s not in found]
    if missing:
        where = ", ".join(str(p) for p in paths)
        layers = "; ".join(f"stage {s} = layers {_layers(manifest, s)}" for s in missing)
        seen = f"; found stages {sorted(found)}" if found else ""
        others = (
            f"; found only other runs' checkpoints ({', '.join(sorted(other_runs))}): wrong manifest?"
            if (other_runs and not found)
            else ""
        )
        raise ExportError(f"no checkpoint of {layers} of run {run_id} under {where}{seen}{others}")
    chosen = {}
    for stage, candidates in sorted(found.items()):
        candidates.sort(key=lambda c: (c.epoch, c.mtime))
        best = candidates[-1]
        chosen[stage] = best
        if len(candidates) > 1:
            epochs = ", ".join(str(c.epoch) for c in reversed(candidates))
            notes.append(
                f"stage {stage}: {len(candidates)} checkpoints (epochs {epochs}); took the newest, "
                f"epoch {best.epoch} from {best.path}"
            )
    return Selection(chosen, notes)


def _layers(manifest: Manifest, stage: int) -> str:
    layers = manifest.layers_of(stage)
    return f"{layers.start}-{layers.stop - 1}" if len(layers) > 1 else str(layers.start)


# --------------------------------------------------------------------------------------------- verifying


def resolve_u(manifest: Manifest, chosen: dict[int, StageCheckpoint]) -> tuple[int, torch.Tensor]:
    """The one U (version, d×k tensor) every chosen stage was trained under.

    A checkpoint that records U gives it; one that records only version 0 means the seed's U; one that
    records nothing means U v0 unless the run moves U and the stage is past its first update (then which U
    its constrained tensors and boundaries belong to is unknown, and exporting would be a guess)."""
    shape = manifest.model
    seed_u = initial_basis(manifest.seed, shape.d_model, manifest.k)
    claims: dict[int, tuple[int, torch.Tensor]] = {}
    for stage, c in chosen.items():
        if c.u is not None:
            u = c.u.detach().to(torch.float32).cpu()
            if tuple(u.shape) != (shape.d_model, manifest.k):
                raise ExportError(
                    f"checkpoint {c.path}: U has shape {tuple(u.shape)}, the run's is {(shape.d_model, manifest.k)}"
                )
            if not torch.isfinite(u).all():
                raise ExportError(f"checkpoint {c.path}: U is not finite")
            error = (u.double().T @ u.double() - torch.eye(manifest.k, dtype=torch.float64)).abs().max().item()
            if error > ORTHONORMAL_TOLERANCE:
                raise ExportError(f"checkpoint {c.path}: U is not orthonormal (max |UᵀU − I| = {error:.2e})")
            if c.u_sha256 and c.u_sha256 != tensor_sha256(u):
                raise ExportError(f"checkpoint {c.path}: U does not match the U hash recorded with it")
            if c.u_version is None:
                raise ExportError(f"checkpoint {c.path} records U but not its version")
            if c.u_version == 0 and tensor_sha256(u) != tensor_sha256(seed_u):
                raise ExportError(f"checkpoint {c.path}: its U v0 is not the run seed's U v0")
            claims[stage] = (c.u_version, u)
        elif c.u_version:
            raise ExportError(f"checkpoint {c.path} was saved under U v{c.u_version} but does not record that U")
        elif c.u_version == 0 or not manifest.updates_u or c.epoch < manifest.subspace_update_interval:
            claims[stage] = (0, seed_u)
        else:
            raise ExportError(
                f"run {manifest.run_id} moves U every {manifest.subspace_update_interval} epochs and checkpoint "
                f"{c.path} (epoch {c.epoch}) does not record which U it was trained under: cannot export it exactly"
            )
    hashes = {stage: (version, tensor_sha256(u)) for stage, (version, u) in claims.items()}
    if len({digest for _, digest in hashes.values()}) > 1:
        seen = ", ".join(f"stage {s} U v{v}" for s, (v, _) in sorted(hashes.items()))
        raise ExportError(f"the stages were saved under different U ({seen}): export checkpoints taken under one U")
    return next(iter(claims.values()))


def expected_parameters(stage: PipelineStage) -> dict[str, tuple[int, ...]]:
    return {name: tuple(tensor.shape) for name, tensor in stage.state_dict().items()}


def verify_stage(manifest: Manifest, c: StageCheckpoint, u_version: int, u: torch.Tensor) -> PipelineStage:
    """A stage built from the manifest with the checkpoint's parameters loaded, once they passed every check;
    returned so the caller can read what the mode does at its boundary."""
    if c.t_fixed_sha256 and c.t_fixed_sha256 != manifest.t_fixed_sha256:
        raise ExportError(
            f"checkpoint {c.path} was computed with T_fixed {c.t_fixed_sha256[:16]}…, the manifest's is "
            f"{manifest.t_fixed_sha256[:16]}…"
        )
    stage = PipelineStage(manifest, c.stage)
    expected = expected_parameters(stage)
    missing = sorted(set(expected) - set(c.model))
    extra = sorted(set(c.model) - set(expected))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {_few(missing)}")
        if extra:
            parts.append(f"unexpected {_few(extra)}")
        raise ExportError(f"checkpoint {c.path} (stage {c.stage}) does not fit the manifest: {'; '.join(parts)}")
    for name, want in expected.items():
        tensor = c.model[name]
        if tuple(tensor.shape) != want:
            raise ExportError(
                f"checkpoint {c.path} (stage {c.stage}): {name} has shape {tuple(tensor.shape)}, the manifest "
                f"makes it {want}"
            )
        if not tensor.is_floating_point():
            raise ExportError(f"checkpoint {c.path} (stage {c.stage}): {name} is {tensor.dtype}, not floating point")
        if not torch.isfinite(tensor).all():
            raise ExportError(f"checkpoint {c.path} (stage {c.stage}): {name} holds NaN or inf")
    stage.load_state_dict(c.model)
    if u_version:
        stage.subspace.set_basis(u, u_version)
    residual = stage.subspace_residual()
    if residual > SUBSPACE_TOLERANCE:
        raise ExportError(
            f"checkpoint {c.path} (stage {c.stage}): its constrained tensors are {residual:.2g} (relative) outside "
            f"span(U v{u_version}); they were trained under another U"
        )
    return stage


def _few(names: list[str], shown: int = 3) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


# --------------------------------------------------------------------------------------------- the bundle


@dataclass
class Export:
    """What `assemble` made: the bundle to save, whether each stage ends with the boundary projection (what
    decides whether the model is a plain LLaMA), and what to tell the organiser."""

    bundle: dict
    projects_boundary: list[bool]
    notes: list[str]


def assemble(manifest: Manifest, paths: Sequence[Path]) -> Export:
    """Select, verify and bundle a run's stage checkpoints (module docstring)."""
    selection = select_checkpoints(manifest, paths)
    u_version, u = resolve_u(manifest, selection.chosen)
    shape = manifest.model
    t_fixed = t_fixed_table(manifest.seed, shape.vocab_size, shape.d_model, manifest.t_fixed_std)
    t_fixed_sha256 = tensor_sha256(t_fixed)
    if manifest.t_fixed_sha256 and t_fixed_sha256 != manifest.t_fixed_sha256:  # verify_hashes checked it already
        raise ExportError("T_fixed derived here does not match the manifest's hash")
    projects, state_dict, provenance = [], {}, []
    for index, checkpoint in sorted(selection.chosen.items()):
        # one verified stage alive at a time: a big run's stages are not all held twice
        projects.append(verify_stage(manifest, checkpoint, u_version, u).projects_boundary)
        for name, tensor in checkpoint.model.items():
            state_dict[f"stages.{index}.{name}"] = tensor
        provenance.append({"stage": index, "epoch": checkpoint.epoch, "source": str(checkpoint.path)})
    bundle = {
        "format": BUNDLE_FORMAT,
        "version": BUNDLE_VERSION,
        "run_id": manifest.run_id,
        "manifest": manifest.canonical_json(),
        "state_dict": state_dict,
        "t_fixed": t_fixed,
        "t_fixed_sha256": t_fixed_sha256,
        "u": u.contiguous(),
        "u_version": u_version,
        "u_sha256": tensor_sha256(u),
        "stages": provenance,
    }
    return Export(bundle, projects, selection.notes)


def save_bundle(bundle: dict, path: Path) -> None:
    """Write next to the target and rename, so an interrupted export never leaves half a model there."""
    tmp = path.with_name(path.name + f".{uuid.uuid4().hex[:8]}.tmp")
    try:
        torch.save(bundle, tmp)
        tmp.replace(path)
    except (OSError, RuntimeError) as exc:  # torch.save says RuntimeError for a missing folder
        tmp.unlink(missing_ok=True)
        raise ExportError(f"cannot write {path}: {_one_line(exc)}") from None


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
        raise ExportError(f"{path} cannot be read ({_one_line(exc)})") from None
    if not isinstance(bundle, dict) or bundle.get("format") != BUNDLE_FORMAT:
        raise ExportError(f"{path} is not a model exported by `protocol-swarm export`")
    if bundle.get("version") != BUNDLE_VERSION:
        raise ExportError(
            f"{path} is export format version {bundle.get('version')}, this software reads {BUNDLE_VERSION}"
        )
    try:
        manifest = parse_manifest(json.loads(bundle["manifest"]))
    except (ManifestError, ValueError, TypeError, KeyError) as exc:
        raise ExportError(f"{path}: its manifest is unusable ({_one_line(exc)})") from None
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
            raise ExportError(f"{path}: stage {index} does not fit its manifest ({_one_line(exc)})") from None
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


# --------------------------------------------------------------------------------------------- LLaMA


def llama_blockers(manifest: Manifest, projects_boundary: Iterable[bool]) -> list[str]:
    """Why the run's function is not a plain LLaMA (empty when it is). `projects_boundary`: per stage, whether
    it ends with the boundary projection (`PipelineStage.projects_boundary`)."""
    reasons = []
    if any(projects_boundary):
        reasons.append(f"compression {manifest.compression!r} projects every stage boundary onto T_fixed + span(U)")
    if manifest.stage_embedding_rank and manifest.num_stages > 1:
        reasons.append("every stage adds and removes its own token embedding (stage_embedding_rank)")
    if manifest.context_parallel is not None:
        reasons.append("context-parallel attention passes K/V between chunks through their subspace")
    return reasons


def _rope_halves(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows from this model's RoPE on interleaved pairs (2i, 2i+1) to Hugging Face's on halves (i, i+hd/2):
    the same rotation once each head's rows are reordered evens first, odds after (q·k is unchanged)."""
    rows, cols = weight.shape
    head_dim = rows // heads
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    return weight.view(heads, head_dim, cols)[:, order, :].reshape(rows, cols)


def to_llama(manifest: Manifest, bundle: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """A `LlamaForCausalLM` config and state dict computing the bundle's float32 chain (no wire rounding).
    The caller checks `llama_blockers` first: this does not re-check."""
    shape, sd = manifest.model, bundle["state_dict"]
    last = manifest.num_stages - 1
    embed = bundle["t_fixed"].float() + sd["stages.0.t_s"].float()
    if manifest.stage_embedding_rank:  # one stage (else blocked): its table is added at the input, never removed
        table = sd["stages.0.stage_embedding.table"].float()
        up = sd.get("stages.0.stage_embedding.up")
        embed = embed + (table if up is None else table @ up.float())
    out = {"model.embed_tokens.weight": embed}
    for stage in range(manifest.num_stages):
        for local, layer in enumerate(manifest.layers_of(stage)):
            src, dst = f"stages.{stage}.layers.{local}.", f"model.layers.{layer}."
            out[dst + "self_attn.q_proj.weight"] = _rope_halves(sd[src + "attn.wq.weight"], shape.n_heads)
            out[dst + "self_attn.k_proj.weight"] = _rope_halves(sd[src + "attn.wk.weight"], shape.n_kv_heads)
            out[dst + "self_attn.v_proj.weight"] = sd[src + "attn.wv.weight"]
            out[dst + "self_attn.o_proj.weight"] = sd[src + "attn.wo.weight"]
            out[dst + "mlp.gate_proj.weight"] = sd[src + "mlp.w1.weight"]
            out[dst + "mlp.up_proj.weight"] = sd[src + "mlp.w3.weight"]
            out[dst + "mlp.down_proj.weight"] = sd[src + "mlp.w2.weight"]
            out[dst + "input_layernorm.weight"] = sd[src + "attn_norm.weight"]
            out[dst + "post_attention_layernorm.weight"] = sd[src + "mlp_norm.weight"]
    out["model.norm.weight"] = sd[f"stages.{last}.final_norm.weight"]
    out["lm_head.weight"] = sd[f"stages.{last}.lm_head.weight"]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.d_model,
        "intermediate_size": shape.d_ff,
        "num_hidden_layers": shape.n_layers,
        "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_kv_heads,
        "head_dim": shape.d_model // shape.n_heads,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_seq_len,
        "rope_theta": shape.rope_theta,  # transformers 4's name; 5 reads rope_parameters
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "rms_norm_eps": shape.norm_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "protocol_swarm": {"run_id": manifest.run_id, "tokenizer": manifest.tokenizer},
    }
    return config, {name: tensor.contiguous() for name, tensor in out.items()}


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """The safetensors format by hand (8-byte header length, JSON header, raw little-endian bytes), so writing a
    Hugging Face checkpoint needs neither `safetensors` nor `transformers` installed here."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise ExportError(f"{name}: dtype {tensor.dtype} has no safetensors name here")
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(raw)))
        handle.write(raw)
        for tensor in tensors.values():
            handle.write(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())


def write_llama(manifest: Manifest, bundle: dict, folder: Path) -> None:
    """`config.json` and `model.safetensors` in `folder`: `LlamaForCausalLM.from_pretrained(folder)` loads them."""
    config, tensors = to_llama(manifest, bundle)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_safetensors(tensors, folder / "model.safetensors")
    except OSError as exc:
        raise ExportError(f"cannot write the LLaMA checkpoint to {folder}: {_one_line(exc)}") from None

