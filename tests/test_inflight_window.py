"""How many trips a driver keeps in flight (issue 27): `--max-inflight`, bounded by the memory its trips' activations
take at stage 0 (`peer/driver.py` `inflight_window`), which the stage measures with its throughput."""

from __future__ import annotations

import torch
from builders import tiny_manifest

from peer.driver import MEMORY_SHARE, available_memory, inflight_window
from swarm.model import build_stages

MB = 2**20


def test_the_window_is_what_was_asked_while_memory_holds_it():
    assert inflight_window(8, 50 * MB, 16 * 1024 * MB) == 8
    assert inflight_window(8, 0, 1) == 8  # nothing measured: nothing to bound by
    assert inflight_window(8, 50 * MB, None) == 8  # memory unknown


def test_the_window_shrinks_to_the_share_of_free_memory_and_never_below_one():
    # a quarter of 1 GiB holds 5 trips of 50 MiB
    assert MEMORY_SHARE == 0.25 and inflight_window(8, 50 * MB, 1024 * MB) == 5
    assert inflight_window(8, 50 * MB, 1024 * MB, share=0.5) == 8
    assert inflight_window(8, 50 * MB, 100 * MB) == 1  # one trip is always allowed: a stage that fits, trains
    assert inflight_window(3, 1, 10**12) == 3


def test_free_memory_is_read_on_this_host():
    free = available_memory(torch.device("cpu"))
    assert free is not None and 0 < free


def test_a_stage_measures_what_one_trip_keeps_and_it_grows_with_the_microbatch():
    """The saved tensors of one trip's graph, parameters not counted: twice the sequences, about twice the bytes."""
    torch.manual_seed(0)
    manifest = tiny_manifest("subspace", n_layers=2, stages=2)
    for stage in build_stages(manifest):
        assert stage.trip_activation_bytes == 0
        stage.measure_throughput(2, 32, repeats=1)
        two = stage.trip_activation_bytes
        stage.measure_throughput(4, 32, repeats=1)
        four = stage.trip_activation_bytes
        # at least the layer inputs kept for backward: 2 layers x 2 x 32 positions x d_model fp32
        assert two >= 2 * 2 * 32 * manifest.model.d_model * 4
        assert 1.8 * two <= four <= 2.2 * two, (two, four)
