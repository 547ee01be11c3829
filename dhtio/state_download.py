"""Downloading a run's stages from its live peers, for `protocol-swarm export --from-swarm`.

The exporter joins the run's DHT as a client (it serves nothing and is not announced), reads the stages' signed
records, and asks each stage's online peers, the most advanced first, for their state over the same RPC a joining
peer uses (hivemind's state averager, `rpc_download_state`, namespace `{Manifest.optimizer_run_id(i)}_state_averager`).
Unlike hivemind's own download it picks the donor and reads the stream itself (`p2pio/state_stream.py`): only
the parameters (the optimizer statistics after them are never read), each a plain float32 tensor of exactly the
shape the manifest gives it; each donor gets a time budget of its own (`donor_budget`), so one that stalls or
drips costs that much, not the export. A state is taken only when
enough of the stage's peers announce its hash (`swarm/live_state.py`); a peer re-announces its record every
ANNOUNCE_INTERVAL, so the records are read again for a while after a download. Rounds over all donors repeat until
every stage has a state or `timeout` seconds passed.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import torch
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.dht import DHT
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2

from dhtio.identity import load_or_create_rsa_key
from dhtio.records import fetch_stages, fetch_subspace_records
from dhtio.validators import make_validators
from p2pio.hivemind_guards import limit_hivemind_frames
from p2pio.state_stream import StateStream, read_state
from swarm.export import one_line
from swarm.live_state import (
    LiveStateError,
    confirmations,
    current_u,
    expected_shapes,
    model_from_state,
    online_peers,
    run_t_fixed_sha256,
    state_entry,
)
from swarm.manifest import Manifest
from swarm.records import ANNOUNCE_INTERVAL, StagePeerRecord, subspace_key

# hivemind names an RPC after the class that serves it, and peers serve their state from
# `peer/stage_averagers.py SnapshotStateAverager` (tests/test_live_export.py checks the name): a stub of a
# class of that name calls it
STATE_SERVICER = type("SnapshotStateAverager", (DecentralizedAverager,), {})
CONFIRM_WAIT = 2 * ANNOUNCE_INTERVAL  # how long a downloaded state may wait for the records that announce it
CONFIRM_POLL = 2.0
ROUND_PAUSE = 5.0  # seconds between rounds over a stage's donors


def donor_budget(shapes: list[tuple[int, ...]]) -> float:
    """Seconds a donor gets to send the parameters (`StateStream.budget`)."""
    return StateStream(shapes).budget


async def read_parameters(
    p2p: P2P, peer_id: str, namespace: str, shapes: list[tuple[int, ...]], timeout: float
) -> tuple[int, list[torch.Tensor]]:
    """(the donor's epoch, its parameters, the float32 tensors at the head of its state) within `timeout`
    seconds; every failure, the donor's or the network's, is a LiveStateError."""
    stub = STATE_SERVICER.get_stub(p2p, PeerID.from_base58(peer_id), namespace=namespace)
    return await read_state(lambda: stub.rpc_download_state(averaging_pb2.DownloadRequest()), StateStream(shapes),
                            timeout)


@dataclass
class DownloadedStage:
    index: int
    epoch: int
    donor: str
    model: dict[str, torch.Tensor]
    witnesses: list[StagePeerRecord]  # the records that announced the state, the donor's among them


@dataclass
class LiveRun:
    """What the live peers gave: one confirmed state per stage, the U they run under, and what to tell the user."""

    stages: dict[int, DownloadedStage]
    u_version: int
    u: torch.Tensor | None
    notes: list[str] = field(default_factory=list)


@dataclass
class _Export:
    dht: DHT
    p2p: P2P
    manifest: Manifest
    t_fixed_sha256: str
    deadline: float
    single_peer_ok: bool
    shapes: dict[int, list[tuple[int, ...]]]
    most_online: dict[int, int] = field(default_factory=dict)  # the most online peers seen per stage, over reads
    refusals: list[str] = field(default_factory=list)

    def needed(self, index: int) -> int:
        """Witnesses a state needs: two, or with `single_peer_ok` one where the stage never showed two peers."""
        return min(2, max(self.most_online.get(index, 0), 1)) if self.single_peer_ok else 2

    async def witnesses(self, index: int, entry: str, donor: str) -> list[StagePeerRecord]:
        """The records announcing `entry`, read again until enough do, CONFIRM_WAIT passed or the export's
        deadline came."""
        until = min(self.deadline, time.monotonic() + CONFIRM_WAIT)
        while True:
            entries = (await asyncio.to_thread(fetch_stages, self.dht, self.manifest, [index]))[index]
            online = online_peers(entries, index, self.t_fixed_sha256)
            self.most_online[index] = max(self.most_online.get(index, 0), len(online))
            found = confirmations(online, index, entry, donor)
            if len(found) >= self.needed(index) or time.monotonic() + CONFIRM_POLL > until:
                return found
            await asyncio.sleep(CONFIRM_POLL)

    async def stage(self, index: int, online: list) -> DownloadedStage | None:
        """One round for one stage: each online donor in turn, until one's state is confirmed."""
        namespace = f"{self.manifest.optimizer_run_id(index)}_state_averager"
        shapes = self.shapes[index]
        for donor in online:
            record, left = donor.record, self.deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                epoch, tensors = await read_parameters(
                    self.p2p, record.peer_id, namespace, shapes, min(left, donor_budget(shapes))
                )
                model, digest = model_from_state(self.manifest, index, tensors)
            except LiveStateError as exc:
                self.refusals.append(f"stage {index}: peer {record.peer_id[-8:]} ({record.public_name!r}): {exc}")
                continue
            entry = state_entry(epoch, digest)
            found = await self.witnesses(index, entry, record.peer_id)
            if len(found) >= self.needed(index):
                return DownloadedStage(index, epoch, record.peer_id, model, found)
            self.refusals.append(
                f"stage {index}: peer {record.peer_id[-8:]}'s state {entry} is announced by {len(found)} of the "
                f"stage's peers, {self.needed(index)} needed"
            )
        return None


async def _download(dht: DHT, manifest: Manifest, timeout: float, single_peer_ok: bool) -> LiveRun:
    run = _Export(
        dht=dht,
        p2p=await dht.replicate_p2p(),
        manifest=manifest,
        t_fixed_sha256=run_t_fixed_sha256(manifest),
        deadline=time.monotonic() + timeout,
        single_peer_ok=single_peer_ok,
        shapes={i: expected_shapes(manifest, i) for i in range(manifest.num_stages)},
    )
    found: dict[int, DownloadedStage] = {}
    while True:
        stages = await asyncio.to_thread(fetch_stages, dht, manifest)
        for index in range(manifest.num_stages):
            if index not in found:
                online = online_peers(stages[index], index, run.t_fixed_sha256)
                run.most_online[index] = max(run.most_online.get(index, 0), len(online))
                got = await run.stage(index, online)
                if got is not None:
                    found[index] = got
        if len(found) == manifest.num_stages or time.monotonic() + ROUND_PAUSE > run.deadline:
            break
        await asyncio.sleep(ROUND_PAUSE)
    missing = [i for i in range(manifest.num_stages) if i not in found]
    if missing:
        last = "; ".join(run.refusals[-3:]) or "no online peer serves them"
        single = "" if single_peer_ok else " (a stage with one peer needs --accept-single-peer-stages)"
        raise LiveStateError(f"no confirmed state of stage(s) {missing} within {timeout:.0f}s{single}: {last}")
    versions = await asyncio.to_thread(fetch_subspace_records, dht, subspace_key(manifest))
    u_version, u = current_u(manifest, [r for stage in found.values() for r in stage.witnesses], versions)
    notes = [f"skipped: {line}" for line in run.refusals]
    for stage in found.values():
        if len(stage.witnesses) < 2:
            notes.append(f"stage {stage.index}: one peer serves it, so its state is checked only against that "
                         "peer's own record")
    return LiveRun(found, u_version, u, notes)


def download_run(manifest: Manifest, initial_peers: list[str], timeout: float, single_peer_ok: bool) -> LiveRun:
    """Join the run's DHT as a client, download and confirm every stage, leave; raises LiveStateError."""
    limit_hivemind_frames()  # a donor's frames are bounded like every hivemind stream of a peer
    try:
        dht = DHT(
            start=True,
            initial_peers=list(initial_peers),
            client_mode=True,
            record_validators=make_validators(manifest, load_or_create_rsa_key(None))[1],
        )
    except Exception as exc:  # noqa: BLE001 - a bad address or no peer answering: one line
        raise LiveStateError(f"cannot join the run's DHT through {', '.join(initial_peers)}: {one_line(exc)}") from None
    try:
        return asyncio.run(_download(dht, manifest, timeout, single_peer_ok))
    finally:
        dht.shutdown()
