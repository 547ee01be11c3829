"""int8 coefficients (issue 18): compressed modes send k coefficients per token as int8 with one float32
absmax scale per token, forward (c = (x − T_fixed[tok]) U) and backward (g U) alike.

The model is defined through the wire: the receiver's input is T_fixed[tok] + ĉ Uᵀ with ĉ the
dequantised coefficients, in the simulator as between peers, and the sender backpropagates exactly
the dequantised gradient (ĝU) Uᵀ. So every parameter gradient upstream is the exact backpropagation
of the gradient message that was sent (straight through the rounding, which has no useful
derivative), which these tests check against a trip assembled by hand."""

from __future__ import annotations

import struct

import pytest
import torch
from builders import tiny_manifest

from swarm.codec import BoundaryCodec
from swarm.model import build_stages, next_token_loss
from swarm.simulate import run_trip
from swarm.wire import MAGIC, ErrorCode, WireError
from swarm.wire_dtype import quantize_int8, wire_dtype

K, D, B, S = 4, 64, 2, 32
INT8_SCALE_BYTES = 4  # one float32 absmax scale per token
COMPRESSED = ["boundary", "subspace", "boundary-free-ts"]


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(5))


def body_start(blob: bytes) -> int:
    return len(MAGIC) + 4 + struct.unpack_from("<I", blob, len(MAGIC))[0]


@pytest.mark.parametrize("compression", COMPRESSED)
def test_manifest_takes_int8_and_counts_its_scale(compression):
    m = tiny_manifest(compression, wire_dtype="int8")
    assert m.compressed_bytes_per_token() == K + INT8_SCALE_BYTES + 1  # k values, one scale, the token id
    assert wire_dtype("int8").payload_bytes(B * S, K) == B * S * (K + INT8_SCALE_BYTES)
    assert m.run_id != tiny_manifest(compression, wire_dtype="bf16").run_id


@pytest.mark.parametrize("compression", COMPRESSED)
def test_upstream_gradients_are_exact_for_what_was_sent(compression):
    m = tiny_manifest(compression, wire_dtype="int8", microbatch=B)
    stages = build_stages(m)
    by_hand = build_stages(m)  # the same seeded init, with its own gradient hooks
    tok = tokens()
    stats = run_trip(stages, tok)
    assert stats.forward_bytes - body_start_of(stages, tok) == B * S * (K + INT8_SCALE_BYTES + 1)

    # the same trip by hand: what crosses is quantised, and each side works with the dequantised tensor
    head, tail = by_hand
    basis, t_fixed = head.subspace.basis, head.subspace.t_fixed
    codec = BoundaryCodec(m, head.subspace)
    out = head(None, tok)
    values, scales = quantize_int8((out.detach() - t_fixed[tok]) @ basis)
    sent = values.float() * scales.unsqueeze(-1)
    _, received, _ = codec.decode_forward(codec.encode_forward(out, tok, "t", 1), 1)
    assert torch.allclose(received, t_fixed[tok] + sent @ basis.T, atol=1e-6)
    received.requires_grad_(True)
    loss = next_token_loss(tail(received, tok), tok)
    loss.backward()
    assert loss.item() == pytest.approx(stats.loss, abs=1e-6)
    g_values, g_scales = quantize_int8(received.grad @ basis)
    _, grad = codec.decode_backward(codec.encode_backward(received.grad, "t", 0, loss=loss.item()), 0)
    assert torch.allclose(grad, (g_values.float() * g_scales.unsqueeze(-1)) @ basis.T, atol=1e-9)
    assert not torch.allclose(grad, received.grad @ basis @ basis.T, atol=1e-9)  # the gradient was quantised
    out.backward(grad)

    for stage, manual in zip(stages, by_hand, strict=True):
        for (name, p), q in zip(stage.named_parameters(), manual.parameters(), strict=True):
            assert p.grad is not None and torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-9), name


def body_start_of(stages, tok) -> int:
    """Header bytes of the forward message of a trip of `tok` (the rest is payload and token ids)."""
    codec = BoundaryCodec(stages[0].manifest, stages[0].subspace)
    with torch.no_grad():
        blob = codec.encode_forward(stages[0](None, tok), tok, "x" * 32, 1)
    return body_start(blob)


@pytest.mark.parametrize("kind", ["forward", "backward"])
@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_coefficient_scale_refused(kind, bad):
    m = tiny_manifest("boundary", wire_dtype="int8", microbatch=B)
    head = build_stages(m)[0]
    codec = BoundaryCodec(m, head.subspace)
    tok = tokens()
    with torch.no_grad():
        out = head(None, tok)
    blob = bytearray(
        codec.encode_forward(out, tok, "t", 1) if kind == "forward" else codec.encode_backward(out * 1e-3, "t", 0)
    )
    struct.pack_into("<f", blob, body_start(blob) + B * S * K + 4 * 5, bad)  # the sixth token's scale
    decode = codec.decode_forward if kind == "forward" else codec.decode_backward
    with pytest.raises(WireError) as info:
        decode(bytes(blob), 1 if kind == "forward" else 0)
    assert info.value.code == ErrorCode.NOT_FINITE


def test_truncated_coefficient_payload_refused():
    m = tiny_manifest("subspace", wire_dtype="int8", microbatch=B)
    head = build_stages(m)[0]
    codec = BoundaryCodec(m, head.subspace)
    tok = tokens()
    with torch.no_grad():
        blob = codec.encode_forward(head(None, tok), tok, "t", 1)
    with pytest.raises(WireError) as info:
        codec.decode_forward(blob[:-3], 1)
    assert info.value.code == ErrorCode.MALFORMED
