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
`swarm/bundle.py` loads and runs it; `swarm/llama.py` writes it as a Hugging Face LLaMA where that is
the same function.

Pure logic: files on disk in, tensors and dicts out; no networking and no processes.
"""

from __future__ import annotations

import pickle
import re
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from swarm.manifest import Manifest, ManifestError, load_manifest
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


def one_line(exc: BaseException, limit: int = 200) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------------------------- reading


@dataclass
class StageCheckpoint:
    """One stage checkpoint as a peer saved it, with the optional records it may carry."""

    path: Path  # where it came from: a file, or `peer:<peer id>` for a state downloaded from a live peer
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
        raise ExportError(f"checkpoint {path} cannot be read ({one_line(exc)})") from None
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
    return bundle_stages(manifest, select_checkpoints(manifest, paths))


def bundle_stages(manifest: Manifest, selection: Selection) -> Export:
    """Verify and bundle one checkpoint per stage, read from disk or downloaded from live peers."""
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
        raise ExportError(f"cannot write {path}: {one_line(exc)}") from None
