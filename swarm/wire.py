"""Wire format of boundary messages, and their validation before any work is done.

A message is `MAGIC | u32 header length | header | payload | token ids`, little-endian.
The header says what the receiver must already agree with (run, `U` version, `T_fixed` hash,
stage) and the payload's shape and dtype; `decode` checks every claim against the receiver's
expectations and the byte count against the shape before it allocates a tensor, so whatever a
remote peer sends ends as a `WireError` with a precise code, never as a crash.

The header is binary (`_HEAD` below, then length-prefixed strings): with magic and length, 127
bytes forward and 156 back (tiny preset, uuid trip ids, three hop versions) where JSON took 282
and 309 per message. Kind and dtype stay short strings, so a
message claiming a kind or dtype this peer does not know is refused naming what it claimed.

Values are checked as well as shapes: a payload must be finite and every token's row must lie
within a norm bound (`MAX_ACTIVATION_NORM` forward, `MAX_GRADIENT_NORM` backward), so a
well-formed message of absurd values (a row of 3.3e38, whose square overflows float32 in the
receiver's first RMSNorm) is refused as `out_of_range` before any compute.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Literal

import torch

from swarm.manifest import Manifest, token_id_itemsize
from swarm.wire_dtype import WireDTypeName, wire_dtype
from swarm.wire_error import ErrorCode, WireError

MAGIC = b"PSW2"  # PSW1 headers were JSON: a peer of either format refuses the other's messages as malformed
MAX_HEADER_BYTES = 4096
MAX_TRIP_ID = 128  # characters
# flags, U version, receiving stage, batch, sequence, width, T_fixed SHA-256 (raw); then the loss as a
# float64 if FLAG_LOSS, then run id, trip id, kind, dtype (u8 length + UTF-8 each) and extra (u16 length + JSON)
_HEAD = struct.Struct("<BIIiii32s")
_LOSS = struct.Struct("<d")
FLAG_TOKENS, FLAG_LOSS = 1, 2
MAX_HOPS = 1024  # a refusal relayed from further down than any pipeline is long is malformed
Kind = Literal["forward", "backward"]

# Per-token L2 bounds on payload rows, the same for every compression mode (a compressed row
# `c = (x − T_fixed[tok]) U` or `g U` is never longer than the d-dim vector it encodes, since U has
# orthonormal columns; so one bound on the residual stream or its gradient covers both).
#
# Honest traffic stays orders of magnitude below them. Measured with `swarm.simulate` on the tiny
# preset split in 4 stages (d=256, k=4), 100 optimizer steps per mode (loss 5.6 → 2.1–2.4), the
# largest token row that crossed any boundary, gradients doubled to the peer's per-microbatch loss:
#   compression none, int8 wire:   activations 162 (mean 48),  gradients 0.16
#   compression boundary, bf16:    coefficients 294 (mean 67), gradients 1.5
#   compression subspace, bf16:    coefficients 221 (mean 56), gradients 0.23
# (residual norms grow as training goes: ~3 at the first steps). 1e6 and 1e4 leave over three
# orders of magnitude; tests/test_attack_poison.py checks a short run stays 1000x below. Trained
# LLaMA-scale models keep per-token residual norms in the hundreds to a few thousand (their rare
# "massive activations" reach ~1e3-1e4 in one coordinate, which fp16 inference already caps at
# 65504 per value). Gradients per token are small because the loss is a mean over the tokens.
#
# And the bounds stay far below what breaks float32 downstream: RMSNorm squares its input and sums
# d squares, so a row must have norm < ~1.8e19 (its squared norm < 3.4e38); 1e6 leaves 13 orders of
# magnitude, and products such as a stage's ∂/∂U terms (activation × gradient, summed over tokens and
# microbatches) stay finite as well. A gradient within its bound is then clipped like any other.
MAX_ACTIVATION_NORM = 1e6
MAX_GRADIENT_NORM = 1e4

_TOKEN_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@dataclass(frozen=True)
class Header:
    run_id: str
    u_version: int
    t_fixed_sha256: str
    trip_id: str
    stage: int  # the stage that receives this message
    kind: Kind
    dtype: WireDTypeName
    shape: tuple[int, int, int]  # batch, sequence, width (k compressed, d dense)
    has_tokens: bool
    loss: float | None = None  # the tail's loss, carried back to the driver
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Expectation:
    """What a receiver accepts; built from its manifest and its current `U` version."""

    run_id: str
    u_version: int
    t_fixed_sha256: str
    stage: int
    kind: Kind
    dtype: WireDTypeName
    width: int
    vocab_size: int
    max_batch: int
    max_seq: int
    needs_tokens: bool

    @property
    def max_token_norm(self) -> float:
        """The largest per-token L2 norm a payload row may have (see MAX_ACTIVATION_NORM)."""
        return MAX_ACTIVATION_NORM if self.kind == "forward" else MAX_GRADIENT_NORM

    @property
    def max_bytes(self) -> int:
        cells = self.max_batch * self.max_seq
        return len(MAGIC) + 4 + MAX_HEADER_BYTES + wire_dtype(self.dtype).payload_bytes(cells, self.width) + cells * 4


def expectation_for(manifest: Manifest, stage: int, kind: Kind, u_version: int, t_fixed_sha256: str) -> Expectation:
    compressed = manifest.mode.compressed
    return Expectation(
        run_id=manifest.run_id,
        u_version=u_version,
        t_fixed_sha256=t_fixed_sha256,
        stage=stage,
        kind=kind,
        dtype=manifest.wire_dtype,
        width=manifest.k if compressed else manifest.model.d_model,
        vocab_size=manifest.model.vocab_size,
        max_batch=manifest.batch.microbatch_size,
        max_seq=manifest.model.max_seq_len,
        needs_tokens=kind == "forward",
    )


def max_token_norm(payload: torch.Tensor) -> float:
    """The largest L2 norm of a row (token) of `payload` (inf when one overflows float32)."""
    if payload.numel() == 0:
        return 0.0
    return float(torch.linalg.vector_norm(payload.detach().float(), dim=-1).max())


def check_range(payload: torch.Tensor, bound: float, what: str) -> None:
    """Refuse a payload holding NaN/inf (`not_finite`) or a token row longer than `bound` (`out_of_range`)."""
    if not torch.isfinite(payload).all():
        raise WireError(ErrorCode.NOT_FINITE, f"{what} holds NaN or infinite values")
    norm = max_token_norm(payload)
    if not norm <= bound:
        raise WireError(ErrorCode.OUT_OF_RANGE, f"{what} has a token of norm {norm:.3g}, the bound is {bound:.3g}")


def encode(header: Header, payload: torch.Tensor, tokens: torch.Tensor | None, vocab_size: int) -> bytes:
    if tuple(payload.shape) != tuple(header.shape):
        raise ValueError(f"payload shape {tuple(payload.shape)} differs from header shape {header.shape}")
    head = pack_header(header)
    parts = [MAGIC, struct.pack("<I", len(head)), head, wire_dtype(header.dtype).encode(payload)]
    if tokens is not None:
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
            raise ValueError(f"token ids must lie in [0, {vocab_size}) to be encoded")
        token_dtype = _TOKEN_DTYPES[token_id_itemsize(vocab_size)]
        parts.append(tokens.detach().to(token_dtype).contiguous().cpu().numpy().tobytes())
    return b"".join(parts)


def pack_header(header: Header) -> bytes:
    """The binary header of `header` (ValueError for a value the format cannot carry)."""
    flags = (FLAG_TOKENS if header.has_tokens else 0) | (FLAG_LOSS if header.loss is not None else 0)
    try:
        digest = bytes.fromhex(header.t_fixed_sha256)
        if len(digest) != 32 or digest.hex() != header.t_fixed_sha256:
            raise ValueError(f"T_fixed hash {header.t_fixed_sha256!r} is not a SHA-256 in lowercase hex")
        fixed = _HEAD.pack(flags, header.u_version, header.stage, *header.shape, digest)
        parts = [fixed, _LOSS.pack(header.loss) if header.loss is not None else b""]
        for text in (header.run_id, header.trip_id, header.kind, header.dtype):
            raw = text.encode()
            parts += [struct.pack("<B", len(raw)), raw]
        extra = json.dumps(header.extra, separators=(",", ":")).encode() if header.extra else b""
        parts += [struct.pack("<H", len(extra)), extra]
    except (struct.error, TypeError) as exc:
        raise ValueError(f"header cannot be encoded: {exc}") from None
    return b"".join(parts)


class _Reader:
    """Reads a header field by field; running past its end raises ValueError."""

    def __init__(self, raw: bytes):
        self.raw, self.at = raw, 0

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.raw):
            raise ValueError(f"header ends at byte {len(self.raw)}, a field needs {self.at + n}")
        self.at += n
        return self.raw[self.at - n : self.at]

    def unpack(self, layout: struct.Struct) -> tuple:
        return layout.unpack(self.take(layout.size))

    def text(self, length_format: str = "<B") -> str:
        (length,) = struct.unpack(length_format, self.take(struct.calcsize(length_format)))
        return self.take(length).decode()  # UnicodeDecodeError is a ValueError


def _parse_header(blob: bytes) -> Header:
    if len(blob) < len(MAGIC) + 4 or blob[: len(MAGIC)] != MAGIC:
        raise WireError(ErrorCode.MALFORMED, "message does not start with the protocol magic")
    (length,) = struct.unpack_from("<I", blob, len(MAGIC))
    if length > MAX_HEADER_BYTES or len(MAGIC) + 4 + length > len(blob):
        raise WireError(ErrorCode.MALFORMED, f"header length {length} is out of bounds")
    reader = _Reader(blob[len(MAGIC) + 4 : len(MAGIC) + 4 + length])
    try:
        flags, u_version, stage, batch, seq, width, t_fixed = reader.unpack(_HEAD)
        if flags & ~(FLAG_TOKENS | FLAG_LOSS):
            raise ValueError(f"unknown flags {flags:#x}")
        (loss,) = reader.unpack(_LOSS) if flags & FLAG_LOSS else (None,)
        run_id, trip_id, kind, dtype = (reader.text() for _ in range(4))
        extra_json = reader.text("<H")
        extra = json.loads(extra_json) if extra_json else {}
        if reader.at != len(reader.raw):
            raise ValueError(f"{len(reader.raw) - reader.at} bytes after the last field")
    except (ValueError, RecursionError) as exc:  # deep nesting in `extra` raises RecursionError
        raise WireError(ErrorCode.MALFORMED, f"header is not valid: {exc}") from None
    if len(trip_id) > MAX_TRIP_ID or not isinstance(extra, dict):
        raise WireError(ErrorCode.MALFORMED, "header fields have the wrong types")
    return Header(
        run_id=run_id,
        u_version=u_version,
        t_fixed_sha256=t_fixed.hex(),
        trip_id=trip_id,
        stage=stage,
        kind=kind,
        dtype=dtype,
        shape=(batch, seq, width),
        has_tokens=bool(flags & FLAG_TOKENS),
        loss=loss,
        extra=extra,
    )


ERROR_MAGIC = b"PSWE"


def encode_error(code: ErrorCode, message: str, hops: int = 0) -> bytes:
    """A refusal: the reply a peer sends instead of a message, with a precise code."""
    return ERROR_MAGIC + json.dumps({"code": code.value, "message": message[:1000], "hops": hops}).encode()


def raise_if_error(blob: bytes) -> None:
    """Turn an error reply from a remote peer into a WireError (unknown codes become MALFORMED)."""
    if not blob.startswith(ERROR_MAGIC):
        return
    try:
        body = json.loads(blob[len(ERROR_MAGIC) : len(ERROR_MAGIC) + 4096])
        code, message, hops = ErrorCode(body["code"]), str(body["message"]), body.get("hops", 0)
        if type(hops) is not int or not 0 <= hops < MAX_HOPS:
            raise ValueError(hops)
    except (ValueError, KeyError, TypeError, RecursionError):
        raise WireError(ErrorCode.MALFORMED, "remote peer sent an unreadable error reply") from None
    raise WireError(code, f"remote: {message}", hops + 1)


def decode(blob: bytes, expect: Expectation) -> tuple[Header, torch.Tensor, torch.Tensor | None]:
    """Validate everything, then build tensors. Raises WireError; never anything else."""
    if len(blob) > expect.max_bytes:
        raise WireError(ErrorCode.TOO_LARGE, f"{len(blob)} bytes exceed the limit of {expect.max_bytes}")
    header = _parse_header(blob)
    if header.run_id != expect.run_id:
        raise WireError(
            ErrorCode.WRONG_RUN, f"message is for run {header.run_id!r}, this peer serves {expect.run_id!r}"
        )
    if header.t_fixed_sha256 != expect.t_fixed_sha256:
        raise WireError(
            ErrorCode.WRONG_HASH,
            f"sender's T_fixed hash {header.t_fixed_sha256[:16]} differs from ours {expect.t_fixed_sha256[:16]}",
        )
    if header.u_version != expect.u_version:
        raise WireError(
            ErrorCode.WRONG_VERSION, f"sender uses U version {header.u_version}, this peer uses {expect.u_version}"
        )
    if header.stage != expect.stage:
        raise WireError(ErrorCode.WRONG_STAGE, f"message is for stage {header.stage}, this peer serves {expect.stage}")
    if header.kind != expect.kind:
        raise WireError(ErrorCode.WRONG_KIND, f"expected a {expect.kind} message, got {header.kind!r}")
    if header.dtype != expect.dtype:
        raise WireError(ErrorCode.WRONG_DTYPE, f"payload dtype {header.dtype!r}, the run uses {expect.dtype!r}")
    batch, seq, width = header.shape
    if width != expect.width:
        raise WireError(ErrorCode.WRONG_SHAPE, f"payload width {width}, expected {expect.width}")
    if not (1 <= batch <= expect.max_batch and 2 <= seq <= expect.max_seq):
        raise WireError(
            ErrorCode.WRONG_SHAPE,
            f"batch {batch} × sequence {seq} outside 1..{expect.max_batch} × 2..{expect.max_seq}",
        )
    if header.has_tokens != expect.needs_tokens:
        raise WireError(
            ErrorCode.MALFORMED, f"{header.kind} messages {'need' if expect.needs_tokens else 'carry no'} token ids"
        )
    if header.loss is not None and not math.isfinite(header.loss):
        raise WireError(ErrorCode.NOT_FINITE, "reported loss is not finite")
    token_bytes = token_id_itemsize(expect.vocab_size)
    dtype = wire_dtype(header.dtype)
    payload_bytes = dtype.payload_bytes(batch * seq, width)
    start = len(MAGIC) + 4 + struct.unpack_from("<I", blob, len(MAGIC))[0]
    expected_len = start + payload_bytes + (batch * seq * token_bytes if header.has_tokens else 0)
    if len(blob) != expected_len:
        raise WireError(ErrorCode.MALFORMED, f"message has {len(blob)} bytes, its header implies {expected_len}")
    payload = dtype.decode(blob[start : start + payload_bytes], batch, seq, width)
    check_range(payload, expect.max_token_norm, "payload")
    tokens = None
    if header.has_tokens:
        raw_tokens = torch.frombuffer(bytearray(blob[start + payload_bytes :]), dtype=torch.uint8)
        tokens = raw_tokens.view(_TOKEN_DTYPES[token_bytes]).to(torch.int64)
        if token_bytes == 2:
            tokens = tokens & 0xFFFF  # stored as int16; ids are unsigned
        tokens = tokens.reshape(batch, seq)
        if tokens.min().item() < 0 or tokens.max().item() >= expect.vocab_size:
            raise WireError(ErrorCode.BAD_TOKENS, f"token ids must lie in [0, {expect.vocab_size})")
    return header, payload, tokens
