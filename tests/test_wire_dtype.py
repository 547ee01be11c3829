"""Wire dtypes and subspace drivers as objects (issue 25): each dtype's byte count, round trip and refusals,
the lookups that refuse unknown names, and no module testing either name outside its one definition."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

import pytest
import torch
from builders import tiny_manifest

from swarm.context_parallel import ContextParallelSpec
from swarm.manifest import ManifestError
from swarm.subspace_update import DRIVERS, SubspaceDriverName, subspace_driver
from swarm.wire_dtype import CAST_DTYPES, WIRE_DTYPES, WireDTypeName, quantize_int8, wire_dtype
from swarm.wire_error import ErrorCode, WireError

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [(1, 2, 1), (2, 3, 5), (3, 7, 64)]
# bytes per value and per token besides the values, as the wire format defines them
LAYOUT = {"fp32": (4, 0), "bf16": (2, 0), "fp16": (2, 0), "int8": (1, 4)}


def payload(shape: tuple[int, int, int], seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3


def test_names_a_manifest_may_take_are_the_known_dtypes_and_drivers():
    assert set(get_args(WireDTypeName)) == set(WIRE_DTYPES) == set(LAYOUT)
    assert set(get_args(SubspaceDriverName)) == set(DRIVERS) == {"gradient", "energy"}
    assert all(WIRE_DTYPES[name].name == name for name in WIRE_DTYPES)


def test_unknown_names_are_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown wire dtype 'int4'.*'fp32', 'bf16', 'fp16', 'int8'"):
        wire_dtype("int4")
    with pytest.raises(ValueError, match=r"unknown subspace driver 'sideways'.*'gradient', 'energy'"):
        subspace_driver("sideways")
    with pytest.raises(ManifestError, match="wire_dtype"):
        tiny_manifest(wire_dtype="int4")
    with pytest.raises(ManifestError, match="subspace_driver"):
        tiny_manifest(subspace_driver="sideways")


@pytest.mark.parametrize("name", list(LAYOUT))
def test_manifest_hands_out_the_named_objects_and_keeps_the_string(name):
    m = tiny_manifest("boundary", wire_dtype=name, subspace_driver="energy")
    assert m.wire is wire_dtype(name) and m.u_driver is subspace_driver("energy")
    assert f'"wire_dtype":"{name}"' in m.canonical_json()  # the run id hashes the name, not the object
    itemsize, scale = LAYOUT[name]
    assert m.dense_bytes_per_token() == 64 * itemsize + scale
    assert m.compressed_bytes_per_token() == 4 * itemsize + scale + 1


@pytest.mark.parametrize("name", list(LAYOUT))
@pytest.mark.parametrize("shape", SHAPES)
def test_encoded_bytes_are_what_payload_bytes_counts(name, shape):
    dtype = wire_dtype(name)
    itemsize, scale = LAYOUT[name]
    cells, width = shape[0] * shape[1], shape[2]
    assert (dtype.itemsize, dtype.scale_bytes, dtype.quantized) == (itemsize, scale, scale > 0)
    assert dtype.payload_bytes(cells, width) == cells * (width * itemsize + scale)
    assert len(dtype.encode(payload(shape))) == dtype.payload_bytes(cells, width)


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_casts_round_trip_to_the_cast_values(name, shape):
    dtype = wire_dtype(name)
    x = payload(shape)
    back = dtype.decode(dtype.encode(x), *shape)
    assert back.dtype == dtype.torch_dtype and back.shape == shape
    assert torch.equal(back, x.to(dtype.torch_dtype))
    # little-endian values in order, as the format has always been written (numpy has no bfloat16)
    assert (
        dtype.encode(x)
        == x.to(dtype.torch_dtype).view(torch.int16 if dtype.itemsize == 2 else torch.int32).numpy().tobytes()
    )


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_round_trips_within_half_a_step_per_token(shape):
    int8 = wire_dtype("int8")
    x = payload(shape, seed=1)
    raw = int8.encode(x)
    back = int8.decode(raw, *shape)
    assert back.dtype == torch.float32 and back.shape == shape
    step = x.abs().amax(dim=-1, keepdim=True) / 127
    assert ((back - x).abs() <= step / 2 + 1e-6).all()
    values, scales = quantize_int8(x)  # the layout: every row's int8 values, then every token's float32 scale
    assert raw == values.numpy().tobytes() + scales.numpy().tobytes()
    assert torch.equal(back, values.float() * scales.unsqueeze(-1))


def test_int8_keeps_zero_rows_and_tiny_rows_decodable():
    x = torch.zeros(1, 2, 4)
    x[0, 1, 0] = 1e-44  # its absmax/127 underflows to 0: the scale is clamped to the smallest normal
    int8 = wire_dtype("int8")
    back = int8.decode(int8.encode(x), 1, 2, 4)
    assert torch.equal(back[0, 0], torch.zeros(4)) and torch.isfinite(back).all()


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -1.0])
def test_int8_scales_that_are_not_finite_and_positive_are_refused(scale):
    int8 = wire_dtype("int8")
    raw = bytearray(int8.encode(payload((1, 2, 3))))
    raw[-4:] = torch.tensor([scale], dtype=torch.float32).numpy().tobytes()
    with pytest.raises(WireError) as refused:
        int8.decode(bytes(raw), 1, 2, 3)
    assert refused.value.code == ErrorCode.NOT_FINITE
    assert refused.value.message == "int8 scales must be finite and positive"


@pytest.mark.parametrize("name", list(LAYOUT))
def test_a_payload_of_the_wrong_length_is_malformed(name):
    dtype = wire_dtype(name)
    raw = dtype.encode(payload((2, 3, 4)))
    for wrong in (raw[:-1], raw + b"\0"):
        with pytest.raises(WireError) as refused:
            dtype.decode(wrong, 2, 3, 4)
        assert refused.value.code == ErrorCode.MALFORMED
        assert refused.value.message == f"{name} payload has {len(wrong)} bytes, expected {len(raw)}"


def test_context_parallel_takes_the_casts_only():
    assert CAST_DTYPES == ("fp32", "bf16", "fp16")
    for name in CAST_DTYPES:
        assert ContextParallelSpec(size=2, wire_dtype=name).wire is wire_dtype(name)
    with pytest.raises(ValueError, match=r"context_parallel.wire_dtype must be one of \('fp32', 'bf16', 'fp16'\)"):
        ContextParallelSpec(size=2, wire_dtype="int8")


def test_drivers_answer_what_each_accumulates():
    gradient, energy = subspace_driver("gradient"), subspace_driver("energy")
    modes = {name: tiny_manifest(name).mode for name in ("subspace", "boundary", "none")}
    assert [gradient.weight_terms(m) for m in modes.values()] == [True, False, False]
    assert [gradient.boundary_terms(m) for m in modes.values()] == [False, True, False]
    assert not any(energy.weight_terms(m) or energy.boundary_terms(m) for m in modes.values())
    assert energy.receiver_energy and not gradient.receiver_energy
    d = torch.randn(5, 2).double().numpy()
    assert (gradient.direction(d) == -d).all() and (energy.direction(d) == d).all()


# a comparison or membership test against a dtype's or a driver's name
NAME_TEST = re.compile(
    r"""([!=]=|\bin)\s*\(?\s*["'](fp32|bf16|fp16|int8|gradient|energy)["']|["'](fp32|bf16|fp16|int8|gradient|energy)["']\s*[!=]="""
)


def test_no_module_tests_a_wire_dtype_or_driver_name():
    """A variant is one object: the rest of the code asks it, never `wire_dtype == "int8"`."""
    offending = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for package in ("swarm", "peer", "tracker", "launcher", "dhtio", "benchmarks")
        for path in sorted((ROOT / package).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if NAME_TEST.search(line)
    ]
    assert not offending, offending
