"""`protocol-swarm export --from-swarm`: a run's stages downloaded from its live peers (issue 28).

What a donor sends is checked before it is taken: its parameters' shapes, dtype and values, its size while it
streams (a real libp2p stream from a hostile donor), and its hash against the stage's signed peer records (one
other peer must hold the same state when the stage has two); and a live local swarm exports to a model file that
plain PyTorch loads, whose every stage is a state its peers announced."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import AsyncIterator  # noqa: UP035 - hivemind's servicer reads typing's generic names

import pytest
import torch
from builders import stage_record, tiny_manifest
from harness import swarm_of, wait_for
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import P2P, P2PContext, ServicerBase
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer
from test_export import readme_commands

from dhtio.state_download import STATE_SERVICER, read_parameters
from swarm.live_state import (
    LiveStateError,
    confirmations,
    current_u,
    expected_shapes,
    model_from_state,
    online_peers,
    parameters_sha256,
    required_confirmations,
    state_entry,
    trained_parameters,
)
from swarm.model import PipelineStage, build_stages
from swarm.presets import preset
from swarm.records import PeerEntry, SubspaceRecord
from swarm.subspace import tensor_sha256
from swarm.subspace_update import matrix_to_bytes

MANIFEST = tiny_manifest(stages=2)


def entry(stage: int, name: str, **changes) -> PeerEntry:
    return PeerEntry(stage_record(stage, name, MANIFEST, **changes), expiration=0.0, owner=b"")


def trained_state(index: int, scale: float = 0.01) -> list[torch.Tensor]:
    """A stage's trained parameters moved off the seed, as a donor would send them."""
    generator = torch.Generator().manual_seed(index)
    return [
        p.detach().clone() + scale * torch.randn(p.shape, generator=generator)
        for _, p in trained_parameters(PipelineStage(MANIFEST, index))
    ]


# --------------------------------------------------------------------------------------------- pure checks


def test_the_hash_of_a_downloaded_state_is_the_one_its_peer_announces():
    tensors = trained_state(1)
    model, digest = model_from_state(MANIFEST, 1, tensors)
    stage = PipelineStage(MANIFEST, 1)
    stage.load_state_dict(model)
    assert digest == parameters_sha256(stage)  # what a peer holding these parameters hashes and announces
    assert digest != parameters_sha256(PipelineStage(MANIFEST, 1))
    assert set(model) == set(stage.state_dict())


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda t: t[:-1], "parameter tensors"),
        (lambda t: [torch.cat([t[0].flatten(), torch.zeros(1)]), *t[1:]], "expected"),
        (lambda t: [t[0].to(torch.int64), *t[1:]], "expected"),
        (lambda t: [torch.full_like(t[0], float("nan")), *t[1:]], "NaN"),
    ],
)
def test_a_state_of_the_wrong_shape_kind_or_values_is_refused(damage, message):
    with pytest.raises(LiveStateError, match=message):
        model_from_state(MANIFEST, 0, damage(trained_state(0)))


def test_two_peers_of_a_stage_must_announce_the_state_and_one_alone_is_its_own_witness():
    held = state_entry(7, "ab" * 32)
    # alone in its stage: the donor's record of what it served (or held) is the only witness there is
    alone = [entry(1, "a", served_states=[held])]
    assert required_confirmations(len(alone)) == 1 and confirmations(alone, 1, held, "12D3Koo-1-a") == {"12D3Koo-1-a"}
    assert confirmations(alone, 1, held, "12D3Koo-1-other") == set()  # what another peer served proves nothing
    # a hostile donor announcing its own state: the other peer holds another one
    liar = entry(1, "liar", served_states=[held], state_hashes=[held])
    hostile = [liar, entry(1, "b", state_hashes=["7:" + "cd" * 8])]
    assert len(confirmations(hostile, 1, held, "12D3Koo-1-liar")) < required_confirmations(len(hostile)) == 2
    agreeing = [*hostile, entry(1, "c", state_hashes=["6:" + "ef" * 8, held])]
    assert confirmations(agreeing, 1, held, "12D3Koo-1-liar") == {"12D3Koo-1-liar", "12D3Koo-1-c"}
    # peers of other stages and leaving peers are not witnesses; peers at another T_fixed are not asked
    others = [entry(0, "x", state_hashes=[held]), entry(1, "y", state="leaving", state_hashes=[held])]
    assert confirmations(others, 1, held, "12D3Koo-0-x") == set()
    stranger = entry(1, "z", t_fixed_sha256="00" * 32, optimizer_epoch=99)
    donors = online_peers([*agreeing, stranger, entry(1, "d", optimizer_epoch=9)], 1, MANIFEST.t_fixed_sha256)
    assert [d.record.public_name for d in donors][0] == "d" and "z" not in [d.record.public_name for d in donors]


def test_the_u_is_the_one_most_peers_announce_and_its_bytes_must_hash_to_it():
    stages = {0: [entry(0, "a")], 1: [entry(1, "b")]}
    assert current_u(MANIFEST, stages, []) == (0, None)
    u = torch.linalg.qr(torch.randn(MANIFEST.model.d_model, MANIFEST.k))[0].float()
    digest = tensor_sha256(u)
    moved = {0: [entry(0, "a", u_version=2, u_sha256=digest)], 1: [entry(1, "b", u_version=2, u_sha256=digest)]}

    def record(data: bytes, sha: str) -> SubspaceRecord:
        return SubspaceRecord(
            kind="version",
            peer_id="p",
            version=2,
            target_version=2,
            stage=0,
            epoch=0,
            terms=0,
            u_sha256=sha,
            contributors=[],
            data=data,
        )

    forged = record(matrix_to_bytes(u.double().numpy() * 2), digest)  # claims the hash, other bytes
    with pytest.raises(LiveStateError, match="no peer publishes"):
        current_u(MANIFEST, moved, [forged])
    version, got = current_u(MANIFEST, moved, [forged, record(matrix_to_bytes(u.double().numpy()), digest)])
    assert version == 2 and torch.equal(got, u)
    split = {0: moved[0], 1: [entry(1, "b", u_version=2, u_sha256="11" * 32)]}
    with pytest.raises(LiveStateError, match="do not agree"):
        current_u(MANIFEST, split, [])
    with pytest.raises(LiveStateError, match="no online peer"):
        current_u(MANIFEST, {0: [], 1: []}, [])


# --------------------------------------------------------------------------------- a donor over libp2p


class SnapshotStateAverager(ServicerBase):
    """A donor: only the state RPC of a peer's state averager (whose class name the RPC's handle name carries),
    answering with whatever the test gives it."""

    def __init__(self, messages: list[averaging_pb2.DownloadData]):
        self.messages = messages

    async def rpc_download_state(
        self, _request: averaging_pb2.DownloadRequest, _context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        for message in self.messages:
            yield message


def honest_messages(tensors: list[torch.Tensor], epoch: int) -> list[averaging_pb2.DownloadData]:
    metadata = MSGPackSerializer.dumps(dict(epoch=epoch))
    out = []
    for tensor in [*tensors, torch.zeros(3)]:  # the optimizer statistics that follow are never read
        out.append(averaging_pb2.DownloadData(tensor_part=serialize_torch_tensor(tensor), metadata=metadata))
        metadata = None
    return out


async def _ask(messages: list[averaging_pb2.DownloadData], shapes) -> tuple[int, list[torch.Tensor]]:
    server, client = await P2P.create(), None
    try:
        await SnapshotStateAverager(messages).add_p2p_handlers(server, namespace="run_stage0_state_averager")
        client = await P2P.create(initial_peers=await server.get_visible_maddrs())
        return await read_parameters(client, server.peer_id.to_base58(), "run_stage0_state_averager", shapes, 20.0)
    finally:
        for p2p in (client, server):
            if p2p is not None:
                await p2p.shutdown()


def test_the_downloader_calls_the_rpc_peers_serve_their_state_with():
    from peer.stage_optimizer import SnapshotStateAverager as served

    assert STATE_SERVICER.__name__ == served.__name__ == SnapshotStateAverager.__name__
    assert issubclass(served, DecentralizedAverager) and issubclass(STATE_SERVICER, DecentralizedAverager)


def test_parameters_are_read_from_a_donor_and_the_rest_of_its_state_is_not():
    tensors = trained_state(0)
    epoch, got = asyncio.run(_ask(honest_messages(tensors, 5), expected_shapes(MANIFEST, 0)))
    assert epoch == 5 and len(got) == len(tensors) and all(torch.equal(a, b) for a, b in zip(got, tensors, strict=True))


def test_a_donor_streaming_more_than_a_tensor_holds_is_cut_off():
    shapes = expected_shapes(MANIFEST, 0)
    first = torch.zeros(shapes[0])
    part = serialize_torch_tensor(first)
    flood = [averaging_pb2.DownloadData(tensor_part=part, metadata=MSGPackSerializer.dumps(dict(epoch=1)))]
    # parts without a dtype continue the same tensor: a donor that never ends it
    chunk = runtime_pb2.Tensor(buffer=b"\0" * 65536)
    flood += [averaging_pb2.DownloadData(tensor_part=chunk) for _ in range(64)]
    with pytest.raises(LiveStateError, match="larger than its shape"):
        asyncio.run(_ask(flood, shapes))


def test_a_donor_with_the_wrong_shapes_or_no_epoch_is_refused():
    shapes = expected_shapes(MANIFEST, 0)
    wrong = [torch.zeros(3, 3)] + trained_state(0)[1:]
    with pytest.raises(LiveStateError, match="expected"):
        asyncio.run(_ask(honest_messages(wrong, 1), shapes))
    no_epoch = honest_messages(trained_state(0), 1)
    no_epoch[0].metadata = MSGPackSerializer.dumps(dict(epoch="seven"))
    with pytest.raises(LiveStateError, match="no epoch"):
        asyncio.run(_ask(no_epoch, shapes))
    with pytest.raises(LiveStateError, match="ended after"):
        asyncio.run(_ask(honest_messages(trained_state(0), 1)[:2], shapes))


# --------------------------------------------------------------------------------------- a live swarm


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_live_swarm_exports_without_checkpoints(tmp_path: Path):
    """Export while the swarm trains: every stage comes from a peer, at an epoch past the seed, with a hash its
    peer announced; the file loads in plain PyTorch and generates."""
    manifest = preset("tiny", stages=2)
    with swarm_of(manifest, peers_per_stage=1, name="live-export") as swarm:
        wait_for(
            lambda: all(e and e[0].record.optimizer_epoch >= 2 for e in swarm.poll().values()),
            400,
            "both stages past epoch 2",
            interval=3.0,
        )
        out = tmp_path / "live.pt"
        # README "From the live swarm", its command as written, with this swarm's address, manifest and file
        (readme,) = [argv for argv in readme_commands() if "--from-swarm" in argv]
        place = {"manifest.json": str(swarm.manifest_path), "model.pt": str(out)}
        argv = [place.get(a, a) for a in readme[1:] if not a.startswith("/dns4/")]
        at = argv.index("--from-swarm") + 1
        argv[at:at] = swarm.bootstrap
        exported = subprocess.run(
            [sys.executable, "-m", "launcher.cli", *argv, "--json", "--timeout", "120"],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert exported.returncode == 0, exported.stderr[-3000:]
        summary = json.loads(exported.stdout.strip().splitlines()[-1])
        records = {i: entries[0].record for i, entries in swarm.poll().items()}
    assert [s["stage"] for s in summary["stages"]] == [0, 1]
    assert all(s["source"] == f"peer:{records[s['stage']].peer_id}" and s["epoch"] >= 2 for s in summary["stages"])
    assert any("one peer serves it" in note for note in summary["notes"])

    bundle = torch.load(out, weights_only=True)
    stages = build_stages(manifest)
    for stage in stages:
        prefix = f"stages.{stage.index}."
        stage.load_state_dict({k[len(prefix) :]: v for k, v in bundle["state_dict"].items() if k.startswith(prefix)})
        epoch = summary["stages"][stage.index]["epoch"]
        # the peer announced these very parameters (its record keeps the last 16 epochs')
        assert state_entry(epoch, parameters_sha256(stage)) in records[stage.index].state_hashes
    seed = build_stages(manifest)
    assert all(parameters_sha256(a) != parameters_sha256(b) for a, b in zip(stages, seed, strict=True))
    generated = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher.cli",
            "generate",
            "--model",
            str(out),
            "--prompt",
            "def ",
            "--max-new-tokens",
            "4",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert generated.returncode == 0, generated.stderr[-2000:]
    assert len(json.loads(generated.stdout.strip().splitlines()[-1])["tokens"]) == 4


def test_checkpoints_and_from_swarm_are_one_or_the_other(tmp_path, capsys):
    from launcher.cli import main

    assert main(["export", str(tmp_path), "--from-swarm", "/ip4/127.0.0.1/tcp/1"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["export"]) == 2 and "not both" in capsys.readouterr().err
