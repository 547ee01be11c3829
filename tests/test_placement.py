"""The stage-choice policy: empty first, weakest next, hysteresis, never empty a stage."""

import random

from peer.placement import choose_stage, should_move


def test_empty_stage_first_even_if_others_are_weak():
    loads = {0: [100.0], 1: [], 2: [1.0]}
    assert choose_stage(loads, 3, random.Random(0)) == 1


def test_missing_stage_counts_as_empty():
    assert choose_stage({0: [5.0], 1: [5.0]}, 3, random.Random(0)) == 2


def test_random_among_several_empty_stages():
    picks = {choose_stage({0: [1.0]}, 4, random.Random(seed)) for seed in range(50)}
    assert picks == {1, 2, 3}


def test_weakest_by_total_throughput_not_by_peer_count():
    loads = {0: [10.0, 10.0, 10.0], 1: [50.0], 2: [25.0, 20.0]}
    assert choose_stage(loads, 3, random.Random(0)) == 0


def test_never_empties_its_stage():
    loads = {0: [100.0], 1: [1.0], 2: [1.0]}
    assert should_move(loads, 3, current=0, own_throughput=100.0) is None


def test_moves_for_a_clear_gain():
    loads = {0: [50.0, 50.0], 1: [10.0]}
    assert should_move(loads, 2, current=0, own_throughput=50.0) == 1


def test_hysteresis_blocks_small_gains():
    # moving 10 from stage 0 (total 110) to stage 1 (100) raises the bottleneck from 100 to 100: no gain
    loads = {0: [100.0, 10.0], 1: [100.0]}
    assert should_move(loads, 2, current=0, own_throughput=10.0) is None
    # a gain of 10% is below the default 20% threshold
    loads = {0: [60.0, 60.0], 1: [100.0]}
    assert should_move(loads, 2, current=0, own_throughput=60.0) is None


def test_no_flapping_after_a_move():
    loads = {0: [50.0, 50.0], 1: [10.0]}
    target = should_move(loads, 2, current=0, own_throughput=50.0)
    assert target == 1
    after = {0: [50.0], 1: [10.0, 50.0]}
    assert should_move(after, 2, current=1, own_throughput=50.0) is None
    assert should_move(after, 2, current=0, own_throughput=50.0) is None
