"""Wire format of a chunk's K/V message, and the simulator that trains through it.

A message is `CP_MAGIC | u32 header length | header JSON | Z_k | Z_v | θ`, little-endian. Forward,
the owner chunk sends Z_k (B × n × r_k) and Z_v (B × n × r_v) in the wire dtype and θ (B × n_theta,
float32) to a later chunk; backward, that chunk sends ∂L/∂Z_k, ∂L/∂Z_v (wire dtype) and ∂L/∂θ
(float32) back. Dense CP uses the same format with widths d_kv and no θ. `decode_kv` checks every
claim of the header (run, CP basis version and hash, stage, layer, chunks, kind, dtype, shapes,
byte count) before it allocates a tensor, then the values (finite, per-row norm bound, |θ| ≤ θ_max);
whatever is off is a `swarm.wire.WireError` with one of its `ErrorCode`s, never a crash.

`lanes_forward` and `lanes_backward` drive the P lanes (`swarm.cp_lane.LaneTrip`) of one stage in one
process, every message through this codec, in the order a swarm runs them; `wire_step` runs one
training step of a `swarm.cp_model.CPDecoder` (the whole model as one stage) that way. Its parameter
gradients equal `CPDecoder.forward`'s.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict, dataclass
from typing import Literal

import torch

from swarm.context_parallel import THETA_WIRE, ContextParallelSpec, CPBasis, kv_width
from swarm.cp_lane import LaneTrip
from swarm.cp_model import CPDecoder
from swarm.cp_modes import KVCompression
from swarm.wire import MAX_ACTIVATION_NORM, MAX_GRADIENT_NORM, ErrorCode, WireError, check_range
from swarm.wire_dtype import wire_dtype

CP_MAGIC = b"PCP1"
MAX_HEADER_BYTES = 4096
THETA_SLACK = 1e-6  # θ is bounded by θ_max·tanh; float32 rounding may add a last bit
Kind = Literal["forward", "backward"]


@dataclass(frozen=True)
class KVHeader:
    run_id: str
    cp_version: int
    cp_sha256: str
    trip_id: str
    stage: int
    layer: int
    owner: int  # the chunk whose K/V this is
    src: int  # sending chunk (the owner, forward)
    dst: int  # receiving chunk (the owner, backward)
    kind: Kind
    dtype: str
    batch: int
    chunk_len: int
    width_k: int
    width_v: int
    n_theta: int


@dataclass(frozen=True)
class KVExpectation:
    """What the holder of chunk `chunk` of stage `stage` accepts."""

    run_id: str
    cp_version: int
    cp_sha256: str
    stage: int
    first_layer: int
    end_layer: int
    chunk: int
    size: int
    kind: Kind
    dtype: str
    chunk_len: int
    width_k: int
    width_v: int
    n_theta: int
    max_batch: int
    theta_max: float

    def payload_bytes(self, batch: int) -> int:
        z = wire_dtype(self.dtype).payload_bytes(batch * self.chunk_len, self.width_k + self.width_v)
        return z + THETA_WIRE.payload_bytes(batch, self.n_theta)

    @property
    def max_bytes(self) -> int:
        return len(CP_MAGIC) + 4 + MAX_HEADER_BYTES + self.payload_bytes(self.max_batch)


def encode_kv(header: KVHeader, z_k: torch.Tensor, z_v: torch.Tensor, theta: torch.Tensor | None) -> bytes:
    """Refuses (ValueError / WireError) to send what a receiver would refuse: a wrong shape, a non-finite value,
    a Z or a gradient of θ beyond its norm bound. A forward θ is not checked against θ_max (the header does not
    carry it): the θ head makes it θ_max·tanh(·), within the bound whenever it is finite."""
    shapes = ((header.batch, header.chunk_len, header.width_k), (header.batch, header.chunk_len, header.width_v))
    if (tuple(z_k.shape), tuple(z_v.shape)) != shapes:
        raise ValueError(f"payload shapes {tuple(z_k.shape)}, {tuple(z_v.shape)} differ from the header's {shapes}")
    if header.n_theta and (theta is None or tuple(theta.shape) != (header.batch, header.n_theta)):
        raise ValueError("θ is missing or has the wrong shape")
    bound = MAX_ACTIVATION_NORM if header.kind == "forward" else MAX_GRADIENT_NORM
    with torch.no_grad():
        for name, z in (("Z_k", z_k), ("Z_v", z_v)):
            check_range(z.float(), bound, f"this chunk's {name}")
        if header.n_theta:
            _check_theta(theta.float(), math.inf if header.kind == "forward" else MAX_GRADIENT_NORM)
    head = json.dumps(asdict(header), separators=(",", ":")).encode()
    wire = wire_dtype(header.dtype)
    parts = [CP_MAGIC, struct.pack("<I", len(head)), head, wire.encode(z_k), wire.encode(z_v)]
    if header.n_theta:
        parts.append(THETA_WIRE.encode(theta))
    return b"".join(parts)


def parse_kv_header(blob: bytes) -> tuple[KVHeader, int]:
    """The header and the payload's offset, checked for form only (no expectation, no tensor): what a
    receiver needs to route a message (trip, sending lane) before `decode_kv` checks its claims."""
    if len(blob) < len(CP_MAGIC) + 4 or blob[: len(CP_MAGIC)] != CP_MAGIC:
        raise WireError(ErrorCode.MALFORMED, "message does not start with the CP magic")
    (length,) = struct.unpack_from("<I", blob, len(CP_MAGIC))
    start = len(CP_MAGIC) + 4
    if length > MAX_HEADER_BYTES or start + length > len(blob):
        raise WireError(ErrorCode.MALFORMED, f"header length {length} is out of bounds")
    try:
        header = KVHeader(**json.loads(blob[start : start + length]))
    except (ValueError, TypeError, RecursionError) as exc:
        raise WireError(ErrorCode.MALFORMED, f"header is not valid: {exc}") from None
    ints = (
        header.cp_version,
        header.stage,
        header.layer,
        header.owner,
        header.src,
        header.dst,
        header.batch,
        header.chunk_len,
        header.width_k,
        header.width_v,
        header.n_theta,
    )
    types_ok = (
        all(isinstance(v, str) for v in (header.run_id, header.cp_sha256, header.trip_id, header.kind, header.dtype))
        and len(header.trip_id) <= 128
        and all(isinstance(v, int) and not isinstance(v, bool) for v in ints)
    )
    if not types_ok:
        raise WireError(ErrorCode.MALFORMED, "header fields have the wrong types")
    return header, start + length


def decode_kv(blob: bytes, expect: KVExpectation):
    """Validate everything, then build float32 tensors (Z_k, Z_v, θ or None). Raises WireError only."""
    if len(blob) > expect.max_bytes:
        raise WireError(ErrorCode.TOO_LARGE, f"{len(blob)} bytes exceed the limit of {expect.max_bytes}")
    header, start = parse_kv_header(blob)
    if header.run_id != expect.run_id:
        raise WireError(
            ErrorCode.WRONG_RUN, f"message is for run {header.run_id!r}, this peer serves {expect.run_id!r}"
        )
    if header.cp_version != expect.cp_version:  # before the hash: another version has another hash as well
        raise WireError(
            ErrorCode.WRONG_CP_VERSION, f"CP basis version {header.cp_version}, ours is {expect.cp_version}"
        )
    if header.cp_sha256 != expect.cp_sha256:
        raise WireError(ErrorCode.WRONG_CP_HASH, f"sender's CP basis hash {header.cp_sha256[:16]} differs from ours")
    if header.stage != expect.stage or not expect.first_layer <= header.layer < expect.end_layer:
        raise WireError(ErrorCode.WRONG_STAGE, f"stage {header.stage} layer {header.layer} is not served here")
    if header.kind != expect.kind:
        raise WireError(ErrorCode.WRONG_KIND, f"expected a {expect.kind} message, got {header.kind!r}")
    if header.dst != expect.chunk:
        raise WireError(ErrorCode.WRONG_STAGE, f"message is for chunk {header.dst}, this peer holds {expect.chunk}")
    if expect.kind == "forward":
        chunks_ok = header.owner == header.src and 0 <= header.src < header.dst
    else:
        chunks_ok = header.owner == header.dst and header.dst < header.src < expect.size
    if not chunks_ok:
        raise WireError(ErrorCode.MALFORMED, f"chunks owner {header.owner} {header.src}→{header.dst} are not causal")
    if header.dtype != expect.dtype:
        raise WireError(ErrorCode.WRONG_DTYPE, f"payload dtype {header.dtype!r}, the run uses {expect.dtype!r}")
    claimed = (header.chunk_len, header.width_k, header.width_v, header.n_theta)
    if claimed != (expect.chunk_len, expect.width_k, expect.width_v, expect.n_theta):
        raise WireError(ErrorCode.WRONG_SHAPE, f"chunk length, widths, θ count {claimed} are not the run's")
    if not 1 <= header.batch <= expect.max_batch:
        raise WireError(ErrorCode.WRONG_SHAPE, f"batch {header.batch} outside 1..{expect.max_batch}")
    if len(blob) != start + expect.payload_bytes(header.batch):
        raise WireError(ErrorCode.MALFORMED, f"message has {len(blob)} bytes, its header implies more or fewer")
    wire, cells = wire_dtype(header.dtype), header.batch * header.chunk_len
    n_k, n_v = wire.payload_bytes(cells, header.width_k), wire.payload_bytes(cells, header.width_v)
    z_k = wire.decode(blob[start : start + n_k], header.batch, header.chunk_len, header.width_k).float()
    z_v = wire.decode(blob[start + n_k : start + n_k + n_v], header.batch, header.chunk_len, header.width_v).float()
    forward = expect.kind == "forward"
    for name, z in (("Z_k", z_k), ("Z_v", z_v)):
        check_range(z, MAX_ACTIVATION_NORM if forward else MAX_GRADIENT_NORM, name)
    theta = None
    if header.n_theta:
        theta = THETA_WIRE.decode(blob[start + n_k + n_v :], header.batch, 1, header.n_theta).reshape(
            header.batch, header.n_theta
        )
        _check_theta(theta, expect.theta_max * (1 + THETA_SLACK) if forward else MAX_GRADIENT_NORM)
    return header, z_k, z_v, theta


def _check_theta(theta: torch.Tensor, bound: float) -> None:
    if not torch.isfinite(theta).all():
        raise WireError(ErrorCode.NOT_FINITE, "θ holds NaN or infinite values")
    if float(theta.abs().max()) > bound:
        raise WireError(ErrorCode.OUT_OF_RANGE, f"|θ| {float(theta.abs().max()):.3g} exceeds {bound:.3g}")


class CPCodec:
    """Headers and expectations of one stage's CP messages, from the spec, the run and the basis."""

    def __init__(
        self,
        spec: ContextParallelSpec,
        shape,
        seq_len: int,
        max_batch: int,
        run_id: str,
        basis: CPBasis,
        stage: int = 0,
        layers: range | None = None,
    ):
        spec.validate(shape, seq_len)
        self.spec, self.shape, self.run_id, self.basis, self.stage = spec, shape, run_id, basis, stage
        self.layers = layers if layers is not None else range(shape.n_layers)
        self.chunk_len, self.max_batch = spec.chunk_len(seq_len), max_batch

    def widths(self, mode: KVCompression) -> tuple[int, int, int]:
        """Values per token of K and V, and θ values per sequence, of a message in `mode`."""
        return self.spec.message_widths(mode, kv_width(self.shape))

    def header(
        self,
        kind: Kind,
        layer: int,
        owner: int,
        src: int,
        dst: int,
        batch: int,
        mode: KVCompression,
        trip_id: str = "",
    ) -> KVHeader:
        width_k, width_v, n_theta = self.widths(mode)
        return KVHeader(
            self.run_id,
            self.basis.version,
            self.basis.sha256,
            trip_id,
            self.stage,
            layer,
            owner,
            src,
            dst,
            kind,
            self.spec.wire_dtype,
            batch,
            self.chunk_len,
            width_k,
            width_v,
            n_theta,
        )

    def expectation(self, kind: Kind, chunk: int, mode: KVCompression) -> KVExpectation:
        width_k, width_v, n_theta = self.widths(mode)
        return KVExpectation(
            self.run_id,
            self.basis.version,
            self.basis.sha256,
            self.stage,
            self.layers.start,
            self.layers.stop,
            chunk,
            self.spec.size,
            kind,
            self.spec.wire_dtype,
            self.chunk_len,
            width_k,
            width_v,
            n_theta,
            self.max_batch,
            self.spec.theta_max,
        )


def lanes_forward(lanes: list[LaneTrip], codec: CPCodec, sent: dict, trip_id: str = "") -> None:
    """Every layer of P lanes of one stage, in the swarm's order (every lane's payload, then every lane
    completes), each message through encode_kv/decode_kv; adds the bytes to sent["forward"][layer]."""
    for layer in lanes[0].order:
        mode = lanes[0].modes[layer]
        inbox: dict[int, dict] = {lane.lane: {} for lane in lanes}
        for lane in lanes:
            payload = lane.payload(layer)
            for dst in range(lane.lane + 1, len(lanes)):
                header = codec.header("forward", layer, lane.lane, lane.lane, dst, lane.batch, mode, trip_id)
                blob = encode_kv(header, *payload)
                sent["forward"][layer] += len(blob)
                inbox[dst][lane.lane] = decode_kv(blob, codec.expectation("forward", dst, mode))[1:]
        for lane in lanes:
            lane.complete(layer, inbox[lane.lane])


def lanes_backward(lanes: list[LaneTrip], codec: CPCodec, sent: dict, trip_id: str = "") -> None:
    """Every layer's backward from the top, later lanes first (their replies complete earlier lanes'
    gradients), each gradient message through encode_kv/decode_kv; adds to sent["backward"][layer]."""
    for layer in reversed(lanes[0].order):
        mode = lanes[0].modes[layer]
        inbox: dict[int, dict] = {lane.lane: {} for lane in lanes}
        for lane in reversed(lanes):
            for src, grads in lane.backward_layer(layer, inbox[lane.lane]).items():
                header = codec.header("backward", layer, src, lane.lane, src, lane.batch, mode, trip_id)
                blob = encode_kv(header, *grads)
                sent["backward"][layer] += len(blob)
                inbox[src][lane.lane] = decode_kv(blob, codec.expectation("backward", src, mode))[1:]


def wire_step(model: CPDecoder, tokens: torch.Tensor, codec: CPCodec) -> tuple[float, dict]:
    """One forward and backward of `model` as P lanes (swarm.cp_lane.LaneTrip), all K/V
    traffic encoded and decoded; adds the parameter gradients to `.grad`; returns the loss and the bytes
    sent per layer ({"forward": [...], "backward": [...]}, summed over messages)."""
    size, seq = model.spec.size, tokens.shape[1]
    n = seq // size
    sent = {"forward": [0] * len(model.layers), "backward": [0] * len(model.layers)}
    lanes = [LaneTrip(model, c, tokens[:, c * n : (c + 1) * n]) for c in range(size)]
    lanes_forward(lanes, codec, sent)
    total = sum(lane.loss(tokens[:, (c + 1) * n] if c < size - 1 else None, seq) for c, lane in enumerate(lanes))
    lanes_backward(lanes, codec, sent)
    for lane in lanes:
        lane.input_grad()
        lane.apply_grads()
    return total, sent
