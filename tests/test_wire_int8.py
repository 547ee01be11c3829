"""8-bit values on the wire: wire_dtype "int8", per-token absmax scaling, byte counts, and refusals of
bad scales. With compression "none" it is SWARM's dense baseline; with a compressed mode the k
coefficients cross in int8 both ways (forward c, backward g U), and the model is what the receiver
rebuilds from the dequantised coefficients (tests/test_wire_int8_coefficients.py)."""

from __future__ import annotations

import struct

import pytest
import torch
from builders import tiny_manifest

from swarm.codec import BoundaryCodec
from swarm.model import PipelineStage
from swarm.presets import preset
from swarm.wire import MAGIC, ErrorCode, Header, WireError, decode, encode, expectation_for
from swarm.wire_dtype import quantize_int8

D, B, S = 64, 2, 8


def manifest(wire_dtype: str = "int8", compression: str = "none"):
    return tiny_manifest(compression, wire_dtype=wire_dtype, microbatch=4)


@pytest.fixture(scope="module")
def m():
    return manifest()


def header(m, kind="forward", shape=(B, S, D)) -> Header:
    return Header(
        run_id=m.run_id,
        u_version=0,
        t_fixed_sha256=m.t_fixed_sha256,
        trip_id="t",
        stage=1,
        kind=kind,
        dtype="int8",
        shape=shape,
        has_tokens=kind == "forward",
        loss=None if kind == "forward" else 1.5,
    )


def expect(m, kind="forward"):
    return expectation_for(m, 1, kind, 0, m.t_fixed_sha256)


def payload(seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((B, S, D), generator=g) * torch.rand((B, S, 1), generator=g) * 10


def toks() -> torch.Tensor:
    return torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(1))


def body_start(blob: bytes) -> int:
    return len(MAGIC) + 4 + struct.unpack_from("<I", blob, len(MAGIC))[0]


def test_dense_bytes_per_token(m):
    assert m.dense_bytes_per_token() == D + 4  # d int8 values + one float32 scale
    assert m.compressed_bytes_per_token() == D + 4


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_round_trip_and_byte_count(m, kind):
    x = payload()
    tokens = toks() if kind == "forward" else None
    blob = encode(header(m, kind), x, tokens, 256)
    assert len(blob) - body_start(blob) == B * S * (D + 4) + (B * S if tokens is not None else 0)
    _, got, got_tokens = decode(blob, expect(m, kind))
    assert got.dtype == torch.float32 and got.shape == x.shape
    absmax = x.abs().amax(-1, keepdim=True)
    assert ((got - x).abs() <= absmax / 127 / 2 + 1e-6).all()  # half a quantisation step per token
    if tokens is not None:
        assert torch.equal(got_tokens, tokens)


def test_quantize_zero_token_and_extremes():
    x = torch.zeros(1, 3, 5)
    x[0, 1] = torch.tensor([1.0, -2.0, 0.5, 0.0, 2.0])
    values, scales = quantize_int8(x)
    assert values.dtype == torch.int8 and (scales > 0).all()
    assert values[0, 0].abs().sum() == 0 and values[0, 1].abs().max() == 127
    assert torch.allclose(values.float() * scales.unsqueeze(-1), x, atol=2.0 / 127)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_scale_refused(m, bad):
    blob = bytearray(encode(header(m), payload(), toks(), 256))
    scale_at = body_start(blob) + B * S * D + 4 * 3  # the fourth token's scale
    struct.pack_into("<f", blob, scale_at, bad)
    with pytest.raises(WireError) as info:
        decode(bytes(blob), expect(m))
    assert info.value.code == ErrorCode.NOT_FINITE


def test_non_finite_activation_refused(m):
    x = payload()
    x[1, 2, 3] = float("nan")
    with pytest.raises(WireError) as info:
        decode(encode(header(m), x, toks(), 256), expect(m))
    assert info.value.code == ErrorCode.NOT_FINITE


@pytest.mark.parametrize("huge", [3.3e38, 1e30, 3e6])
def test_huge_finite_scale_refused_as_out_of_range(m, huge):
    """The observed poison: one token row holding 3.3e38 is finite and quantises to a finite scale,
    but its square overflows the receiver's RMSNorm. Refused before any compute."""
    x = payload()
    x[0, 5, 7] = huge
    blob = encode(header(m), x, toks(), 256)
    with pytest.raises(WireError) as info:
        decode(blob, expect(m))
    assert info.value.code == ErrorCode.OUT_OF_RANGE
    # the honest codec refuses to send such a row in the first place
    with pytest.raises(WireError) as info:
        BoundaryCodec(m, PipelineStage(m, 0).subspace).encode_forward(x, toks(), "t", 1)
    assert info.value.code == ErrorCode.OUT_OF_RANGE


@pytest.mark.parametrize("delta", [-1, 1, -4])
def test_wrong_length_refused(m, delta):
    blob = encode(header(m), payload(), toks(), 256)
    blob = blob[:delta] if delta < 0 else blob + b"\0" * delta
    with pytest.raises(WireError) as info:
        decode(blob, expect(m))
    assert info.value.code == ErrorCode.MALFORMED


def test_bf16_message_refused_by_int8_receiver(m):
    dense = manifest(wire_dtype="bf16")
    h = Header(**{**header(m).__dict__, "dtype": "bf16", "run_id": m.run_id})
    blob = encode(h, payload(), toks(), 256)
    with pytest.raises(WireError) as info:
        decode(blob, expect(m))
    assert info.value.code == ErrorCode.WRONG_DTYPE
    assert dense.run_id != m.run_id  # the wire dtype is part of the run


def test_codec_round_trip_through_stages(m):
    stage0 = PipelineStage(m, 0)
    codec = BoundaryCodec(m, stage0.subspace)
    tokens = toks()
    hidden = payload()
    blob = codec.encode_forward(hidden, tokens, "trip", 1)
    _, rebuilt, got_tokens = codec.decode_forward(blob, 1)
    assert torch.equal(got_tokens, tokens)
    assert (rebuilt - hidden).abs().max() <= hidden.abs().max() / 127
    back = codec.encode_backward(hidden * 1e-6, "trip", 0, loss=2.0)
    header_back, grad = codec.decode_backward(back, 0)
    assert header_back.loss == 2.0 and (grad - hidden * 1e-6).abs().max() <= 1e-6 * hidden.abs().max() / 127


def test_int8_scales_at_an_unaligned_offset_decode():
    """d ≡ 2 (mod 4) puts the scales at an offset that is not a multiple of 4 when batch·seq is odd."""
    base = preset("tiny", stages=2, compression="none", wire_dtype="int8")
    manifest = preset(
        "tiny",
        stages=2,
        compression="none",
        wire_dtype="int8",
        model=base.model.model_copy(update={"d_model": 258, "n_heads": 3, "n_kv_heads": 1}),
    )
    payload = torch.randn(1, 3, 258)
    header = Header(
        run_id=manifest.run_id,
        u_version=0,
        t_fixed_sha256=manifest.t_fixed_sha256,
        trip_id="t",
        stage=1,
        kind="forward",
        dtype="int8",
        shape=(1, 3, 258),
        has_tokens=True,
    )
    blob = encode(header, payload, torch.zeros(1, 3, dtype=torch.long), 256)
    _, decoded, _ = decode(blob, expectation_for(manifest, 1, "forward", 0, manifest.t_fixed_sha256))
    assert (decoded - payload).abs().max() < 0.05
