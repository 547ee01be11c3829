"""The trip flavour is picked once (`peer/trip_flavour.py` `trip_flavour`), and what differs between a pipeline
and a context-parallel run is the flavour's answer, not a test of the lane count elsewhere: these check the
answers (the stages a slot keeps, the overload factor, the heartbeat, the stage a hop accepts trips from)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from types import SimpleNamespace

from builders import tiny_manifest

from peer.lane_trip import LaneHop
from peer.options import PeerOptions
from peer.refusals import RefusalLog
from peer.stats import Stats
from peer.trip import Hop
from peer.trip_flavour import LaneTrips, PipelineTrips, trip_flavour
from peer.trip_server import TripServer
from swarm.wire import ErrorCode

PIPELINE = tiny_manifest("subspace", n_layers=3, stages=3)
LANES = tiny_manifest("subspace", n_layers=3, stages=3,
                      context_parallel={"size": 2, "compression": "subspace", "wire_dtype": "fp32"})
PEER = Path(__file__).resolve().parent.parent / "peer"


def _next_hop(manifest, index: int) -> SimpleNamespace:
    """What a hop reads of its `NextHop` when it is made (no trip is run here)."""
    async def fetch() -> dict:
        return {}

    router = SimpleNamespace(ledger=SimpleNamespace(audit_rate=0.0), stages={})
    return SimpleNamespace(manifest=manifest, index=index, runtime=None, router=router, fetch=fetch,
                           tokens_per_trip=1)


def test_the_flavour_answers_what_differs_between_a_pipeline_and_lanes():
    pipeline, lanes = trip_flavour(PIPELINE, PeerOptions()), trip_flavour(LANES, PeerOptions())
    assert isinstance(pipeline, PipelineTrips) and isinstance(lanes, LaneTrips)
    assert (pipeline.overload_factor, lanes.overload_factor) == (1, 2)
    assert (pipeline.default_inflight, lanes.default_inflight) == (8, 4)  # what --max-inflight unset means
    assert pipeline.routed(1) == (list(range(3)) if PIPELINE.updates_u else [0, 2])  # around it; all when U moves
    assert lanes.routed(1) is None  # every stage: a driver picks a group in each
    assert pipeline.message_bound() == 0 < lanes.message_bound()
    stats = Stats()
    stats.kv_bytes, stats.kv_tokens = 10, 5
    assert pipeline.heartbeat(0, stats) == {}
    assert lanes.heartbeat(1, stats) == {"lane": 1, "kv_bytes": 10, "kv_tokens": 5}
    # placement picks the lane only where there are lanes: a pipeline's is pinned at 0 whatever --lane said
    assert (pipeline.pinned_lane, lanes.pinned_lane) == (0, None)
    assert trip_flavour(LANES, PeerOptions(lane=1)).pinned_lane == 1
    # a gradient sender is judged among its lane's senders only where there are lanes (peer/averaging_lanes.py)
    assert (pipeline.judges_by_lane, lanes.judges_by_lane) == (False, True)


def test_a_pipeline_stage_0_accepts_no_trips_and_a_lane_stage_0_accepts_its_drivers():
    hops = {
        "pipeline": [Hop(_next_hop(PIPELINE, i), Stats(), "[t]") for i in range(3)],
        "lanes": [LaneHop(_next_hop(LANES, i), Stats(), "[t]", lane=0, kv=None, peer_id="me") for i in range(3)],
    }
    assert [hop.upstream() for hop in hops["pipeline"]] == [None, 0, 1]
    assert [hop.upstream() for hop in hops["lanes"]] == [0, 0, 1]
    anyone = SimpleNamespace(to_base58=lambda: "anyone")

    async def admitted() -> list[ErrorCode | None]:  # an unknown sender kicks a background re-read: a loop runs
        server = TripServer(Stats(), lambda: "online", 16, RefusalLog(), lambda: "[t]")
        answers = []
        for hop in (hops["pipeline"][0], hops["lanes"][0]):
            server.hop = hop
            answers.append(server.admit_stream(anyone))
        await asyncio.sleep(0)
        return answers

    assert asyncio.run(admitted()) == [ErrorCode.WRONG_STAGE, ErrorCode.UNKNOWN_SENDER]


def test_no_module_but_the_factory_asks_whether_the_run_has_lanes():
    # a pure check of a value (`peer/lanes.py` `lane_refusal(lane, lanes)`) is not a switch; the manifest's lanes are
    switch = re.compile(r"lanes\s*>\s*1|\.lanes\s*[=!]=\s*1\b|isinstance\([^)]*LaneHop|\bkv is (not )?None")
    found = [f"{path.name}:{n}" for path in sorted(PEER.glob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if switch.search(line)]
    assert found == [f"trip_flavour.py:{_factory_line()}"], found


def _factory_line() -> int:
    lines = (PEER / "trip_flavour.py").read_text().splitlines()
    return next(n for n, line in enumerate(lines, 1) if "return LaneTrips(" in line)
