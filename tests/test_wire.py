"""The wire format: round trips in every dtype, and every way a message can be wrong ends as a
WireError with its precise code, never as another exception."""

from __future__ import annotations

import random
import struct
from dataclasses import asdict, replace

import pytest
import torch
from builders import tiny_manifest

from swarm.wire import (
    MAGIC,
    MAX_ACTIVATION_NORM,
    MAX_GRADIENT_NORM,
    MAX_HEADER_BYTES,
    ErrorCode,
    Header,
    WireError,
    check_range,
    decode,
    encode,
    expectation_for,
    max_token_norm,
    pack_header,
)

D, K, B, S = 64, 4, 2, 8


def manifest(wire_dtype: str = "fp32", vocab_size: int = 256, compression: str = "subspace"):
    return tiny_manifest(compression, wire_dtype=wire_dtype, microbatch=4, vocab_size=vocab_size)


@pytest.fixture(scope="module")
def m():
    return manifest()


def expect(m, kind="forward", stage=1, version=0):
    return expectation_for(m, stage, kind, version, m.t_fixed_sha256)


def header(m, kind="forward", stage=1, shape=(B, S, K), **changes) -> Header:
    h = Header(run_id=m.run_id, u_version=0, t_fixed_sha256=m.t_fixed_sha256, trip_id="trip-1", stage=stage,
               kind=kind, dtype=m.wire_dtype, shape=shape, has_tokens=kind == "forward",
               loss=None if kind == "forward" else 2.5)
    return replace(h, **changes)


def payload(shape=(B, S, K), seed=0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def toks(vocab=256, shape=(B, S), seed=0) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def forward_blob(m, **changes) -> bytes:
    return encode(header(m, **changes), payload(), toks(), m.model.vocab_size)


def raw_message(head: dict | bytes, body: bytes = b"") -> bytes:
    """A message built by hand, bypassing encode()'s checks of the payload: `head` is the header's fields
    (packed as the wire packs them, whatever their values) or its raw bytes."""
    data = head if isinstance(head, bytes) else pack_header(Header(**head))
    return MAGIC + struct.pack("<I", len(data)) + data + body


def body_of(blob: bytes) -> bytes:
    (length,) = struct.unpack_from("<I", blob, len(MAGIC))
    return blob[len(MAGIC) + 4 + length:]


def refused(blob: bytes, expectation, code: ErrorCode, fragment: str = "") -> WireError:
    with pytest.raises(WireError) as info:
        decode(blob, expectation)
    assert info.value.code == code, info.value
    assert fragment in str(info.value)
    assert str(info.value).startswith(code.value + ":")
    return info.value


# --- round trips ------------------------------------------------------------------------------------

@pytest.mark.parametrize("wire_dtype,torch_dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                                    ("fp16", torch.float16)])
def test_forward_round_trip(wire_dtype, torch_dtype):
    mm = manifest(wire_dtype)
    data, ids = payload(), toks()
    blob = encode(header(mm), data, ids, 256)
    got_header, got, got_ids = decode(blob, expect(mm))
    assert got.dtype == torch_dtype and got.shape == (B, S, K)
    assert torch.equal(got, data.to(torch_dtype))  # bit exact after the dtype cast
    assert torch.equal(got_ids, ids) and got_ids.dtype == torch.int64
    assert got_header == header(mm)
    item = 4 if wire_dtype == "fp32" else 2
    assert len(body_of(blob)) == B * S * K * item + B * S  # one byte per token id for V=256


@pytest.mark.parametrize("wire_dtype", ["fp32", "bf16", "fp16"])
def test_backward_round_trip(wire_dtype):
    mm = manifest(wire_dtype)
    data = payload()
    blob = encode(header(mm, kind="backward", stage=0), data, None, 256)
    got_header, got, got_ids = decode(blob, expect(mm, "backward", stage=0))
    assert got_ids is None and got_header.loss == 2.5
    assert torch.equal(got.float(), data.to(got.dtype).float())


def test_dense_width_is_d():
    mm = manifest(compression="none")
    data = payload((B, S, D))
    _, got, _ = decode(encode(header(mm, shape=(B, S, D)), data, toks(), 256), expect(mm))
    assert torch.equal(got, data)
    refused(forward_blob(mm), expect(mm), ErrorCode.WRONG_SHAPE, "width 4, expected 64")


def test_uint16_token_ids_for_large_vocab():
    mm = manifest(vocab_size=50304)
    ids = torch.tensor([[0, 1, 255, 256, 32767, 32768], [40000, 50000, 50303, 65, 12345, 49999]])
    data = payload((2, 6, K))
    blob = encode(header(mm, shape=(2, 6, K)), data, ids, 50304)
    assert len(body_of(blob)) == 2 * 6 * K * 4 + 2 * 6 * 2  # two bytes per id
    _, _, got = decode(blob, expect(mm))
    assert torch.equal(got, ids)


def test_uint16_token_id_beyond_vocab_refused():
    mm = manifest(vocab_size=50304)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    blob = encode(header(mm, shape=(2, 3, K)), payload((2, 3, K)), ids, 50304)
    forged = blob[:-2] + (60000).to_bytes(2, "little")  # unsigned 16-bit, beyond the vocabulary
    refused(forged, expect(mm), ErrorCode.BAD_TOKENS, "[0, 50304)")


def test_int32_token_ids_for_huge_vocab():
    mm = manifest(vocab_size=128256)
    ids = torch.tensor([[0, 70000, 128255], [65536, 3, 99999]])
    blob = encode(header(mm, shape=(2, 3, K)), payload((2, 3, K)), ids, 128256)
    assert len(body_of(blob)) == 2 * 3 * K * 4 + 2 * 3 * 4
    _, _, got = decode(blob, expect(mm))
    assert torch.equal(got, ids)
    negative = blob[:-4] + (-1).to_bytes(4, "little", signed=True)  # a sender that skips encode's check
    refused(negative, expect(mm), ErrorCode.BAD_TOKENS)


def test_encode_refuses_shape_mismatch(m):
    with pytest.raises(ValueError, match="differs from header shape"):
        encode(header(m, shape=(B, S, K + 1)), payload(), toks(), 256)


def test_bad_magic(m):
    blob = forward_blob(m)
    refused(b"XXXX" + blob[4:], expect(m), ErrorCode.MALFORMED, "magic")
    refused(b"", expect(m), ErrorCode.MALFORMED, "magic")


def test_truncated(m):
    blob = forward_blob(m)
    refused(blob[:6], expect(m), ErrorCode.MALFORMED)  # not even a header length
    refused(blob[:20], expect(m), ErrorCode.MALFORMED, "header length")  # header cut short
    refused(blob[:-1], expect(m), ErrorCode.MALFORMED, "its header implies")  # last token id missing


def test_header_length_too_large(m):
    refused(MAGIC + struct.pack("<I", MAX_HEADER_BYTES + 1) + b"{" * 10, expect(m), ErrorCode.MALFORMED,
            "out of bounds")


def _packed(m, extra_json: bytes = b"", **changes) -> bytes:
    """A backward header packed field by field as `pack_header` does, with raw `extra` bytes."""
    h = header(m, kind="backward", **changes)
    fixed = struct.pack("<BIIiii32s", 2, h.u_version, h.stage, *h.shape, bytes.fromhex(h.t_fixed_sha256))
    texts = b"".join(bytes([len(t.encode())]) + t.encode() for t in (h.run_id, h.trip_id, h.kind, h.dtype))
    return fixed + struct.pack("<d", h.loss) + texts + struct.pack("<H", len(extra_json)) + extra_json


@pytest.mark.parametrize("garbage", [
    b"not a header at all",
    b"\xff\xfe\xfd",
    b"[1, 2, 3]",
    b"",
    b"\0" * 57,  # the fixed fields and nothing after them
    b"\0" * 200,
    b"\xff" * 300,  # unknown flags
])
def test_header_garbage(m, garbage):
    refused(raw_message(garbage), expect(m), ErrorCode.MALFORMED, "header is not valid")


def test_header_packed_by_hand_is_read(m):
    """`_packed` writes the format swarm/wire.py describes (the garbage tests below rely on it)."""
    got, _, _ = decode(raw_message(_packed(m, stage=0), body_of(encode(header(m, kind="backward", stage=0),
                                                                          payload(), None, 256))),
                       expect(m, "backward", stage=0))
    assert got == header(m, kind="backward", stage=0)


@pytest.mark.parametrize("corrupt", [
    lambda raw: raw[:-1],  # a field cut short
    lambda raw: raw + b"\0",  # bytes after the last field
    lambda raw: raw[:65] + b"\xff" + raw[66:],  # the run id's length (after 57 fixed + 8 loss bytes) runs past the end
    lambda raw: b"\x83" + raw[1:],  # unknown flags
])
def test_header_structure_corrupted(m, corrupt):
    refused(raw_message(corrupt(_packed(m))), expect(m, "backward"), ErrorCode.MALFORMED, "header is not valid")


def _header_dict(m, **changes) -> dict:
    data = asdict(header(m))
    data.update(changes)
    return data


@pytest.mark.parametrize("changes,extra_json", [
    ({"trip_id": "x" * 200}, b""),  # longer than a trip id may be
    ({"run_id": "\udcff"}, b""),  # not UTF-8 on the wire (packed below as a lone surrogate's bytes)
    ({}, b"[]"),  # extra is not an object
    ({}, b"not json"),
    ({}, b"[" * 3000),  # deep nesting: json raises RecursionError
    ({}, b'{"a": 1'),
])
def test_header_fields_with_wrong_types(m, changes, extra_json):
    if "run_id" in changes:  # a string whose bytes are not UTF-8
        raw = _packed(m, extra_json).replace(bytes([len(m.run_id)]) + m.run_id.encode(), b"\x01\xff", 1)
    else:
        raw = _packed(m, extra_json, **changes)
    refused(raw_message(raw, body_of(encode(header(m, kind="backward"), payload(), None, 256))),
            expect(m, "backward"), ErrorCode.MALFORMED)


def test_header_values_the_format_cannot_carry_are_refused_by_encode(m):
    for changes in ({"u_version": -1}, {"stage": 2**32}, {"t_fixed_sha256": "F" * 64}, {"t_fixed_sha256": "ab"},
                    {"run_id": "r" * 300}, {"shape": (B, S, 2.0)}):
        with pytest.raises(ValueError):
            encode(header(m, **changes), payload(), toks(), 256)


def test_binary_header_is_small(m):
    """The header is what every trip pays per message besides its payload (issue 13: ~280 B as JSON)."""
    blob = encode(header(m), payload(), toks(), 256)
    # a 3-stage reply: each hop's U version and the epoch of its weights (156 B with the versions alone)
    back = encode(header(m, kind="backward", stage=0, trip_id="f" * 32,
                         extra={"versions": [0, 0, 0], "epochs": [1234, 1234, 1234]}), payload(), None, 256)
    assert len(blob) - len(body_of(blob)) <= 8 + 57 + 4 * 1 + len(m.run_id) + len("trip-1forwardfp32") + 2
    assert len(back) - len(body_of(back)) <= 185


def test_too_large(m):
    expectation = expect(m)
    blob = forward_blob(m) + b"\0" * expectation.max_bytes
    refused(blob, expectation, ErrorCode.TOO_LARGE, "exceed the limit")


def test_wrong_run(m):
    refused(forward_blob(m, run_id="other-run"), expect(m), ErrorCode.WRONG_RUN, "other-run")
    other = manifest(wire_dtype="fp32", compression="boundary")  # same shapes, different run
    refused(forward_blob(m), expect(other), ErrorCode.WRONG_RUN)


def test_wrong_version(m):
    refused(forward_blob(m, u_version=1), expect(m), ErrorCode.WRONG_VERSION, "U version 1")
    refused(forward_blob(m), expect(m, version=3), ErrorCode.WRONG_VERSION, "this peer uses 3")


def test_wrong_hash(m):
    refused(forward_blob(m, t_fixed_sha256="f" * 64), expect(m), ErrorCode.WRONG_HASH, "ffff")


def test_wrong_stage(m):
    refused(forward_blob(m, stage=0), expect(m), ErrorCode.WRONG_STAGE, "stage 0")


def test_wrong_kind(m):
    refused(forward_blob(m), expect(m, kind="backward"), ErrorCode.WRONG_KIND, "backward")
    # a kind that does not exist
    refused(raw_message(_header_dict(m, kind="sideways"), body_of(forward_blob(m))), expect(m),
            ErrorCode.WRONG_KIND, "sideways")


def test_wrong_dtype(m):
    half = encode(header(m, dtype="bf16"), payload(), toks(), 256)
    refused(half, expect(m), ErrorCode.WRONG_DTYPE, "'bf16'")
    refused(raw_message(_header_dict(m, dtype="fp64"), body_of(forward_blob(m))), expect(m),
            ErrorCode.WRONG_DTYPE, "fp64")


def test_wrong_width(m):
    blob = encode(header(m, shape=(B, S, K + 1)), payload((B, S, K + 1)), toks(), 256)
    refused(blob, expect(m), ErrorCode.WRONG_SHAPE, f"width {K + 1}, expected {K}")


@pytest.mark.parametrize("batch,seq", [(0, S), (5, S), (B, 1), (B, 65), (-1, S), (B, 0)])
def test_batch_or_seq_out_of_bounds(m, batch, seq):
    # claims only: the shape check comes before the byte count, so no payload is needed
    blob = raw_message(_header_dict(m, shape=[batch, seq, K]))
    refused(blob, expect(m), ErrorCode.WRONG_SHAPE, "outside 1..4 × 2..64")


def test_tokens_missing_or_unexpected(m):
    without = encode(header(m, has_tokens=False), payload(), None, 256)
    refused(without, expect(m), ErrorCode.MALFORMED, "need token ids")
    backward_with = encode(header(m, kind="backward", stage=0, has_tokens=True), payload(), toks(), 256)
    refused(backward_with, expect(m, "backward", stage=0), ErrorCode.MALFORMED, "carry no token ids")


@pytest.mark.parametrize("wire_dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_payload(wire_dtype, bad):
    mm = manifest(wire_dtype)
    data = payload()
    data[1, 3, 2] = bad
    refused(encode(header(mm), data, toks(), 256), expect(mm), ErrorCode.NOT_FINITE, "NaN or infinite")


def test_fp16_overflow_is_not_finite():
    mm = manifest("fp16")
    data = payload()
    data[0, 0, 0] = 1e6  # beyond fp16's range: the sender's cast makes it inf
    refused(encode(header(mm), data, toks(), 256), expect(mm), ErrorCode.NOT_FINITE)


MODES = [("subspace", "fp32"), ("subspace", "bf16"), ("boundary", "bf16"), ("none", "int8"), ("none", "bf16"),
         ("none", "fp32")]


def _row(width: int, norm: float) -> torch.Tensor:
    return torch.full((width,), norm / width**0.5)


@pytest.mark.parametrize("compression,wire_dtype", MODES)
@pytest.mark.parametrize("norm", [3.3e38, 1e30, 1e10, 2 * MAX_ACTIVATION_NORM])
def test_absurd_activations_are_out_of_range(compression, wire_dtype, norm):
    """A well-formed, finite row of absurd size (3.3e38 overflowed the receiver's RMSNorm) is refused."""
    mm = manifest(wire_dtype, compression=compression)
    width = K if compression != "none" else D
    data = payload((B, S, width))
    data[1, 3] = _row(width, norm) if norm < 1e38 else torch.full((width,), norm)
    refused(encode(header(mm, shape=(B, S, width)), data, toks(), 256), expect(mm), ErrorCode.OUT_OF_RANGE, "bound")


@pytest.mark.parametrize("compression,wire_dtype", MODES)
@pytest.mark.parametrize("norm", [3.3e38, 1e20, 2 * MAX_GRADIENT_NORM])
def test_absurd_gradients_are_out_of_range(compression, wire_dtype, norm):
    mm = manifest(wire_dtype, compression=compression)
    width = K if compression != "none" else D
    data = payload((B, S, width)) * 1e-3
    data[0, 0] = _row(width, norm) if norm < 1e38 else torch.full((width,), norm)
    blob = encode(header(mm, kind="backward", stage=0, shape=(B, S, width)), data, None, 256)
    refused(blob, expect(mm, "backward", stage=0), ErrorCode.OUT_OF_RANGE, "bound")


@pytest.mark.parametrize("compression,wire_dtype", MODES)
def test_rows_within_the_bounds_pass(compression, wire_dtype):
    mm = manifest(wire_dtype, compression=compression)
    width = K if compression != "none" else D
    data = payload((B, S, width))
    data[1, 3] = _row(width, MAX_ACTIVATION_NORM / 2)
    _, got, _ = decode(encode(header(mm, shape=(B, S, width)), data, toks(), 256), expect(mm))
    assert torch.isfinite(got).all() and got[1, 3].norm() < MAX_ACTIVATION_NORM
    grad = payload((B, S, width)) * 1e-3
    grad[0, 0] = _row(width, MAX_GRADIENT_NORM / 2)
    blob = encode(header(mm, kind="backward", stage=0, shape=(B, S, width)), grad, None, 256)
    _, got, _ = decode(blob, expect(mm, "backward", stage=0))
    assert got[0, 0].norm() < MAX_GRADIENT_NORM


def test_check_range_and_token_norms():
    rows = torch.zeros(2, 3, 4)
    rows[1, 2] = torch.tensor([3.0, 4.0, 0.0, 0.0])
    assert max_token_norm(rows) == 5.0
    assert max_token_norm(torch.full((1, 1, 4), 3.3e38)) == float("inf")  # overflows: refused by any bound
    check_range(rows, 5.0, "x")
    with pytest.raises(WireError) as info:
        check_range(rows, 4.9, "x")
    assert info.value.code == ErrorCode.OUT_OF_RANGE
    rows[0, 0, 0] = float("nan")
    with pytest.raises(WireError) as info:
        check_range(rows, 5.0, "x")
    assert info.value.code == ErrorCode.NOT_FINITE


def test_non_finite_loss(m):
    backward = encode(header(m, kind="backward", stage=0, loss=float("nan")), payload(), None, 256)
    refused(backward, expect(m, "backward", stage=0), ErrorCode.NOT_FINITE, "loss")


def test_token_ids_beyond_vocab():
    mm = manifest(vocab_size=300)  # two-byte ids, so 299 < id < 65536 can be sent
    blob = encode(header(mm), payload(), toks(300), 300)
    forged = blob[:-2] + (300).to_bytes(2, "little")  # a sender that skips encode's own check
    refused(forged, expect(mm), ErrorCode.BAD_TOKENS, "[0, 300)")


def test_encode_refuses_ids_it_cannot_carry():
    ids = toks(256)
    ids[0, 0] = 70000
    with pytest.raises(ValueError, match="token ids"):
        encode(header(manifest(vocab_size=50304)), payload(), ids, 50304)


def test_length_mismatch(m):
    blob = forward_blob(m)
    refused(blob + b"\0", expect(m), ErrorCode.MALFORMED, "its header implies")
    shorter = encode(header(m), payload(), None, 256)  # a forward message without its token ids
    head = _header_dict(m)
    refused(raw_message(head, body_of(shorter)), expect(m), ErrorCode.MALFORMED, "its header implies")


def test_random_corruption_never_crashes(m):
    """Whatever bytes arrive, decode ends in a result or a WireError."""
    rng = random.Random(0)
    blobs = [forward_blob(m), encode(header(m, kind="backward", stage=0), payload(), None, 256)]
    expectations = [expect(m), expect(m, "backward", stage=0)]
    codes = set()
    for trial in range(400):
        which = trial % 2
        blob = bytearray(blobs[which])
        for _ in range(rng.randint(1, 4)):
            action = rng.random()
            pos = rng.randrange(len(blob))
            if action < 0.6:
                blob[pos] = rng.randrange(256)
            elif action < 0.8:
                del blob[pos:pos + rng.randint(1, 40)]
            else:
                blob[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        try:
            decode(bytes(blob), expectations[which])
        except WireError as exc:
            codes.add(exc.code)
    assert ErrorCode.MALFORMED in codes and len(codes) >= 3


# --- error replies ----------------------------------------------------------------------------------

def test_error_replies():
    from swarm import wire

    wire.raise_if_error(b"PSW1 not an error")  # an ordinary message passes through
    with pytest.raises(WireError) as info:
        wire.raise_if_error(wire.encode_error(ErrorCode.OVERLOADED, "busy"))
    assert info.value.code == ErrorCode.OVERLOADED and "busy" in str(info.value)
    assert info.value.hops == 1  # refused by the peer we sent to
    with pytest.raises(WireError) as relayed:  # that peer relays a refusal from the one after it
        wire.raise_if_error(wire.encode_error(info.value.code, info.value.message, info.value.hops))
    assert relayed.value.hops == 2 and relayed.value.code == ErrorCode.OVERLOADED
    bad_hops = [b'{"code": "timeout", "message": "x", "hops": %s}' % h for h in (b"-1", b'"1"', b"1e9", b"true")]
    unreadable = (b'{"code": "no-such-code", "message": "x"}', b"[" * 3000, b"\xff", b'{"code": "timeout"}')
    for broken in (*unreadable, *bad_hops):
        with pytest.raises(WireError) as info:
            wire.raise_if_error(wire.ERROR_MAGIC + broken)
        assert info.value.code == ErrorCode.MALFORMED


def test_a_peer_of_the_old_defaults_and_one_of_the_new_refuse_each_other():
    """Stage embeddings and a T_fixed scale change the run: a message between a peer of a manifest written
    before them and a peer of the new defaults is refused by run id, and, where a forged header claims the
    other's run, by the T_fixed hash."""
    old = tiny_manifest("subspace", wire_dtype="fp32", microbatch=4, t_fixed_std=0.02, stage_embedding_rank=0)
    new = tiny_manifest("subspace", wire_dtype="fp32", microbatch=4, t_fixed_std=1.0, stage_embedding_rank=D)
    assert new.stage_embedding_rank == D and old.run_id != new.run_id
    refused(forward_blob(old), expect(new), ErrorCode.WRONG_RUN, old.run_id)
    refused(forward_blob(new), expect(old), ErrorCode.WRONG_RUN, new.run_id)
    forged = forward_blob(old, run_id=new.run_id)
    refused(forged, expect(new), ErrorCode.WRONG_HASH, old.t_fixed_sha256[:8])
