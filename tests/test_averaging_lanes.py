"""Which lane a gradient sender is judged in: its signed record's over what its round gathered
(peer/averaging_lanes.py)."""

from __future__ import annotations

from hivemind.p2p import PeerID

from peer.averaging_lanes import LaneCheck

PEERS = [PeerID(f"peer{i}".encode()) for i in range(4)]
IDS = [peer.to_base58() for peer in PEERS]


def test_a_record_sets_the_lane_and_a_relabelled_sender_is_not_judged_until_the_grace_is_over():
    """A hostile leader relabels peer 1 (honest, lane 0 in its record) as lane 1, and peer 2 gathers lane 1 against its
    record's 0 to dodge its lane's judging: neither is judged during the grace, then both are judged in the lane their
    records name, whatever they gather."""
    check = LaneCheck(lanes=2, grace=40.0)
    check.records = {IDS[0]: 0, IDS[1]: 0, IDS[2]: 0, IDS[3]: 1}
    gathered = {PEERS[0]: 0, PEERS[1]: 1, PEERS[2]: 1, PEERS[3]: 1}
    assert check.camps(gathered, PEERS, now=100.0) == {PEERS[0]: 0, PEERS[3]: 1}
    assert check.camps(gathered, PEERS, now=139.0) == {PEERS[0]: 0, PEERS[3]: 1}
    assert check.camps(gathered, PEERS, now=140.0) == {PEERS[0]: 0, PEERS[1]: 0, PEERS[2]: 0, PEERS[3]: 1}


def test_an_honest_lane_switch_goes_unjudged_until_its_record_follows_and_the_grace_comes_back_after_agreement():
    """Peer 0 switches from lane 0 to 1: its gathered lane runs ahead of its record for a refresh; unjudged then, in
    its new lane once the record names it. The grace is spent while it lasts: a sender that flips back and forth
    within it is judged once it is over, and gets it again only after `grace` seconds of agreement."""
    check = LaneCheck(lanes=2, grace=40.0)
    check.records = {IDS[0]: 0}
    assert check.camps({PEERS[0]: 1}, PEERS[:1], now=0.0) == {}
    check.records = {IDS[0]: 1}
    assert check.camps({PEERS[0]: 1}, PEERS[:1], now=15.0) == {PEERS[0]: 1}
    assert check.camps({PEERS[0]: 0}, PEERS[:1], now=20.0) == {}  # apart again, within the first grace
    assert check.camps({PEERS[0]: 0}, PEERS[:1], now=41.0) == {PEERS[0]: 1}  # the grace began at 0: over
    assert check.camps({PEERS[0]: 1}, PEERS[:1], now=50.0) == {PEERS[0]: 1}
    assert check.camps({PEERS[0]: 1}, PEERS[:1], now=90.0) == {PEERS[0]: 1}  # 40 s of agreement: grace restored
    assert check.camps({PEERS[0]: 0}, PEERS[:1], now=91.0) == {}


def test_a_sender_without_a_record_is_judged_in_the_lane_it_gathered_or_in_lane_zero():
    """No record (just joined, or never announced): the lane it gathered if the run has that lane, else lane 0, so
    no sender gets a camp of its own by naming a lane nobody else is in, or none."""
    check = LaneCheck(lanes=2)
    gathered = {PEERS[0]: 1, PEERS[1]: 7, PEERS[2]: -1}
    assert check.camps(gathered, PEERS, now=0.0) == {PEERS[0]: 1, PEERS[1]: 0, PEERS[2]: 0, PEERS[3]: 0}
