"""How many trips a peer holds at once (issue 27): the driver's `--max-inflight` and the trip server's cap, each
bounded by a share of the free memory at what one trip's activations take (`peer/memory.py`), which the stage
measures with its throughput."""

from __future__ import annotations

import torch
from builders import tiny_manifest

from peer import memory
from peer.memory import DRIVER_SHARE, available_memory, trips_that_fit
from peer.refusals import RefusalLog
from peer.stats import Stats
from peer.trip_server import TripServer
from swarm.model import build_stages

MB = 2**20


def test_the_window_is_what_was_asked_while_memory_holds_it():
    assert trips_that_fit(8, 50 * MB, 16 * 1024 * MB, DRIVER_SHARE) == 8
    assert trips_that_fit(8, 0, 1, DRIVER_SHARE) == 8  # nothing measured: nothing to bound by
    assert trips_that_fit(8, 50 * MB, None, DRIVER_SHARE) == 8  # memory unknown


def test_the_window_shrinks_to_the_share_of_free_memory_and_never_below_one():
    # a quarter of 1 GiB holds 5 trips of 50 MiB
    assert DRIVER_SHARE == 0.25 and trips_that_fit(8, 50 * MB, 1024 * MB, DRIVER_SHARE) == 5
    assert trips_that_fit(8, 50 * MB, 1024 * MB, 0.5) == 8
    assert trips_that_fit(8, 50 * MB, 100 * MB, DRIVER_SHARE) == 1  # one trip always: a stage that fits, trains
    assert trips_that_fit(3, 1, 10**12, DRIVER_SHARE) == 3


def test_free_memory_is_read_on_this_host_and_a_container_limit_bounds_it(tmp_path, monkeypatch):
    free = available_memory(torch.device("cpu"))
    assert free is not None and 0 < free
    (tmp_path / "memory.max").write_text(f"{64 * MB}\n")
    (tmp_path / "memory.current").write_text(f"{16 * MB}\n")
    monkeypatch.setattr(memory, "CGROUP", tmp_path)
    assert available_memory(torch.device("cpu")) == 48 * MB
    (tmp_path / "memory.max").write_text("max\n")  # no limit: the host's
    assert available_memory(torch.device("cpu")) > 48 * MB
    (tmp_path / "memory.current").write_text("garbage")
    (tmp_path / "memory.max").write_text(f"{64 * MB}\n")
    assert available_memory(torch.device("cpu")) is None  # unreadable: unknown, no bound, no crash


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


def test_the_trip_server_holds_no_more_trips_than_the_served_stage_memory_allows():
    server = TripServer(Stats(), lambda: "online", 96, RefusalLog(), lambda: "[t]")
    server.bound_by_memory(10)
    assert (server.overload_cap, server.sender_limits.total_cap, server.sender_limits.max_inflight) == (10, 10, 10)
    server.bound_by_memory(1000)  # a move to a stage of smaller trips: back to the peer's own cap, never above
    assert server.overload_cap == server.sender_limits.total_cap == 96
