"""Downloading a run's stages from its live peers, for `protocol-swarm export --from-swarm`.

The exporter joins the run's DHT as a client (it serves nothing and is not announced), reads the stages' signed
records, and asks each stage's online peers, the most advanced first, for their state over the same RPC a joining
peer uses (hivemind's state averager, `rpc_download_state`, namespace `{optimizer_prefix}_stage{i}_state_averager`).
Unlike hivemind's own download it picks the donor, reads only the parameters (the optimizer statistics that follow
are never read), bounds every tensor's bytes by the shape the manifest gives it, and takes a state only when
online peers of the stage announce its hash (`swarm/live_state.py`). A donor whose state does not check out is
skipped for the next one. A peer re-announces its record every ANNOUNCE_INTERVAL, so the records are read again
for a while after a download, until they announce the state or do not; rounds over all donors repeat for up to
`timeout` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import torch
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import combine_from_streaming

from dhtio.records import fetch_stages, fetch_subspace_records
from p2pio.hivemind_guards import limit_hivemind_frames
from swarm.live_state import (
    LiveStateError,
    confirmations,
    current_u,
    expected_shapes,
    model_from_state,
    online_peers,
    required_confirmations,
    state_entry,
)
from swarm.manifest import Manifest
from swarm.records import ANNOUNCE_INTERVAL, PeerEntry, load_or_create_rsa_key, make_validators, subspace_key

logger = logging.getLogger("dhtio.state_download")

# hivemind names an RPC after the class that serves it, and peers serve their state from
# `peer/stage_optimizer.py SnapshotStateAverager` (tests/test_live_export.py checks the name): a stub of a
# class of that name calls it
STATE_SERVICER = type("SnapshotStateAverager", (DecentralizedAverager,), {})
PART_SLACK = 4096  # bytes a tensor's serialized parts may hold beyond its float32 values (headers, padding)
ROUND_PAUSE = 5.0  # seconds between rounds of reading the records and asking donors
CONFIRM_WAIT = 2 * ANNOUNCE_INTERVAL  # how long a downloaded state may wait for the records that announce it
CONFIRM_POLL = 2.0


@dataclass
class DownloadedStage:
    index: int
    epoch: int
    donor: str
    model: dict[str, torch.Tensor]
    confirmed_by: list[str]


@dataclass
class LiveRun:
    """What the live peers gave: one confirmed state per stage, the U they run under, and what to tell the user."""

    stages: dict[int, DownloadedStage]
    u_version: int
    u: torch.Tensor | None
    notes: list[str] = field(default_factory=list)


async def read_parameters(
    p2p: P2P, peer_id: str, namespace: str, shapes: list[tuple[int, ...]], timeout: float
) -> tuple[int, list[torch.Tensor]]:
    """(the donor's epoch, its first len(shapes) tensors) from its state stream; raises LiveStateError."""
    stub = STATE_SERVICER.get_stub(p2p, PeerID.from_base58(peer_id), namespace=namespace)
    epoch, tensors, parts, received = None, [], [], 0
    deadline = time.monotonic() + timeout

    def close_tensor() -> None:
        tensor = deserialize_torch_tensor(combine_from_streaming(parts))
        want = shapes[len(tensors)]
        if tuple(tensor.shape) != want:
            raise LiveStateError(f"tensor {len(tensors)} came as {tuple(tensor.shape)}, expected {want}")
        tensors.append(tensor)
        parts.clear()

    stream = await asyncio.wait_for(stub.rpc_download_state(averaging_pb2.DownloadRequest()), timeout)
    try:
        while len(tensors) < len(shapes):
            left = deadline - time.monotonic()
            if left <= 0:
                raise LiveStateError(f"the state did not arrive within {timeout:.0f}s")
            try:
                message = await asyncio.wait_for(stream.__anext__(), left)
            except StopAsyncIteration:
                break
            if message.metadata and epoch is None:
                metadata = MSGPackSerializer.loads(message.metadata)
                value = metadata.get("epoch") if isinstance(metadata, dict) else None
                if not isinstance(value, int) or value < 0:
                    raise LiveStateError("the state's metadata names no epoch")
                epoch = value
            part = message.tensor_part
            if part.dtype and parts:  # a dtype starts the next tensor
                close_tensor()
                if len(tensors) == len(shapes):
                    break
            if part.dtype:
                received = 0
            received += len(part.buffer)
            want = shapes[len(tensors)]
            if received > 4 * torch.Size(want).numel() + PART_SLACK:
                raise LiveStateError(f"tensor {len(tensors)} is larger than its shape {want} allows")
            parts.append(part)
        if parts and len(tensors) < len(shapes):
            close_tensor()
    finally:
        close = getattr(stream, "aclose", None)
        if close is not None:
            await close()
    if epoch is None or len(tensors) != len(shapes):
        raise LiveStateError(f"the state ended after {len(tensors)} of {len(shapes)} parameter tensors")
    return epoch, tensors


async def _confirm(dht, manifest: Manifest, index: int, entry: str, donor: str, online: int) -> set[str]:
    """The peers of the stage whose records announce `entry`, reading them again until enough do or
    `CONFIRM_WAIT` passed (a peer announces every ANNOUNCE_INTERVAL, so its record may lag the state it sent)."""
    deadline = time.monotonic() + CONFIRM_WAIT
    while True:
        entries = (await asyncio.to_thread(fetch_stages, dht, manifest, [index]))[index]
        witnesses = online_peers(entries, index, manifest.t_fixed_sha256)
        confirmed = confirmations(witnesses, index, entry, donor)
        if len(confirmed) >= required_confirmations(online) or time.monotonic() > deadline:
            return confirmed
        await asyncio.sleep(CONFIRM_POLL)


async def _download_stage(
    dht, p2p: P2P, manifest: Manifest, index: int, entries: list[PeerEntry], timeout: float
) -> tuple[DownloadedStage | None, list[str]]:
    """One round for one stage: each online donor in turn, until one's state is confirmed."""
    namespace = f"{manifest.optimizer_prefix}_stage{index}_state_averager"
    shapes = expected_shapes(manifest, index)
    online = online_peers(entries, index, manifest.t_fixed_sha256)
    needed = required_confirmations(len(online))
    refused = []
    for donor in online:
        record = donor.record
        try:
            epoch, tensors = await read_parameters(p2p, record.peer_id, namespace, shapes, timeout)
            model, digest = model_from_state(manifest, index, tensors)
        except Exception as exc:  # noqa: BLE001 - any failure of one donor: the next is asked
            refused.append(f"stage {index}: peer {record.peer_id[-8:]} ({record.public_name!r}): {exc}")
            continue
        entry = state_entry(epoch, digest)
        confirmed = await _confirm(dht, manifest, index, entry, record.peer_id, len(online))
        if len(confirmed) >= needed:
            return DownloadedStage(index, epoch, record.peer_id, model, sorted(confirmed)), refused
        refused.append(
            f"stage {index}: peer {record.peer_id[-8:]}'s state {entry} is announced by {len(confirmed)} "
            f"of the stage's {len(online)} online peers, {needed} needed"
        )
    return None, refused


async def _download(dht, manifest: Manifest, timeout: float) -> LiveRun:
    p2p = await dht.replicate_p2p()
    deadline = time.monotonic() + timeout
    found: dict[int, DownloadedStage] = {}
    refusals: list[str] = []
    stages: dict[int, list[PeerEntry]] = {}
    while True:
        stages = await asyncio.to_thread(fetch_stages, dht, manifest)
        for index in range(manifest.num_stages):
            if index not in found:
                left = max(deadline - time.monotonic(), 1.0)
                got, refused = await _download_stage(dht, p2p, manifest, index, stages[index], left)
                refusals += refused
                if got is not None:
                    found[index] = got
        if len(found) == manifest.num_stages or time.monotonic() + ROUND_PAUSE > deadline:
            break
        await asyncio.sleep(ROUND_PAUSE)
    missing = [i for i in range(manifest.num_stages) if i not in found]
    if missing:
        last = "; ".join(refusals[-3:]) or "no online peer serves them"
        raise LiveStateError(f"no confirmed state of stage(s) {missing} within {timeout:.0f}s: {last}")
    versions = await asyncio.to_thread(fetch_subspace_records, dht, subspace_key(manifest))
    u_version, u = current_u(manifest, stages, versions)
    notes = [f"skipped: {line}" for line in refusals]
    for stage in found.values():
        if len(stage.confirmed_by) < 2:
            notes.append(
                f"stage {stage.index}: one peer serves it, so its state is checked only against that peer's own record"
            )
    return LiveRun(found, u_version, u, notes)


def download_run(manifest: Manifest, initial_peers: list[str], timeout: float) -> LiveRun:
    """Join the run's DHT as a client, download and confirm every stage, leave; raises LiveStateError."""
    from hivemind.dht import DHT

    limit_hivemind_frames()  # a donor's frames are bounded like every hivemind stream of a peer
    dht = DHT(
        start=True,
        initial_peers=list(initial_peers),
        client_mode=True,
        record_validators=make_validators(manifest, load_or_create_rsa_key(None))[1],
    )
    try:
        return asyncio.run(_download(dht, manifest, timeout))
    finally:
        dht.shutdown()
