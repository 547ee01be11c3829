"""A raw hivemind client sends malformed trips to a real peer: each gets its error code, and the peer
keeps serving correct trips afterwards."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import runpy
import struct
import time
import uuid
from pathlib import Path

import pytest
import torch
from builders import dht_with_record
from harness import online, swarm_of, wait_for
from hivemind.p2p import PeerID

from peer.transport import send_trip
from swarm.codec import BoundaryCodec
from swarm.model import SubspaceState
from swarm.presets import preset
from swarm.wire import MAGIC, ErrorCode, Header, WireError, decode, encode, expectation_for, raise_if_error

pytestmark = pytest.mark.slow


def manifest_with_wide_vocab():
    """Vocabulary 300 (> 256) so token ids travel as 16 bits and an id >= V can be sent at all."""
    base = preset("tiny", stages=2)
    return preset("tiny", stages=2, model=base.model.model_copy(update={"vocab_size": 300}))


def test_malformed_trips_get_error_codes_and_the_peer_keeps_serving():
    manifest = manifest_with_wide_vocab()
    codec = BoundaryCodec(manifest, SubspaceState(manifest))
    batch, seq, k = manifest.batch.microbatch_size, manifest.batch.seq_len, manifest.k
    tokens = torch.randint(0, 256, (batch, seq))
    hidden = torch.randn(batch, seq, manifest.model.d_model) * 0.02

    def header(**changes) -> Header:
        fields = dict(
            run_id=manifest.run_id,
            u_version=0,
            t_fixed_sha256=manifest.t_fixed_sha256,
            trip_id=uuid.uuid4().hex,
            stage=1,
            kind="forward",
            dtype="bf16",
            shape=(batch, seq, k),
            has_tokens=True,
        )
        fields.update(changes)
        return Header(**fields)

    coefficients = torch.randn(batch, seq, k)
    vocab = manifest.model.vocab_size
    nan = coefficients.clone()
    nan[0, 0, 0] = float("nan")
    valid = codec.encode_forward(hidden, tokens, uuid.uuid4().hex, to_stage=1)
    limit = expectation_for(manifest, 1, "forward", 0, manifest.t_fixed_sha256).max_bytes
    cases = {
        "wrong shape": (
            encode(
                header(shape=(batch, seq + 1, k)),
                torch.randn(batch, seq + 1, k),
                torch.zeros(batch, seq + 1, dtype=torch.long),
                vocab,
            ),
            ErrorCode.MALFORMED,
        ),
        "batch too large": (
            encode(
                header(shape=(batch + 1, seq, k)),
                torch.randn(batch + 1, seq, k),
                torch.zeros(batch + 1, seq, dtype=torch.long),
                vocab,
            ),
            ErrorCode.WRONG_SHAPE,
        ),
        "wrong k": (
            encode(header(shape=(batch, seq, k + 1)), torch.randn(batch, seq, k + 1), tokens, vocab),
            ErrorCode.WRONG_SHAPE,
        ),
        "wrong dtype": (encode(header(dtype="fp32"), coefficients, tokens, vocab), ErrorCode.WRONG_DTYPE),
        "NaN": (encode(header(), nan, tokens, vocab), ErrorCode.NOT_FINITE),
        # encode refuses such ids, so the last 16-bit id is overwritten in the bytes
        "token id >= V": (
            encode(header(), coefficients, tokens, vocab)[:-2] + struct.pack("<H", vocab + 5),
            ErrorCode.BAD_TOKENS,
        ),
        "oversized": (valid + b"\0" * (limit + 1), ErrorCode.TOO_LARGE),
        "wrong run id": (encode(header(run_id="someone-else"), coefficients, tokens, vocab), ErrorCode.WRONG_RUN),
        "wrong U version": (encode(header(u_version=7), coefficients, tokens, vocab), ErrorCode.WRONG_VERSION),
        "wrong T_fixed": (encode(header(t_fixed_sha256="0" * 64), coefficients, tokens, vocab), ErrorCode.WRONG_HASH),
        "wrong stage": (encode(header(stage=0), coefficients, tokens, vocab), ErrorCode.WRONG_STAGE),
        "garbage": (b"hello, peer", ErrorCode.MALFORMED),
        "lying header length": (MAGIC + struct.pack("<I", 10**6) + b"{}", ErrorCode.MALFORMED),
        "header not JSON": (MAGIC + struct.pack("<I", 3) + b"{{{" + b"\0" * 64, ErrorCode.MALFORMED),
        "header fields wrong": (MAGIC + struct.pack("<I", 2) + json.dumps({}).encode(), ErrorCode.MALFORMED),
    }
    # "wrong shape" above: seq+1 tokens fit the bounds but the byte count has to match exactly
    cases["wrong shape"] = (cases["wrong shape"][0][:-5], ErrorCode.MALFORMED)

    with swarm_of(manifest, name="malformed") as swarm:
        heartbeat = swarm.workdir / "heartbeat.json"
        swarm.spawn_peer("tail", "1", ["--heartbeat-file", str(heartbeat)])
        peer_id = wait_for(lambda: online(swarm, ["tail"]), 120, "the tail peer online")["tail"].record.peer_id
        # only a peer of stage 0 (a driver) may send stage 1 trips: this client announces itself as one
        driver = dht_with_record(swarm.bootstrap, manifest, 0, swarm.workdir, "driver")

        async def exchange(blob: bytes) -> bytes:
            p2p = await driver.replicate_p2p()
            return await send_trip(p2p, PeerID.from_base58(peer_id), manifest.run_id, blob, timeout=60, max_reply=limit)

        def code_of(blob: bytes) -> ErrorCode | None:
            reply = asyncio.run(exchange(blob))
            try:
                raise_if_error(reply)
            except WireError as exc:
                return exc.code
            return None

        # a sender the tail has not seen yet is refused at once while it re-reads the DHT in the background
        wait_for(lambda: code_of(valid) is None, 30, "the tail to admit the new driver", interval=0.5)
        for name, (blob, expected) in cases.items():
            assert code_of(blob) == expected, name

        reply = asyncio.run(exchange(valid))
        raise_if_error(reply)
        backward = dataclasses.replace(expectation_for(manifest, 0, "backward", 0, manifest.t_fixed_sha256))
        reply_header, grad, _ = decode(reply, backward)
        assert grad.shape == (batch, seq, k)
        assert reply_header.loss is not None and 4.0 < reply_header.loss < 7.0

        def counted():
            entry = online(swarm, ["tail"])
            return entry and entry["tail"].record.errors >= len(cases) and entry["tail"].record.trips >= 1

        wait_for(counted, 30, "the peer's record to count the refusals and the good trip")
        assert swarm.children[0].process.poll() is None
        # the container health check reads the heartbeat the live peer keeps rewriting
        health = runpy.run_path(str(Path(__file__).resolve().parents[1] / "docker" / "healthcheck.py"))
        assert "state online, stage 1" in health["check_heartbeat"](str(heartbeat))
        with pytest.raises(ValueError, match="old"):
            health["check_heartbeat"](str(heartbeat), now=time.time() + 600)
        driver.shutdown()
