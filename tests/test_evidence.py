"""When findings against a peer add up to an accusation (swarm/evidence.py)."""

import math

import pytest

from swarm.evidence import ALIGNMENT, AveragingBans, Evidence, EvidenceRule
from swarm.presets import _SHAPES
from swarm.robust import Finding

FAR = Finding("a part 9.0 clip radii from the robust average", 9.0 / 8.0)


def test_a_finding_now_and_then_accuses_nobody():
    """An honest peer past a bound on one part in a round, in a few rounds: below the share."""
    evidence = Evidence(EvidenceRule(rounds=8, flags=3, share=0.15))
    for round_key in range(40):
        for part in range(8):
            finding = FAR if part == 0 and round_key % 3 == 0 else None
            assert evidence.judge("honest", round_key, finding) is None


def test_findings_on_a_share_of_a_peers_parts_accuse_it_and_spend_the_evidence():
    evidence = Evidence(EvidenceRule(rounds=8, flags=3, share=0.15))
    whys = [evidence.judge("hostile", 0, FAR if part % 2 else None) for part in range(6)]
    assert whys[:5] == [None] * 5
    assert whys[5] == f"3 of its last 6 parts past their bounds in 1 rounds (last: {FAR.why})"
    assert evidence.judge("hostile", 0, FAR) is None  # after an accusation it starts from nothing


def test_the_evidence_is_a_window_of_rounds():
    """Three findings far apart in time (more than `rounds` rounds with the peer) never meet."""
    evidence = Evidence(EvidenceRule(rounds=2, flags=3, share=0.0))
    for round_key in range(12):
        assert evidence.judge("p", round_key, FAR if round_key % 3 == 0 else None) is None
    evidence.judge("q", 0, FAR)
    evidence.judge("q", 1, FAR)
    assert evidence.judge("q", 1, FAR) is not None


def test_what_no_honest_peer_sends_accuses_at_once():
    evidence = Evidence(EvidenceRule(flagrant=100.0))
    assert evidence.judge("p", 0, Finding("a part with NaN or inf", math.inf)) == "a part with NaN or inf"
    assert evidence.judge("q", 0, Finding("1000 × the bound", 1000.0)) == "1000 × the bound"
    assert evidence.judge("r", 0, Finding("20 × the bound", 20.0)) is None


def test_a_part_weighs_by_its_values_so_findings_on_vectors_alone_accuse_nobody():
    """Findings on every 256-value part of a peer (a norm gain's gradient) add up to less than three full parts in 8
    rounds; the same findings counted as whole parts accuse it in its first round. A part of `full_values` or more
    counts as one, and a flagrant finding accuses at once whatever its size."""
    rule = EvidenceRule(rounds=8, flags=3, share=0.15, full_values=4096)  # a 256-value part weighs 1/16
    by_values, by_parts = Evidence(rule), Evidence(rule)
    assert all(by_values.judge("vectors", round_key, FAR, 256) is None for round_key in range(40) for _ in range(4))
    assert [by_parts.judge("vectors", 0, FAR) is None for _ in range(3)] == [True, True, False]
    matrices = Evidence(rule)
    assert [matrices.judge("matrices", 0, FAR, 65536) is None for _ in range(3)] == [True, True, False]
    assert Evidence(rule).judge("bias", 0, Finding("a part with NaN or inf", math.inf), 2) is not None
    with pytest.raises(ValueError):
        EvidenceRule(full_values=0)
    mixed = Evidence(rule)  # two full findings and 16 findings on vectors make the third
    assert mixed.judge("mixed", 0, FAR, 4096) is None and mixed.judge("mixed", 0, FAR, 4096) is None
    whys = [mixed.judge("mixed", 0, FAR, 256) for _ in range(16)]
    assert whys[:15] == [None] * 15 and whys[15].startswith("3 of its last 3 parts past their bounds")


def test_the_peers_full_part_lies_between_every_presets_vectors_and_matrices():
    """`EvidenceRule.full_values`: wider than any preset's model width (its norm gains, 8B's 4,096 included), no
    wider than the smallest weight matrix of any preset (tiny's K projection)."""
    shapes = [fields["model"] for fields in _SHAPES.values()]  # the shapes alone: a preset derives 8B's T_fixed
    smallest_matrix = min(min(s.d_model * s.d_model * s.n_kv_heads // s.n_heads, s.d_model * s.d_ff) for s in shapes)
    assert max(s.d_model for s in shapes) < EvidenceRule().full_values <= smallest_matrix


def test_peers_are_judged_apart():
    evidence = Evidence(EvidenceRule(rounds=8, flags=2, share=0.0))
    assert evidence.judge("a", 0, FAR) is None
    assert evidence.judge("b", 0, FAR) is None
    assert evidence.judge("a", 1, FAR) is not None


def test_an_averaging_ban_ends_and_a_peer_accused_again_is_banned_twice_as_long():
    now = [0.0]
    bans = AveragingBans(clock=lambda: now[0])
    peer = "QmXpdBTZgZQsoUFRuBsQCboSjE4n1Lo3dCpk437pGM8F7M"
    assert bans.ban(peer, "as a sender: NaN") == AveragingBans.BAN_SECONDS
    assert peer in bans and bans.current() == {peer: "as a sender: NaN"}
    assert bans.ban(peer, "again") is None  # banned now: one ban, the first reason
    now[0] = AveragingBans.BAN_SECONDS + 1
    assert peer not in bans and bans.current() == {}
    assert bans.ban(peer, "as a reducer") == 2 * AveragingBans.BAN_SECONDS
    now[0] += 2 * AveragingBans.BAN_SECONDS - 2
    assert peer in bans
    for _ in range(10):
        now[0] += AveragingBans.MAX_BAN_SECONDS + 1
        assert bans.ban(peer, "again") <= AveragingBans.MAX_BAN_SECONDS


def test_a_reducer_is_accused_on_its_direction_in_five_of_eight_rounds_not_three():
    """`ALIGNMENT`: one judgement a round. Honest reducers pointed away in at most 3 of 8 consecutive rounds
    (benchmarks/honest_accusations.py); a negating one does in nearly every round."""
    away = Finding("averages that hold -0.25 of this peer's parts (floor 0.1)", 1.0)
    evidence = Evidence(ALIGNMENT)
    for round_key in range(40):  # 3 of every 8 rounds, bunched
        assert evidence.judge("honest", round_key, away if round_key % 8 < 3 else None) is None
    whys = [evidence.judge("negating", round_key, away) for round_key in range(5)]
    assert whys[:4] == [None] * 4
    assert whys[4].startswith("5 of its last 5 rounds past their bounds in 5 rounds (last: averages that hold")
