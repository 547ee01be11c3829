"""Wire dtypes as objects: how `fp32`, `bf16`, `fp16` and `int8` put a payload's values on the wire.

A manifest names its wire dtype (`wire_dtype`, a string in the canonical JSON, so run ids do not
depend on this module); what sizes, encodes or decodes a payload asks the `WireDType` that
`wire_dtype(name)` returns instead of testing the name, so a new dtype is one entry here. A float
dtype is a cast: values travel rounded to it. `int8` is per-token absmax quantisation (SWARM's dense
baseline): each token's row travels as int8 values, and one float32 scale per token follows all rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from swarm.wire_error import ErrorCode, WireError

# what a manifest may name (pydantic checks the field against it; tests/test_wire_dtype.py keeps it
# equal to the keys of WIRE_DTYPES)
WireDTypeName = Literal["fp32", "bf16", "fp16", "int8"]


@dataclass(frozen=True)
class WireDType:
    """A cast: every value travels as `torch_dtype`, little-endian, and nothing else per token."""

    name: str
    torch_dtype: torch.dtype
    scale_bytes: int = 0  # bytes per token besides its values

    @property
    def itemsize(self) -> int:
        """Bytes per value."""
        return self.torch_dtype.itemsize

    @property
    def quantized(self) -> bool:
        """Whether values need their per-token scale to be read back, so a plain cast cannot round to it."""
        return self.scale_bytes > 0

    def payload_bytes(self, cells: int, width: int) -> int:
        """Bytes of a payload of `cells` tokens of `width` values each."""
        return cells * (width * self.itemsize + self.scale_bytes)

    def encode(self, payload: torch.Tensor) -> bytes:
        # viewed as bytes because numpy has no bfloat16
        return payload.detach().to(self.torch_dtype).contiguous().cpu().view(torch.uint8).numpy().tobytes()

    def decode(self, raw: bytes, batch: int, seq: int, width: int) -> torch.Tensor:
        """The (batch, seq, width) tensor in `raw`; `WireError` (malformed) if its length does not match."""
        self._check_length(raw, batch * seq, width)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(self.torch_dtype).reshape(batch, seq, width)

    def _check_length(self, raw: bytes, cells: int, width: int) -> None:
        expected = self.payload_bytes(cells, width)
        if len(raw) != expected:
            raise WireError(ErrorCode.MALFORMED, f"{self.name} payload has {len(raw)} bytes, expected {expected}")


@dataclass(frozen=True)
class AbsmaxInt8(WireDType):
    """Per-token absmax 8-bit values: int8 rows, then every token's float32 scale (> 0, finite)."""

    def encode(self, payload: torch.Tensor) -> bytes:
        values, scales = quantize_int8(payload)
        return values.contiguous().cpu().numpy().tobytes() + scales.contiguous().cpu().numpy().tobytes()

    def decode(self, raw: bytes, batch: int, seq: int, width: int) -> torch.Tensor:
        """Dequantised float32 values; `WireError` for a wrong length (malformed) or a scale that is not
        finite and positive (not_finite), which no honest sender writes."""
        cells = batch * seq
        self._check_length(raw, cells, width)
        values = torch.frombuffer(bytearray(raw), dtype=torch.int8)[: cells * width].reshape(batch, seq, width)
        # the scales start at byte cells*width, which need not be 4-aligned: view a fresh copy
        scales = torch.frombuffer(bytearray(raw[cells * width :]), dtype=torch.float32).reshape(batch, seq, 1)
        if not (torch.isfinite(scales).all() and (scales > 0).all()):
            raise WireError(ErrorCode.NOT_FINITE, "int8 scales must be finite and positive")
        return values.float() * scales


def quantize_int8(payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token absmax 8-bit quantisation (SWARM's dense baseline): int8 values and float32 scales > 0."""
    data = payload.detach().float()
    absmax = data.abs().amax(dim=-1, keepdim=True)
    # a row whose largest value is below ~1.8e-43 would get scale 0 (refused by the receiver): clamp it
    smallest = torch.finfo(torch.float32).tiny
    scale = torch.where(absmax > 0, (absmax / 127.0).clamp(min=smallest), torch.ones_like(absmax))
    scale = torch.where(torch.isfinite(absmax), scale, absmax)  # NaN/inf stay visible: the receiver refuses them
    values = torch.round(data / scale).clamp_(-127, 127).to(torch.int8)
    return values, scale.squeeze(-1)


WIRE_DTYPES: dict[str, WireDType] = {
    dtype.name: dtype
    for dtype in (
        WireDType("fp32", torch.float32),
        WireDType("bf16", torch.bfloat16),
        WireDType("fp16", torch.float16),
        AbsmaxInt8("int8", torch.int8, scale_bytes=4),
    )
}
# the dtypes a plain cast rounds to: what context parallelism's K/V messages may use (they carry no scale)
CAST_DTYPES = tuple(name for name, dtype in WIRE_DTYPES.items() if not dtype.quantized)


def wire_dtype(name: str) -> WireDType:
    """The wire dtype a manifest names; ValueError naming the known ones for any other name."""
    try:
        return WIRE_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown wire dtype {name!r}; choose one of {tuple(WIRE_DTYPES)}") from None
