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
import time
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
from hivemind.utils.streaming import split_for_streaming
from test_export import readme_commands

from dhtio.state_download import STATE_SERVICER, donor_budget, read_parameters
from p2pio.framing import MIN_RATE
from p2pio.state_stream import StateStream
from swarm.live_state import (
    LiveStateError,
    confirmations,
    current_u,
    expected_shapes,
    model_from_state,
    online_peers,
    parameters_sha256,
    run_t_fixed_sha256,
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


def test_a_state_needs_witnesses_that_hold_it_not_ones_that_loaded_it():
    held = state_entry(7, "ab" * 32)
    names = lambda records: sorted(r.public_name for r in records)  # noqa: E731
    # the donor's record of what it served (or held) is a witness, another peer's record of what it served is not
    alone = [entry(1, "a", served_states=[held])]
    assert names(confirmations(alone, 1, held, "12D3Koo-1-a")) == ["a"]
    assert confirmations(alone, 1, held, "12D3Koo-1-other") == []
    # a hostile donor announcing its own state: the other peer holds another one
    liar = entry(1, "liar", served_states=[held], state_hashes=[held])
    hostile = [liar, entry(1, "b", state_hashes=["7:" + "cd" * 8])]
    assert names(confirmations(hostile, 1, held, "12D3Koo-1-liar")) == ["liar"]
    # laundering: an honest joiner that downloaded the liar's state announces it, but as what it loaded
    joiner = entry(1, "joiner", state_hashes=[held], loaded_state=held)
    assert names(confirmations([*hostile, joiner], 1, held, "12D3Koo-1-liar")) == ["liar"]
    agreeing = [*hostile, entry(1, "c", state_hashes=["6:" + "ef" * 8, held])]
    assert names(confirmations(agreeing, 1, held, "12D3Koo-1-liar")) == ["c", "liar"]
    # peers of other stages and leaving peers are not witnesses; peers at another T_fixed are not asked
    others = [entry(0, "x", state_hashes=[held]), entry(1, "y", state="leaving", state_hashes=[held])]
    assert confirmations(others, 1, held, "12D3Koo-0-x") == []
    stranger = entry(1, "z", t_fixed_sha256="00" * 32, optimizer_epoch=99)
    donors = online_peers([*agreeing, stranger, entry(1, "d", optimizer_epoch=9)], 1, run_t_fixed_sha256(MANIFEST))
    assert [d.record.public_name for d in donors][0] == "d" and "z" not in [d.record.public_name for d in donors]


def test_the_u_is_the_one_every_witness_announces_and_its_bytes_must_hash_to_it():
    seed = [stage_record(0, "a", MANIFEST), stage_record(1, "b", MANIFEST)]
    assert current_u(MANIFEST, seed, []) == (0, None)
    with pytest.raises(LiveStateError, match="not the run's"):
        current_u(MANIFEST, [stage_record(0, "a", MANIFEST, u_sha256="22" * 32)], [])
    u = torch.linalg.qr(torch.randn(MANIFEST.model.d_model, MANIFEST.k))[0].float()
    digest = tensor_sha256(u)
    moved = [stage_record(0, "a", MANIFEST, u_version=2, u_sha256=digest), stage_record(1, "b", MANIFEST, u_version=2,
                                                                                         u_sha256=digest)]

    def record(data: bytes, sha: str) -> SubspaceRecord:
        return SubspaceRecord(kind="version", peer_id="p", version=2, target_version=2, stage=0, epoch=0, terms=0,
                              u_sha256=sha, contributors=[], data=data)

    forged = record(matrix_to_bytes(u.double().numpy() * 2), digest)  # claims the hash, other bytes
    with pytest.raises(LiveStateError, match="no peer publishes"):
        current_u(MANIFEST, moved, [forged])
    version, got = current_u(MANIFEST, moved, [forged, record(matrix_to_bytes(u.double().numpy()), digest)])
    assert version == 2 and torch.equal(got, u)
    # a witness at another U (a hostile one, or a switch during the export): refused, not outvoted
    with pytest.raises(LiveStateError, match="different U"):
        current_u(MANIFEST, [*moved, stage_record(1, "c", MANIFEST, u_version=9, u_sha256="11" * 32)], [])


# ---------------------------------------------------------------------------------------- a donor's stream


def honest_messages(tensors: list[torch.Tensor], epoch: int, chunk: int = 1 << 16) -> list[averaging_pb2.DownloadData]:
    """What hivemind's rpc_download_state sends: each tensor serialized uncompressed and split into parts, the
    metadata on the first message; the optimizer statistics follow the parameters."""
    metadata = MSGPackSerializer.dumps(dict(epoch=epoch, group_bits=""))
    out = []
    for tensor in [*tensors, torch.zeros(3)]:
        for part in split_for_streaming(serialize_torch_tensor(tensor), chunk):
            out.append(averaging_pb2.DownloadData(tensor_part=part, metadata=metadata))
            metadata = None
    return out


def read_all(messages: list[averaging_pb2.DownloadData], shapes) -> tuple[int, list[torch.Tensor]]:
    reader = StateStream(shapes)
    for message in messages:
        reader.feed(message)
        if reader.done:
            break
    return reader.end()


def test_a_stream_is_read_as_hivemind_sends_it_and_no_further():
    tensors, shapes = trained_state(0), expected_shapes(MANIFEST, 0)
    messages = honest_messages(tensors, 5, chunk=1000)  # several parts per tensor
    epoch, got = read_all(messages, shapes)
    assert epoch == 5 and all(torch.equal(a, b) for a, b in zip(got, tensors, strict=True))
    # garbage after the parameters is never read
    statistics_begin = honest_messages(tensors, 5)[: len(tensors) + 1]  # one part per tiny tensor
    read_all([*statistics_begin, averaging_pb2.DownloadData(metadata=b"\xff" * 10)], shapes)


def _first(shape, **fields) -> averaging_pb2.DownloadData:
    part = serialize_torch_tensor(torch.zeros(shape))
    for name, value in fields.items():
        if name == "size":
            del part.size[:]
            part.size.extend(value)
        else:
            setattr(part, name, value)
    return averaging_pb2.DownloadData(tensor_part=part, metadata=MSGPackSerializer.dumps(dict(epoch=1)))


@pytest.mark.parametrize(
    "fields, why",
    [
        (dict(dtype="float16"), "expected float32"),  # hivemind would cast it to any dtype the donor names
        (dict(dtype="U100000000"), "expected float32"),
        (dict(compression=runtime_pb2.CompressionType.UNIFORM_8BIT), "expected float32"),
        (dict(compression=runtime_pb2.CompressionType.MEANSTD_16BIT), "expected float32"),
        (dict(compression=99), "expected float32"),
        (dict(size=[1 << 30, 1 << 30]), "expected float32"),
    ],
)
def test_a_tensor_other_than_plain_float32_of_its_shape_is_refused_before_it_is_decoded(fields, why):
    shapes = expected_shapes(MANIFEST, 0)
    with pytest.raises(LiveStateError, match=why):
        StateStream(shapes).feed(_first(shapes[0], **fields))


def test_bytes_are_counted_whatever_field_carries_them():
    shapes = expected_shapes(MANIFEST, 0)
    reader = StateStream(shapes)
    reader.feed(_first(shapes[0]))
    empty_part = runtime_pb2.Tensor(buffer=b"")
    with pytest.raises(LiveStateError, match="metadata twice"):  # metadata again, on an empty part
        reader.feed(averaging_pb2.DownloadData(tensor_part=empty_part, metadata=b"\x80"))
    reader = StateStream(shapes)
    reader.feed(_first(shapes[0]))
    with pytest.raises(LiveStateError, match="larger than its shape"):
        reader.feed(averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(buffer=b"\0" * 65536)))
    # a repeated size field on empty parts holds bytes, not values: counted all the same
    reader = StateStream(shapes)
    reader.feed(_first(shapes[0]))
    padded = runtime_pb2.Tensor(buffer=b"", size=[7] * 20000)
    with pytest.raises(LiveStateError, match="more than its tensors"):
        for _ in range(len(shapes) + 100):
            reader.feed(averaging_pb2.DownloadData(tensor_part=padded))
    with pytest.raises(LiveStateError, match="before naming"):
        StateStream(shapes).feed(averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(buffer=b"\0")))


def test_a_short_tensor_or_a_missing_epoch_is_refused():
    shapes = expected_shapes(MANIFEST, 0)
    cut = _first(shapes[0])
    cut.tensor_part.buffer = cut.tensor_part.buffer[: len(cut.tensor_part.buffer) // 2]
    with pytest.raises(LiveStateError, match="ended after"):
        read_all([cut], shapes)
    with pytest.raises(LiveStateError, match="ended after 1 of"):
        read_all(honest_messages(trained_state(0), 1)[:1], shapes)
    no_epoch = honest_messages(trained_state(0), 1)
    no_epoch[0].metadata = MSGPackSerializer.dumps(dict(epoch=True))
    with pytest.raises(LiveStateError, match="no epoch"):
        read_all(no_epoch, shapes)


# --------------------------------------------------------------------------------- a donor over libp2p


class SnapshotStateAverager(ServicerBase):
    """A donor: only the state RPC of a peer's state averager (whose class name the RPC's handle name carries),
    answering with whatever the test gives it, `pause` seconds between messages."""

    def __init__(self, messages: list[averaging_pb2.DownloadData], pause: float = 0.0):
        self.messages, self.pause = messages, pause

    async def rpc_download_state(
        self, _request: averaging_pb2.DownloadRequest, _context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        for message in self.messages:
            await asyncio.sleep(self.pause)
            yield message


async def _ask(donor: SnapshotStateAverager, shapes, timeout: float = 20.0) -> tuple[int, list[torch.Tensor]]:
    server, client = await P2P.create(), None
    try:
        await donor.add_p2p_handlers(server, namespace="run_stage0_state_averager")
        client = await P2P.create(initial_peers=await server.get_visible_maddrs())
        return await read_parameters(client, server.peer_id.to_base58(), "run_stage0_state_averager", shapes, timeout)
    finally:
        for p2p in (client, server):
            if p2p is not None:
                await p2p.shutdown()


def test_the_downloader_calls_the_rpc_peers_serve_their_state_with():
    from peer.stage_averagers import SnapshotStateAverager as served

    assert STATE_SERVICER.__name__ == served.__name__ == SnapshotStateAverager.__name__
    assert issubclass(served, DecentralizedAverager) and issubclass(STATE_SERVICER, DecentralizedAverager)


def test_parameters_are_read_from_a_donor_over_libp2p_within_its_budget():
    tensors, shapes = trained_state(0), expected_shapes(MANIFEST, 0)
    epoch, got = asyncio.run(_ask(SnapshotStateAverager(honest_messages(tensors, 5)), shapes))
    assert epoch == 5 and all(torch.equal(a, b) for a, b in zip(got, tensors, strict=True))
    # a donor that drips its state costs its budget, then the next donor is asked
    slow = SnapshotStateAverager(honest_messages(tensors, 5, chunk=100), pause=0.5)
    started = time.monotonic()
    with pytest.raises(LiveStateError, match="did not arrive within 2s"):
        asyncio.run(_ask(slow, shapes, timeout=2.0))
    assert time.monotonic() - started < 10
    # a donor's budget: the grace of a trip stream, then its bytes at the minimum rate a trip stream must keep
    assert donor_budget([]) > 0
    assert donor_budget([(1024, 1024)]) - donor_budget([]) == pytest.approx(4 * 2**20 / MIN_RATE)


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
        argv = [place.get(a, a) for a in readme[1:]]
        argv[argv.index("--from-swarm") + 1] = swarm.bootstrap[0]
        argv.append("--accept-single-peer-stages")  # one peer per stage here
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
        # the peer announced these very parameters: as a state it held, or one it served (its record keeps the
        # last 16 and 4; its epochs go on while the export runs)
        record = records[stage.index]
        assert state_entry(epoch, parameters_sha256(stage)) in [*record.state_hashes, *record.served_states]
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
