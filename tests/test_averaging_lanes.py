"""Which lane a gradient sender is judged in: its signed record's over what its round gathered
(peer/averaging_lanes.py)."""

from __future__ import annotations

from hivemind.p2p import PeerID

from peer.averaging_lanes import LaneCheck

PEERS = [PeerID(f"peer{i}".encode()) for i in range(5)]
IDS = [peer.to_base58() for peer in PEERS]
OWN = PEERS[4]  # the judging peer: no record of its own, in the lane it sent itself
EXPIRY = 1e9  # DHT time at which the records below expire
CLOCK = 1.0  # DHT time of the reads


def check(**records: int) -> LaneCheck:
    lanes = LaneCheck(grace=40.0, episode_gap=400.0)
    lanes.merge({IDS[int(name[1:])]: (lane, EXPIRY) for name, lane in records.items()}, CLOCK)
    return lanes


def test_a_sender_is_judged_in_its_records_lane_and_one_out_of_order_only_after_the_grace():
    """A hostile leader relabels peer 1 (honest, lane 0 in its record) as lane 1, and peer 2 gathers lane 1 against its
    record's 0 to dodge its lane's judging: neither is judged during the grace, then both are judged in the lane their
    records name, whatever they gather. This peer is in the lane it sent, whatever the leader relabelled it as."""
    lanes = check(p0=0, p1=0, p2=0, p3=1)
    gathered = {PEERS[0]: 0, PEERS[1]: 1, PEERS[2]: 1, PEERS[3]: 1, OWN: 0}
    in_order = {PEERS[0]: 0, PEERS[3]: 1, OWN: 1}
    assert lanes.camps(gathered, PEERS, OWN, 1, now=100.0) == in_order
    assert lanes.camps(gathered, PEERS, OWN, 1, now=139.0) == in_order
    assert lanes.camps(gathered, PEERS, OWN, 1, now=140.0) == in_order | {PEERS[1]: 0, PEERS[2]: 0}


def test_an_honest_switch_gets_a_grace_each_time_a_flipping_sender_at_most_one_an_episode():
    """Peer 0 switches from lane 0 to 1 and its record follows 15 s later: unjudged until then. Switching back 1,000 s
    later it gets a new grace, however seldom this peer met it in between. A sender that keeps flipping out of order
    stays in one episode, whose grace is spent after 40 s: judged in its record's lane from then on, until it has
    not been out of order for the episode gap."""
    lanes = check(p0=0)
    assert lanes.camps({PEERS[0]: 1}, PEERS[:1], OWN, 0, now=0.0) == {}
    lanes.merge({IDS[0]: (1, EXPIRY + 10)}, CLOCK)  # its new record: announced later, it expires later
    assert lanes.camps({PEERS[0]: 1}, PEERS[:1], OWN, 0, now=15.0) == {PEERS[0]: 1}
    assert lanes.camps({PEERS[0]: 0}, PEERS[:1], OWN, 0, now=1000.0) == {}  # a new episode: a new grace
    assert lanes.camps({PEERS[0]: 1}, PEERS[:1], OWN, 0, now=1020.0) == {PEERS[0]: 1}
    assert lanes.camps({PEERS[0]: 0}, PEERS[:1], OWN, 0, now=1030.0) == {}  # the same episode, within its grace
    assert lanes.camps({PEERS[0]: 0}, PEERS[:1], OWN, 0, now=1040.0) == {PEERS[0]: 1}  # spent: its record's lane
    assert lanes.camps({PEERS[0]: 1}, PEERS[:1], OWN, 0, now=1100.0) == {PEERS[0]: 1}
    assert lanes.camps({PEERS[0]: 0}, PEERS[:1], OWN, 0, now=1300.0) == {PEERS[0]: 1}  # 260 s in order: same episode
    assert lanes.camps({PEERS[0]: 0}, PEERS[:1], OWN, 0, now=1701.0) == {}  # 401 s since it was last out of order


def test_a_sender_without_a_record_is_judged_after_the_grace_in_the_rounds_largest_lane():
    """No record: just joined (its record follows within the grace) or never announced. Unjudged for the grace, then
    in the lane of most senders in order (the lower of two tied), whatever it gathered: naming a lane nobody else is
    in buys it nothing, and the leader's order of the group picks nothing either."""
    lanes = check(p0=0, p1=0, p2=1)
    gathered = {PEERS[0]: 0, PEERS[1]: 0, PEERS[2]: 1, PEERS[3]: 1}
    assert PEERS[3] not in lanes.camps(gathered, PEERS[:4], OWN, 1, now=0.0)
    assert lanes.camps(gathered, PEERS[:4], OWN, 1, now=40.0)[PEERS[3]] == 0
    assert lanes.camps(gathered | {PEERS[3]: 7}, PEERS[:4], OWN, 1, now=50.0)[PEERS[3]] == 0
    tied = [PEERS[2], PEERS[3], PEERS[0]]  # lanes 1 and 0 with one sender in order each, lane 1's listed first
    assert lanes.camps(gathered, tied, OWN, 1, now=60.0)[PEERS[3]] == 0


def test_a_record_a_read_missed_is_kept_until_it_expires():
    """A DHT read may miss a record until its peer announces again: the lane stays known (a peer judged in the round's
    largest lane instead of its own would be judged against the other lane's gradients), until the record's own
    expiry, after which the sender has no record."""
    lanes = check(p0=0, p1=0, p2=0, p3=1)
    gathered = {PEERS[0]: 0, PEERS[1]: 0, PEERS[2]: 0, PEERS[3]: 1}
    lanes.merge({IDS[0]: (0, EXPIRY), IDS[1]: (0, EXPIRY), IDS[2]: (0, EXPIRY)}, CLOCK)  # peer 3's record missed
    assert lanes.camps(gathered, PEERS[:4], OWN, None, now=0.0)[PEERS[3]] == 1
    lanes.merge({IDS[3]: (0, EXPIRY - 1)}, CLOCK)  # an older record does not replace a newer one
    assert lanes.camps(gathered, PEERS[:4], OWN, None, now=1.0)[PEERS[3]] == 1
    lanes.forget_expired(EXPIRY)  # every record expired: all out of order, unjudged for the grace
    assert lanes.camps(gathered, PEERS[:4], OWN, None, now=2.0) == {}
