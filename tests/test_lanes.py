"""Lanes of a context-parallel stage: valid claims, capacity, placement, moves, a trip's group of peers."""

import random

from builders import TINY, stage_record

from peer.lanes import (
    EmptyLane,
    LaneGroup,
    allowed_slots,
    choose_slot,
    lane_loads,
    lane_refusal,
    move_target,
    pick_group,
    stage_capacity,
    valid_lane,
)
from peer.placement import Hysteresis, choose_stage, counts_for_placement, should_move
from peer.routing import Router
from swarm.presets import preset
from swarm.records import RECORD_TTL, PeerEntry

CP2 = preset("tiny", stages=2, context_parallel={"size": 2})
NOW = 1000.0
EAGER = Hysteresis(min_dwell=0.0, min_gain=0.2)


def live(stage: int, name: str, lane: int = 0, throughput: float = 100.0, manifest=CP2, **changes) -> PeerEntry:
    record = stage_record(stage, name, manifest, lane=lane, throughput=float(throughput), **changes)
    return PeerEntry(record=record, expiration=NOW + RECORD_TTL, owner=b"")


def loads_of(*entries: PeerEntry, manifest=CP2) -> dict:
    stages: dict[int, list[PeerEntry]] = {s: [] for s in range(manifest.num_stages)}
    for e in entries:
        stages[e.record.stage].append(e)
    return lane_loads(stages, manifest, lambda e: counts_for_placement(e, NOW, manifest.t_fixed_sha256, "me"))


def test_lanes_are_the_context_parallel_size():
    assert CP2.lanes == 2
    assert TINY.lanes == 1


def test_a_lane_must_be_below_p_and_only_lane_0_without_context_parallelism():
    assert valid_lane(live(0, "a", lane=1).record, 2)
    assert not valid_lane(live(0, "a", lane=2).record, 2)
    assert valid_lane(live(0, "a", lane=0).record, 1)
    assert not valid_lane(live(0, "a", lane=1).record, 1)


def test_lane_loads_drop_bad_lane_claims_and_list_empty_lanes():
    loads = loads_of(live(0, "a", lane=0), live(0, "liar", lane=7, throughput=1e6), live(1, "b", lane=1, throughput=5))
    assert loads == {0: {0: [100.0], 1: []}, 1: {0: [], 1: [5.0]}}
    # the placement filters still apply: a leaving peer does not count
    assert loads_of(live(0, "gone", state="leaving"))[0] == {0: [], 1: []}


def test_a_stage_serves_what_its_weakest_lane_serves():
    assert stage_capacity({0: [10.0, 30.0], 1: [25.0]}, 2) == 25.0
    assert stage_capacity({0: [10.0, 30.0]}, 2) == 0.0  # an empty lane: no trip can cross the stage


def test_a_stage_with_an_empty_lane_is_filled_first_even_if_others_are_weaker():
    loads = loads_of(live(0, "a", 0, 1000), live(1, "b0", 0, 1), live(1, "b1", 1, 1))
    assert choose_slot(loads, 2, 2, random.Random(0)) == (0, 1)


def test_the_stage_with_the_weakest_lane_then_its_weakest_lane():
    loads = loads_of(
        live(0, "a0", 0, 50), live(0, "a1", 1, 60),
        live(1, "b0", 0, 100), live(1, "b0x", 0, 100), live(1, "b1", 1, 40),
    )
    # stage 1 holds 240 tokens/s to stage 0's 110, but its lane 1 (40) bounds it
    assert choose_slot(loads, 2, 2, random.Random(0)) == (1, 1)


def test_ties_between_lanes_are_broken_at_random():
    loads = loads_of(live(0, "a0", 0), live(0, "a1", 1), live(1, "b0", 0, 1000), live(1, "b1", 1, 1000))
    assert {choose_slot(loads, 2, 2, random.Random(seed)) for seed in range(40)} == {(0, 0), (0, 1)}


def test_pinned_lane_or_stage():
    loads = loads_of(live(0, "a0", 0, 10), live(0, "a1", 1, 500), live(1, "b0", 0, 100), live(1, "b1", 1, 100))
    assert choose_slot(loads, 2, 2, random.Random(0), lane=1) == (1, 1)  # lane 1 is weakest in stage 1
    assert choose_slot(loads, 2, 2, random.Random(0), stage=1) in {(1, 0), (1, 1)}
    assert choose_slot(loads, 2, 2, random.Random(0), stage=0) == (0, 0)


def test_without_context_parallelism_placement_is_the_stage_rule():
    rng = random.Random(1)
    for trial in range(200):
        stage_loads = {s: [float(rng.choice([1, 5, 10])) for _ in range(rng.randint(0, 3))] for s in range(3)}
        as_lanes = {s: {0: v} for s, v in stage_loads.items()}
        expected_stage = choose_stage(stage_loads, 3, random.Random(trial))
        assert choose_slot(as_lanes, 3, 1, random.Random(trial)) == (expected_stage, 0)
        for current in range(3):
            stage_loads[current].append(10.0)
            as_lanes = {s: {0: v} for s, v in stage_loads.items()}
            expected = should_move(stage_loads, 3, current, 10.0, EAGER.min_gain)
            got = move_target(as_lanes, allowed_slots(3, 1), (current, 0), 10.0, EAGER)
            assert got == (None if expected is None else (expected, 0))
            stage_loads[current].pop()


def test_moves_to_an_empty_lane_of_its_own_stage():
    loads = {0: {0: [50.0, 50.0], 1: []}, 1: {0: [100.0], 1: [100.0]}}
    assert move_target(loads, allowed_slots(2, 2), (0, 0), 50.0, EAGER) == (0, 1)


def test_never_empties_its_lane_and_keeps_the_hysteresis():
    loads = {0: {0: [50.0], 1: []}, 1: {0: [100.0], 1: [100.0]}}
    assert move_target(loads, allowed_slots(2, 2), (0, 0), 50.0, EAGER) is None
    # moving 10 of 110 to a lane at 100 gains nothing; a 10% gain is below 20%
    loads = {0: {0: [100.0, 10.0], 1: [100.0]}, 1: {0: [200.0], 1: [200.0]}}
    assert move_target(loads, allowed_slots(2, 2), (0, 0), 10.0, EAGER) is None
    loads = {0: {0: [60.0, 60.0], 1: [100.0]}, 1: {0: [200.0], 1: [200.0]}}
    assert move_target(loads, allowed_slots(2, 2), (0, 0), 60.0, EAGER) is None
    # the dwell: a peer that just arrived stays
    loads = {0: {0: [50.0, 50.0], 1: []}, 1: {0: [100.0], 1: [100.0]}}
    assert move_target(loads, allowed_slots(2, 2), (0, 0), 50.0, Hysteresis(min_dwell=300), served_for=10) is None


def test_moves_across_stages_to_the_swarms_bottleneck_lane():
    loads = {0: {0: [50.0, 50.0], 1: [100.0]}, 1: {0: [100.0], 1: [10.0]}}
    assert move_target(loads, allowed_slots(2, 2), (0, 0), 50.0, EAGER) == (1, 1)
    # pinned to lane 0 it may only go to lane 0 of another stage, which does not need it
    assert move_target(loads, allowed_slots(2, 2, lane=0), (0, 0), 50.0, EAGER) is None
    # pinned to stage 0 it may only change lanes there
    assert move_target(loads, allowed_slots(2, 2, stage=0), (0, 0), 50.0, EAGER) is None


def router_of(*entries: PeerEntry) -> Router:
    router = Router(t_fixed_sha256=CP2.t_fixed_sha256, own_peer_id="me", lanes=CP2.lanes, rng=random.Random(0))
    router.update({1: list(entries)}, now=0.0)
    return router


def test_a_group_has_one_peer_per_lane_the_measured_fast_one_first():
    router = router_of(live(1, "slow0", 0), live(1, "fast0", 0), live(1, "only1", 1))
    router.observe(live(1, "slow0").record.peer_id, seconds=10.0, tokens=100)
    router.observe(live(1, "fast0").record.peer_id, seconds=0.1, tokens=100)
    group = pick_group(router, 1, 2, now=0.0)
    assert group == LaneGroup(1, (live(1, "fast0").record.peer_id, live(1, "only1").record.peer_id))


def test_an_empty_lane_is_named():
    router = router_of(live(1, "a", 0), live(1, "liar", 5), live(1, "gone", 1, state="leaving"))
    result = pick_group(router, 1, 2, now=0.0)
    assert result == EmptyLane(1, 1)
    assert str(result) == "lane 1 of stage 1 is empty"


def test_a_banned_peer_leaves_its_lane_to_another_and_taken_lanes_are_kept():
    first, second = live(1, "first", 1), live(1, "second", 1)
    router = router_of(live(1, "a", 0), first, second)
    router.ban(first.record.peer_id, now=0.0)
    group = pick_group(router, 1, 2, now=1.0, taken={0: "me"})
    assert group == LaneGroup(1, ("me", second.record.peer_id))


def test_lane_refusals():
    assert lane_refusal(0, 1) is None and lane_refusal(1, 2) is None
    assert "no context parallelism" in lane_refusal(1, 1)
    assert "0..1" in lane_refusal(2, 2)
