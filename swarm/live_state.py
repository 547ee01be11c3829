"""Taking a stage's state from a live peer, as `protocol-swarm export --from-swarm` does: what is checked.

A state downloaded from a peer is that peer's claim. Peers of a stage hold the same parameters within an
optimizer epoch (they average, then step alike; bit for bit only on the same kind of device, so a swarm mixing
devices confirms no state), and each announces, in its own signed stage record, the hash of its parameters at its
last few epochs (`state_hashes`, "epoch:hash-prefix") and of the last states it served (`served_states`). So a
downloaded state is taken only if its hash is one that two peers of the stage announce (the exporter may accept
one for a stage that never shows two peers, `--accept-single-peer-stages`): one hostile peer cannot hand the
exporter weights that no other peer of its stage holds. A peer whose `loaded_state` is the entry holds it only
because it downloaded it (perhaps from the hostile donor), so it is no witness. The parameters then go through
every check a checkpoint on disk goes through (`swarm/export.py verify_stage`: names, shapes, finite, span(U)).

The hash is the one peers announce: the stage's parameters in `stage.parameters()` order, as float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from swarm.manifest import Manifest
from swarm.model import PipelineStage
from swarm.optim import parameter_groups
from swarm.records import PeerEntry, StagePeerRecord, SubspaceRecord
from swarm.subspace import t_fixed_table, tensor_sha256
from swarm.subspace_update import matrix_from_bytes

STATE_PREFIX = 16  # hex digits of the parameters' hash in an "epoch:hash" record entry


class LiveStateError(ValueError):
    """A state (or a U) a peer sent that does not check out; the message is one line naming the stage."""


def parameters_sha256(stage: PipelineStage, replaced: dict[int, torch.Tensor] | None = None) -> str:
    """The hash of the stage's parameters, or of them with some replaced by copies (keyed by the parameter's id)."""
    replaced = replaced or {}
    flat = torch.cat([replaced.get(id(p), p).detach().float().flatten().cpu() for p in stage.parameters()])
    return tensor_sha256(flat)


def state_entry(epoch: int, digest: str) -> str:
    """A state as records name it: "epoch:hash-prefix"."""
    return f"{epoch}:{digest[:STATE_PREFIX]}"


def copies_entry(stage: PipelineStage, main: Sequence[torch.Tensor], epoch: int, copies: Sequence[torch.Tensor]) -> str:
    """The entry of a state whose trained parameters `main` (the optimizer's order) are replaced by `copies`: what
    a donor notes it served and a joiner computes from what it received, so the two compare."""
    return state_entry(epoch, parameters_sha256(stage, {id(p): c for p, c in zip(main, copies, strict=True)}))


def trained_parameters(stage: PipelineStage) -> list[tuple[str, torch.nn.Parameter]]:
    """The stage's trained parameters in the order its optimizer (and so a donor's state) lists them."""
    names = {id(p): name for name, p in stage.named_parameters()}
    return [(names[id(p)], p) for group in parameter_groups(stage) for p in group["params"]]


def expected_shapes(manifest: Manifest, index: int) -> list[tuple[int, ...]]:
    """The shapes a donor's state must start with, in order (the downloader reads no further)."""
    return [tuple(p.shape) for _, p in trained_parameters(PipelineStage(manifest, index))]


def model_from_state(manifest: Manifest, index: int, tensors: Sequence[torch.Tensor]) -> tuple[dict, str]:
    """(the stage's state_dict with the downloaded parameters in place, their hash as records announce it).

    Tensors the optimizer does not train are the manifest's (a fresh stage's). Shape, dtype and finiteness
    are checked here before anything is hashed; `verify_stage` checks the rest."""
    stage = PipelineStage(manifest, index)
    trained = trained_parameters(stage)
    if len(tensors) != len(trained):
        raise LiveStateError(f"stage {index}: the state has {len(tensors)} parameter tensors, expected {len(trained)}")
    replaced, named = {}, {}
    for (name, param), tensor in zip(trained, tensors, strict=True):
        if tuple(tensor.shape) != tuple(param.shape) or not tensor.is_floating_point():
            raise LiveStateError(
                f"stage {index}: {name} came as {tensor.dtype} {tuple(tensor.shape)}, expected {tuple(param.shape)}"
            )
        if not torch.isfinite(tensor).all():
            raise LiveStateError(f"stage {index}: {name} holds NaN or inf")
        value = tensor.detach().to(param.dtype).cpu().contiguous()
        replaced[id(param)], named[name] = value, value
    digest = parameters_sha256(stage, replaced)
    model = {name: named.get(name, tensor) for name, tensor in stage.state_dict().items()}
    return model, digest


def confirmations(entries: Sequence[PeerEntry], index: int, entry: str, donor: str) -> list[StagePeerRecord]:
    """The records of online peers of stage `index` that announce the state `entry` ("epoch:hash"): as one they
    held (`state_hashes`), or, for the donor, as the one it served (`served_states`, hashed from the copy it sent,
    so found however many epochs it stepped before announcing). A peer that loaded those parameters from another
    is no witness, whatever epoch it loaded them at (hivemind may move a download's epoch on by one); one record
    per peer."""
    found: dict[str, StagePeerRecord] = {}
    digest = entry.partition(":")[2]
    for e in entries:
        record = e.record
        if record.state != "online" or record.stage != index or record.loaded_state.partition(":")[2] == digest:
            continue
        if entry in record.state_hashes or (record.peer_id == donor and entry in record.served_states):
            found[record.peer_id] = record
    return list(found.values())


def witnesses_needed(other_online: int) -> int:
    """Records that must announce a state before a peer takes it from another (`peer/state_load.py`): two of
    the stage's other online peers, or the one there is (a stage whose only peer is hostile is its own anyway)."""
    return min(2, max(other_online, 1))


def agreeing_state(seed: Sequence[torch.Tensor], states: Sequence[Sequence[torch.Tensor]]) -> int | None:
    """Which of several downloaded states to take where no record vouches for any: the medoid (least summed
    distance to the others), if its nearest other state is close enough, on the scale of how far training moved
    the two from `seed` (the run's initial parameters).

    Of three or more states, close enough is the distance the two would be apart had training moved them at right
    angles, hypot(moved, moved'): honest peers descend one loss from one seed, their moves are not opposed, and
    they are never farther apart than that, however unequal their epochs (the replicas of a stage step apart,
    measured: 5, 8 and 12 epochs in one live stage, farther apart than the lesser move; and a peer the drivers sent
    no trip yet is still at the seed, at epoch 0, beside one at epoch 20). With one hostile state
    among three the medoid is honest; the hostile one is the medoid only if it lies nearer both honest states
    than they lie to each other. Of two states, where either may be hostile and a hostile one can inflate its own
    move, close enough is the lesser move: neither is taken unless the two agree that closely.
    None: fewer than two states, or no agreement."""
    if len(states) < 2:
        return None
    origin = torch.cat([t.detach().float().flatten() for t in seed])
    flat = torch.stack([torch.cat([t.detach().float().flatten() for t in state]) for state in states])
    if flat.shape[1] != origin.numel() or not torch.isfinite(flat).all():
        return None
    apart = torch.cdist(flat.double(), flat.double())
    moved = (flat.double() - origin.double()).norm(dim=1)
    pick = int(apart.sum(dim=1).argmin())
    others = apart[pick].clone()
    others[pick] = float("inf")
    near = int(others.argmin())
    pair = moved[[pick, near]]
    bound = pair.min() if len(states) == 2 else pair.norm()
    # a peer still at the seed is exactly the other's move away, which the two norms may round apart
    return pick if apart[pick, near] <= bound * (1 + 1e-9) else None


def online_peers(entries: Sequence[PeerEntry], index: int, t_fixed_sha256: str) -> list[PeerEntry]:
    """The stage's online peers computing with the run's T_fixed (`run_t_fixed_sha256`), the most advanced
    first (the freshest state is asked for first; the epoch is a claim, and each donor's time is bounded)."""
    live = [
        e
        for e in entries
        if e.record.state == "online" and e.record.stage == index and e.record.t_fixed_sha256 == t_fixed_sha256
    ]
    return sorted(live, key=lambda e: (-e.record.optimizer_epoch, e.record.peer_id))


def run_t_fixed_sha256(manifest: Manifest) -> str:
    """The run's T_fixed hash: the manifest's, or derived from its seed where the manifest names none."""
    if manifest.t_fixed_sha256:
        return manifest.t_fixed_sha256
    shape = manifest.model
    return tensor_sha256(t_fixed_table(manifest.seed, shape.vocab_size, shape.d_model, manifest.t_fixed_std))


def current_u(
    manifest: Manifest, witnesses: Sequence[StagePeerRecord], versions: Sequence[SubspaceRecord]
) -> tuple[int, torch.Tensor | None]:
    """(the U version the downloaded states were announced under, its d×k tensor; None for version 0, the seed's).

    The witnesses are the records that confirmed the downloaded states; they must all name one U (a U switch
    during the export, or a peer at another U, is refused: export again). A version above 0 is taken from a
    `{run}_subspace` version record whose bytes hash to the witnesses' U hash."""
    named = {(r.u_version, r.u_sha256) for r in witnesses}
    if len(named) != 1:
        seen = ", ".join(f"v{v} {sha[:12]}" for v, sha in sorted(named))
        raise LiveStateError(f"the peers whose states were taken announce different U ({seen}): export again")
    ((version, digest),) = named
    if version == 0:
        if manifest.u_sha256 and digest != manifest.u_sha256:
            raise LiveStateError("the peers whose states were taken announce a U v0 that is not the run's")
        return 0, None
    for record in versions:
        if record.kind == "version" and record.version == version and record.u_sha256 == digest:
            try:
                matrix = matrix_from_bytes(record.data, manifest.model.d_model, manifest.k)
            except ValueError:
                continue
            u = torch.from_numpy(np.array(matrix, dtype=np.float32))
            if tensor_sha256(u) == digest:
                return version, u
    raise LiveStateError(f"no peer publishes the bytes of U v{version} that the peers whose states were taken announce")
