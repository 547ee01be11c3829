"""swarm/robust.py: the robust average of a part and the check of a reduced part, as pure functions."""

from __future__ import annotations

import math

import pytest
import torch

from swarm.robust import (
    Alignment,
    PartChanges,
    RobustRule,
    SenderDirection,
    capped_weights,
    check_reduced,
    clip_rows,
    direction_findings,
    others_mean,
    refusal,
    robust_average,
)

SHAPE = torch.Size([5000])


def honest(n: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(SHAPE, generator=generator)
    return [base + 0.1 * torch.randn(SHAPE, generator=generator) for _ in range(n)]


def test_honest_parts_average_to_their_weighted_mean_and_nobody_is_accused():
    parts, weights = honest(5), [1.0, 2.0, 1.0, 1.0, 3.0]
    aggregate = robust_average(parts, weights, SHAPE)
    capped = capped_weights(weights, RobustRule().weight_cap)  # the median weight (1.0) caps 2.0 and 3.0
    expected = sum(w * p for w, p in zip(capped, parts, strict=True)) / sum(capped)
    assert torch.allclose(aggregate.average, expected, atol=1e-5)
    assert aggregate.refused == {}
    assert aggregate.judged == dict.fromkeys(range(5))  # every part judged, none past the bound


@pytest.mark.parametrize(
    "bad, weight, why",
    [
        (torch.full(SHAPE, float("nan")), 1.0, "NaN"),
        (torch.full(SHAPE, float("inf")), 1.0, "NaN or inf"),
        (torch.zeros(7), 1.0, "shape"),
        (torch.zeros(SHAPE), float("nan"), "weight"),
        (torch.zeros(SHAPE), -1.0, "weight"),
    ],
)
def test_unusable_contributions_are_refused_and_change_nothing(bad, weight, why):
    parts = honest(3)
    aggregate = robust_average([*parts, bad], [1.0, 1.0, 1.0, weight], SHAPE)
    assert why in aggregate.refused[3]
    assert 3 not in aggregate.judged
    assert torch.allclose(aggregate.average, torch.stack(parts).mean(0), atol=1e-5)


@pytest.mark.parametrize("attack", ["huge", "sign flip", "huge weight"])
def test_one_hostile_part_of_four_moves_the_average_by_at_most_about_a_clip_radius(attack):
    parts = honest(3)
    mean = torch.stack(parts).mean(0)
    hostile = {"huge": 1e6 * torch.ones(SHAPE), "sign flip": -10 * parts[0], "huge weight": 50 * torch.ones(SHAPE)}
    weight = 1e9 if attack == "huge weight" else 1.0
    aggregate = robust_average([*parts, hostile[attack]], [1.0, 1.0, 1.0, weight], SHAPE)
    assert float((aggregate.average - mean).norm()) <= aggregate.tau
    assert "clip radii" in aggregate.judged[3].why and aggregate.judged[3].excess > 1
    assert [aggregate.judged[i] for i in range(3)] == [None] * 3
    plain = (sum(parts) + weight * hostile[attack]) / (3 + weight)
    assert float((plain - mean).norm()) > 10 * aggregate.tau  # what a plain mean would have let through


def test_parts_most_peers_send_as_zeros_accuse_nobody_and_stay_clipped():
    """An embedding's rows for tokens one replica saw: the others' parts are exactly zero, so the clip radius is a
    floor, and neither an honest nonzero part nor a hostile huge one there is accused; both are clipped to it."""
    zeros = [torch.zeros(SHAPE) for _ in range(3)]
    rare = torch.zeros(SHAPE)
    rare[:40] = 1e-3 * torch.randn(40)
    for odd in (rare, 1e6 * torch.ones(SHAPE)):
        aggregate = robust_average([*zeros, odd], [1.0] * 4, SHAPE)
        assert aggregate.refused == {} and aggregate.judged == {}
        assert float(aggregate.average.norm()) <= aggregate.tau <= 1e-9
    two = robust_average([zeros[0], zeros[1], rare, 0.5 * rare], [1.0] * 4, SHAPE)  # two saw it, two did not
    assert two.refused == {} and not any(two.judged.values())


def test_two_lanes_of_two_whose_gradients_differ_accuse_neither_camp():
    """A stage's two lanes in one group of four: the last lane's θ head gets (nearly) no gradient, the other lane's
    parts are apart from it and from each other. The clip radius from the nearer camp's spread (the lower median
    distance) put the other camp hundreds of radii out on real peers; the upper median does not, and a hostile
    part among three honest ones is still judged from an honest distance (the test above)."""
    generator = torch.Generator().manual_seed(1)
    last_lane = [1e-4 * torch.randn(SHAPE, generator=generator) for _ in range(2)]
    first_lane = [torch.randn(SHAPE, generator=generator).abs() for _ in range(2)]
    aggregate = robust_average([*last_lane, *first_lane], [1.0] * 4, SHAPE)
    assert aggregate.refused == {} and set(aggregate.judged) == {0, 1, 2, 3}
    assert not any(aggregate.judged.values())
    assert direction_findings(aggregate.directions, RobustRule()) == dict.fromkeys(range(4))


def test_with_lanes_a_sender_is_judged_only_among_the_senders_of_its_own_lane():
    """Three replicas of lane 0 and one of lane 1, whose gradient is another chunk's (here: another base). Judged
    together the lane-1 part is far from the lane-0 camp's radius (an honest sender accused on real peers, a group of
    three with one peer of the other lane); judged by lane it has no camp of three and is only clipped into the
    average, and a hostile lane-0 sender is still found among its lane's."""
    lane0, lane1 = honest(3), [3 * part for part in honest(1, seed=5)]
    parts = [*lane0, *lane1]
    together = robust_average(parts, [1.0] * 4, SHAPE)
    assert together.judged[3] is not None and not any(together.judged[i] for i in range(3))
    by_lane = robust_average(parts, [1.0] * 4, SHAPE, camps=[0, 0, 0, 1])
    assert set(by_lane.judged) == {0, 1, 2} and not any(by_lane.judged.values()) and 3 not in by_lane.directions
    assert torch.equal(by_lane.average, together.average)  # the average is over every sender either way
    hostile = robust_average([*parts, 1e3 * torch.ones(SHAPE)], [1.0] * 5, SHAPE, camps=[0, 0, 0, 1, 0])
    assert set(hostile.judged) == {0, 1, 2, 4} and hostile.judged[4].excess > 1
    assert not any(hostile.judged[i] for i in (0, 1, 2))
    # two replicas a lane: nobody is judged
    assert robust_average(parts, [1.0] * 4, SHAPE, camps=[0, 0, 1, 1]).judged == {}


def test_all_zero_parts_do_not_vote_on_where_honest_parts_lie():
    """The θ head on a stage's last lane gets no gradient: its senders' parts are exactly zero. Two of them and a
    first-lane part near zero put the other first-lane part millions of clip radii out here (on real peers a θ head
    part was 764,124 out; why the one part was near zero there is not known); zeros do not vote, so two voters judge
    nobody, and three honest voters still find a hostile fourth."""
    generator = torch.Generator().manual_seed(2)
    zeros = [torch.zeros(SHAPE) for _ in range(2)]
    first_lane = [1e-7 * torch.randn(SHAPE, generator=generator), torch.randn(SHAPE, generator=generator)]
    aggregate = robust_average([*zeros, *first_lane], [1.0] * 4, SHAPE)
    assert aggregate.judged == {} and aggregate.directions == {}
    parts = honest(3)
    aggregate = robust_average([zeros[0], *parts, 1e3 * torch.ones(SHAPE)], [1.0] * 5, SHAPE)
    assert set(aggregate.judged) == {1, 2, 3, 4} and aggregate.judged[4].excess > 1
    assert not any(aggregate.judged[i] for i in (1, 2, 3))


def test_voters_are_judged_by_their_own_centre_when_zeros_are_the_majority():
    """Four last-lane zeros and three honest first-lane parts: CenteredClip over all seven sits at the zeros with a
    radius of nearly nothing (the honest parts ~1e13 radii out), so the voters are judged against their own centre
    and radius, and none is far."""
    parts = [*honest(3), *(torch.zeros(SHAPE) for _ in range(4))]
    aggregate = robust_average(parts, [1.0] * 7, SHAPE)
    assert set(aggregate.judged) == {0, 1, 2} and not any(aggregate.judged.values()), aggregate.judged


def test_a_part_of_a_handful_of_values_is_clipped_but_not_judged():
    """hivemind cuts a 2-value bias into a part of its own: four distances of two values are noise, not evidence."""
    small = torch.Size([2])
    parts = [torch.ones(small) + 0.01 * k for k in range(3)] + [torch.tensor([1e6, -1e6])]
    aggregate = robust_average(parts, [1.0] * 4, small)
    assert aggregate.judged == {} and aggregate.directions == {}
    assert float((aggregate.average - torch.ones(small)).norm()) <= aggregate.tau + 0.02


def test_no_usable_contribution_gives_no_average():
    assert robust_average([torch.full(SHAPE, float("nan"))], [1.0], SHAPE) is None


def test_weights_are_capped_at_the_median():
    assert capped_weights([1.0, 1.0, 4.0, 1e9], 1.0) == [1.0, 1.0, 2.5, 2.5]
    assert capped_weights([0.0, 0.0], 1.0) == [0.0, 0.0]
    assert refusal(torch.zeros(SHAPE), math.inf, SHAPE) is not None


def test_a_reduced_part_is_checked_against_the_honest_change():
    rule = RobustRule()
    own = torch.ones(SHAPE)
    honest_change = 0.05
    assert check_reduced(own, 0.04 * torch.ones(SHAPE), honest_change, rule) is None
    assert "moves this peer's part" in check_reduced(own, 1000 * torch.ones(SHAPE), honest_change, rule).why
    assert "NaN" in check_reduced(own, torch.full(SHAPE, float("nan")), honest_change, rule).why
    assert "shape" in check_reduced(own, torch.zeros(3), honest_change, rule).why
    # parts that already agree (parameters after a round): the floor keeps the bound from reaching zero
    assert check_reduced(own, 0.005 * torch.ones(SHAPE), 0.0, rule) is None


def test_a_part_is_judged_by_its_own_honest_change_when_this_peer_reduced_it_before():
    """A slice that honest averages move far (this peer saw few of an embedding's rows that others saw) passes
    once this peer has measured such a change there itself; other parts keep this round's reference."""
    rule = RobustRule(reduced_memory=2)
    changes = PartChanges(rule.reduced_memory)
    own, far = torch.ones(SHAPE), 3.0 * torch.ones(SHAPE)  # moves the part by 3 of its norm
    assert changes.reference(("table", 0)) is None
    assert "moves this peer's part" in check_reduced(own, far, 0.05, rule, changes.reference(("table", 0))).why
    changes.record(("table", 0), 2.5)
    changes.record(("table", 0), float("nan"))  # never remembered
    assert changes.reference(("table", 0)) == 2.5
    assert check_reduced(own, far, 0.05, rule, changes.reference(("table", 0))) is None
    assert "moves this peer's part" in check_reduced(own, 1000 * torch.ones(SHAPE), 0.05, rule, 2.5).why
    assert "moves this peer's part" in check_reduced(own, far, 0.05, rule, changes.reference(("mlp", 0))).why
    changes.record(("table", 0), 0.1)
    changes.record(("table", 0), 0.2)  # the memory holds the last two reductions of the part
    assert changes.reference(("table", 0)) == 0.2



def test_an_honest_average_holds_this_peers_parts_and_a_negated_zero_or_random_one_does_not():
    """Four peers' parts that are mostly their own noise: the robust average holds a quarter of each, summed over a
    reducer's parts; its negation, zeros and a random part of the same norm hold about nothing or less."""
    rule = RobustRule()
    generator = torch.Generator().manual_seed(1)
    rounds = [[torch.randn(SHAPE, generator=generator) for _ in range(4)] for _ in range(3)]  # three parts, 4 peers
    verdicts: dict[str, Alignment] = {name: Alignment() for name in ("honest", "negated", "zeros", "random")}
    for parts in rounds:
        average = robust_average(parts, [1.0] * 4, SHAPE, rule).average
        noise = torch.randn(SHAPE, generator=generator)
        verdicts["honest"].add(parts[0], average)
        verdicts["negated"].add(parts[0], -average)
        verdicts["zeros"].add(parts[0], torch.zeros(SHAPE))
        verdicts["random"].add(parts[0], noise * average.norm() / noise.norm())
    assert verdicts["honest"].finding(rule) is None and verdicts["honest"].dot / verdicts["honest"].norm_sq > 0.2
    for name in ("negated", "zeros", "random"):
        assert "hold" in verdicts[name].finding(rule).why, name
    nothing = Alignment()
    nothing.add(torch.zeros(SHAPE), torch.ones(SHAPE))  # nothing of this peer's to hold: not judged
    assert not nothing.judged and nothing.finding(rule) is None


def test_a_part_of_this_peers_that_is_nearly_zero_is_measured_against_a_typical_part():
    """An embedding's rows this peer saw none of: its part is nearly zero, and an honest average of the replicas that
    did see them moves it thousands of times its norm, which read as past any honest bound. Against a tenth of a
    typical part of its size (this peer's reductions' per-value RMS) it is a finding of a few times the bound at
    most, not a flagrant one; a huge part is still flagrant, and a part of normal size is judged as before."""
    rule = RobustRule()
    nearly_zero, rows = 1e-6 * torch.ones(SHAPE), 0.5 * torch.ones(SHAPE)
    untyped = check_reduced(nearly_zero, rows, 0.5, rule)
    assert untyped.excess > 100
    typed = check_reduced(nearly_zero, rows, 0.5, rule, typical_rms=1.0)
    assert typed is not None and typed.excess < 2
    assert check_reduced(nearly_zero, 1e4 * torch.ones(SHAPE), 0.5, rule, typical_rms=1.0).excess > 100
    own = torch.ones(SHAPE)
    assert check_reduced(own, 0.5 * own, 0.1, rule, typical_rms=1.0) is None
    far = check_reduced(own, 5 * own, 0.1, rule, typical_rms=1.0)
    assert far.excess == check_reduced(own, 5 * own, 0.1, rule).excess


def signal_in_noise(n: int, seed: int = 0, signal: float = 0.5) -> list[torch.Tensor]:
    """Parts that share a direction under noise larger than it (gradients of other microbatches)."""
    generator = torch.Generator().manual_seed(seed)
    common = torch.randn(SHAPE, generator=generator)
    return [signal * common + torch.randn(SHAPE, generator=generator) for _ in range(n)]


def test_each_part_is_judged_against_the_others_clipped_mean():
    parts = torch.stack([torch.full((4,), 1.0), torch.full((4,), 2.0), torch.full((4,), 3.0), torch.full((4,), 100.0)])
    # clipped to a distance of 2 from the centre: the first part to 2.5 - 1 in each of its four values, the last
    # to 2.5 + 1; the two in the middle are nearer (a distance of 1) and stay
    centre, tau = torch.full((4,), 2.5), 2.0
    clipped = clip_rows(parts, centre, tau)
    assert torch.allclose(clipped[:, 0], torch.tensor([1.5, 2.0, 3.0, 3.5]))
    toward = others_mean(clipped, torch.ones(4))
    assert torch.allclose(toward[0], torch.full((4,), (2.0 + 3.0 + 3.5) / 3))
    assert torch.allclose(toward[3], torch.full((4,), (1.5 + 2.0 + 3.0) / 3))  # its own pull is not in it
    weighted = others_mean(clipped[:3], torch.tensor([1.0, 1.0, 2.0]))
    assert torch.allclose(weighted[0], torch.full((4,), (2.0 + 2 * 3.0) / 3))


def test_a_sender_of_its_negated_gradient_is_the_lowest_direction_of_its_round():
    """−g lies as near the others as their own noise (no radius finds it) but points away from their average:
    the round's lowest cosine, below the floor. The honest senders' cosines stay positive, and a round of honest
    senders has no finding."""
    rule = RobustRule()
    for seed in range(5):
        parts = signal_in_noise(4, seed)
        liar = [*parts[:3], -parts[3]]
        aggregate = robust_average(liar, [1.0] * 4, SHAPE, rule)
        assert not any(aggregate.judged.values())  # inside the clip radius
        findings = direction_findings(aggregate.directions, rule)
        assert findings[3] is not None and "cosine -" in findings[3].why
        assert [findings[i] for i in range(3)] == [None] * 3
        assert all(aggregate.directions[i].cosine > 0 for i in range(3))
        honest_round = robust_average(parts, [1.0] * 4, SHAPE, rule)
        assert not any(direction_findings(honest_round.directions, rule).values())


def test_a_huge_sender_cannot_turn_honest_directions_into_findings():
    """A part against the others, as large as it likes, is clipped before it enters their reference: the honest
    senders' directions stay positive, and the lowest is its own. Even one aimed at their exact mean (which no
    sender knows before it sends) makes no honest direction a finding: it bends every honest cosine alike, so none
    stands apart as the lowest; its radius accuses it."""
    rule = RobustRule()
    parts = signal_in_noise(4, seed=1)
    aggregate = robust_average([*parts[:3], -1e4 * parts[3]], [1.0] * 4, SHAPE, rule)
    findings = direction_findings(aggregate.directions, rule)
    assert findings[3] is not None and [findings[i] for i in range(3)] == [None] * 3
    assert all(aggregate.directions[i].cosine > 0 for i in range(3))
    aimed = robust_average([*parts[:3], -1e4 * sum(parts[:3])], [1.0] * 4, SHAPE, rule)
    assert not any(direction_findings(aimed.directions, rule)[i] for i in range(3))
    assert aimed.judged[3] is not None and aimed.judged[3].excess > 100


def one_round(send, seed: int, parts: int = 10) -> tuple[dict, dict, dict]:
    """A round of `parts` parts of four senders (`signal_in_noise`), the last sending `send(own, common, part)`:
    each sender's direction as judged (`SenderDirection`), by values alone (every pull 1), and the last sender's
    cosine over its parts joined end to end."""
    rule = RobustRule()
    judged: dict[int, SenderDirection] = {i: SenderDirection() for i in range(4)}
    by_values: dict[int, SenderDirection] = {i: SenderDirection() for i in range(4)}
    joined = {"dot": 0.0, "own": 0.0, "others": 0.0}
    for p in range(parts):
        honest = signal_in_noise(4, seed * 100 + p)
        common = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed * 100 + p))  # signal_in_noise's
        sent = [*honest[:3], send(honest[3], common, p)]
        aggregate = robust_average(sent, [1.0] * 4, SHAPE, rule)
        assert not any(aggregate.judged.values())  # inside the accusation bound: no radius finds it
        for sender, direction in aggregate.directions.items():
            judged[sender].merge(direction)
        clipped = clip_rows(torch.stack(sent), aggregate.average.reshape(-1), aggregate.tau)
        toward = others_mean(clipped, torch.ones(4))
        for sender in range(4):
            by_values[sender].add(clipped[sender], toward[sender])
        joined["dot"] += float(sent[3] @ toward[3])
        joined["own"] += float(sent[3] @ sent[3])
        joined["others"] += float(toward[3] @ toward[3])
    return judged, by_values, joined


def test_a_sender_cannot_hide_negated_parts_behind_one_part_scaled_up():
    """The hostile sender sends its gradient ×8 on the first of four parts (clipped, inside the accusation bound)
    and −g on the other three. Joined end to end, the scaled part would outweigh the rest (the round's cosine
    positive); judged per part, a part counts at most by its clipped pull, and the round points away: its finding."""
    for seed in range(5):
        judged, _, joined = one_round(lambda own, common, p: 8.0 * own if p == 0 else -own, seed, parts=4)
        assert joined["dot"] / math.sqrt(joined["own"] * joined["others"]) > 0  # not below the floor
        findings = direction_findings(judged, RobustRule())
        assert findings[3] is not None and [findings[i] for i in range(3)] == [None] * 3


def test_a_sender_cannot_hide_twice_its_negated_gradient_behind_a_cleaner_one():
    """−2g on six parts of ten (twice −g's pull, still inside the clip radius) and, on the other four, a gradient
    cleaner than any honest one (as from four microbatches). By values alone each −2g part would count as −g, and
    the cleaner parts' high cosine would hide them; weighted by its pull, −2g counts twice: its finding."""
    def send(own, common, p):
        noise = torch.randn(SHAPE, generator=torch.Generator().manual_seed(7 + p))
        return -2.0 * own if p < 6 else 0.5 * common + 0.5 * noise

    for seed in range(5):
        judged, by_values, _ = one_round(send, seed)
        assert direction_findings(by_values, RobustRule())[3] is None
        findings = direction_findings(judged, RobustRule())
        assert findings[3] is not None and [findings[i] for i in range(3)] == [None] * 3


def test_directions_average_each_part_by_its_values_and_pull_and_need_three_senders():
    a, b = SenderDirection(), SenderDirection()
    a.add(torch.tensor([10.0, 0.0]), torch.tensor([1.0, 1.0]))  # cosine 1/√2 over 2 values, whatever its size
    b.add(torch.tensor([0.0, -1.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 0.0, 0.0]), 2.0)  # cosine -1, 4 values, pull 2
    b.add(torch.zeros(3), torch.ones(3))  # nothing to judge: counts for nothing
    a.merge(b)
    assert a.cosine == pytest.approx((2 / math.sqrt(2.0) - 8) / 10)
    assert SenderDirection().cosine is None  # nothing to judge
    away = SenderDirection()
    away.add(torch.ones(2), -torch.ones(2))
    assert direction_findings({0: a, 1: away}, RobustRule()) == {}  # two senders: no majority to point along
    assert robust_average(signal_in_noise(2), [1.0, 1.0], SHAPE).directions == {}


def test_a_peer_of_a_small_weight_asks_an_average_to_hold_its_share_of_its_parts():
    """An honest average holds about a peer's weight share of its own parts: a peer of weight 1 among peers of 4 (a
    share of 4/13 against an equal one) lowers the floor by that much; a larger share never raises it."""
    alignment = Alignment()
    alignment.add(torch.ones(4), torch.full((4,), 0.05))  # holds 0.05 of this peer's parts
    assert alignment.finding(RobustRule()) is not None
    assert alignment.finding(RobustRule(), weight_share=4 / 13) is None
    assert "floor 0.1)" in alignment.finding(RobustRule(), weight_share=2.0).why
