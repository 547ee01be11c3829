"""K/V bytes per token from the peers' heartbeats (`swarm.context_parallel.kv_bytes_per_token`): each
peer's own counters, whatever moment it wrote them."""

from swarm.context_parallel import kv_bytes_per_token


def beat(stage: int, lane: int, trips: int, bytes_per_trip: int = 1000, chunk: int = 64) -> dict:
    return {"stage": stage, "lane": lane, "kv_bytes": trips * bytes_per_trip, "kv_tokens": trips * chunk}


def test_two_lanes_give_the_bytes_of_one_trip_per_sequence_token():
    # one trip: each lane sends 1000 B for its 64-token chunk of a 128-token sequence: 2000 B / 128 tokens
    assert kv_bytes_per_token([beat(0, 0, 1), beat(0, 1, 1)], lanes=2) == 2000 / 128


def test_a_heartbeat_written_trips_earlier_does_not_cut_the_count():
    # lane 1's file is 3 trips behind lane 0's (the netsim flake: bytes against another peer's tokens gave 7/8)
    fresh = kv_bytes_per_token([beat(0, 0, 4), beat(0, 1, 4)], lanes=2)
    assert kv_bytes_per_token([beat(0, 0, 4), beat(0, 1, 1)], lanes=2) == fresh


def test_unequal_lanes_and_stages_add_up():
    beats = [beat(0, 0, 2, 600), beat(0, 1, 5, 1400), beat(1, 0, 3, 600), beat(1, 1, 1, 1400)]
    assert kv_bytes_per_token(beats, lanes=2) == 2 * (600 + 1400) / 128


def test_peers_sharing_a_slot_are_averaged_not_added():
    beats = [beat(0, 0, 1, 1000), beat(0, 0, 3, 1200), beat(0, 1, 2, 1000)]
    assert kv_bytes_per_token(beats, lanes=2) == (1100 + 1000) / 128


def test_no_answer_until_every_slot_has_finished_a_trip():
    assert kv_bytes_per_token([], lanes=2) is None
    assert kv_bytes_per_token([beat(0, 0, 1), beat(0, 1, 0)], lanes=2) is None
    # a slot's second peer that has not finished one yet does not hold the answer back
    assert kv_bytes_per_token([beat(0, 0, 1), beat(0, 1, 1), beat(0, 1, 0)], lanes=2) == 2000 / 128


def test_beats_without_a_lane_are_not_counted():
    tracker = {"stage": 0, "state": "serving", "time": 0.0}
    assert kv_bytes_per_token([tracker, beat(0, 0, 1), beat(0, 1, 1)], lanes=2) == 2000 / 128
