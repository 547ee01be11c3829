"""What each member of an averaging group says about itself, checked (peer/group_members.py)."""

from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.utils.serializer import MSGPackSerializer

from peer.group_members import checked_members

dumps, loads = MSGPackSerializer.dumps, MSGPackSerializer.loads
LANE_0 = dumps(0)  # the user data a gradient round gathers: the sender's lane


def entry(bandwidth, mode=AveragingMode.NODE.value, user=LANE_0) -> bytes:
    return dumps([bandwidth, mode, user])


def test_entries_an_honest_averager_sends_pass_as_hivemind_reads_them():
    gathered = [entry(None), entry(12.5, user=dumps(1)), entry(0.0, AveragingMode.CLIENT.value), entry(None, 2)]
    members = checked_members(gathered, loads)
    assert members.left_out == {}
    assert members.bandwidths == (None, 12.5, 0.0, None)
    assert members.modes == (AveragingMode.NODE, AveragingMode.NODE, AveragingMode.CLIENT, AveragingMode.AUX)
    assert members.user_data == (0, 1, 0, 0)
    assert members.split_bandwidths == [None, None, 0.0, None]  # a client reduces nothing, the rest equal shares
    assert members.runner_modes((100, 100, 0, 100)) is None  # hivemind derives them itself, as before
    assert members.gathered("abcd") == dict(zip("abcd", (0, 1, 0, 0), strict=True))


def test_a_member_whose_entry_no_honest_averager_sends_is_left_out_with_no_share():
    garbled = [entry("x"), entry(float("nan")), entry(-1.0), entry(True), entry(None, 7), entry(None, "0"),
               entry(None, user="lane"), entry(None, user=b"\xc1"), dumps([None, 0]), b"\xc1", "not bytes",
               dumps({"bandwidth": None})]
    for bad in garbled:
        members = checked_members([entry(None), bad, entry(None), entry(None)], loads)
        assert set(members.left_out) == {1}, bad
        assert members.modes[1] is AveragingMode.AUX and members.user_data[1] is None
        fractions = load_balance_peers(1200, members.split_bandwidths)
        assert fractions == (400, 0, 400, 400)  # the others split every part among themselves
        assert members.runner_modes(fractions) == (AveragingMode.NODE, AveragingMode.AUX, AveragingMode.NODE,
                                                   AveragingMode.NODE)
        assert set(members.gathered("abcd")) == {"a", "c", "d"}
    why = checked_members([entry("x" * 500)], loads).left_out[0]
    assert why.startswith("a bandwidth of 'xxx") and len(why) < 80  # a line in a log, however long the claim


def test_a_claimed_bandwidth_changes_nobodys_share():
    """hivemind takes one member's claim for everyone's and solves a linear program on it: a claim of 1e-6 made it
    give every member an equal share, the client's too, and one below 1e-308 made it raise in every member. The
    split here is by whether a member reduces at all."""
    for claim in (1e-309, 1e-300, 1e-6, 1e-3, 1e308, 2**64 - 1):
        gathered = [entry(None), entry(claim), entry(None), entry(None, AveragingMode.CLIENT.value)]
        members = checked_members(gathered, loads)
        assert members.left_out == {}, claim
        assert load_balance_peers(1200, members.split_bandwidths) == (400, 400, 400, 0), claim
    declined = checked_members([entry(None), entry(0.0), entry(None)], loads)  # a bandwidth of 0: it does not reduce
    assert load_balance_peers(1200, declined.split_bandwidths) == (600, 0, 600)
