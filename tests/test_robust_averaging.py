"""A stage's averaging with one hostile peer of four: real hivemind averagers (own processes, one DHT), the
hostile one a plain hivemind averager sending bad parts or a reducer returning bad averages."""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import Callable

import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import (
    DEFAULT_PART_SIZE_BYTES,
    AllreduceException,
    TensorPartContainer,
    TensorPartReducer,
)
from hivemind.dht import DHT
from hivemind.p2p import PeerID
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from peer.averaging_lanes import gathered_lanes
from peer.averaging_matchmaking import pace_lookups
from peer.robust_averaging import RobustAveraging
from peer.robust_parts import CheckedPartContainer, RobustPartReducer
from peer.stage_averagers import GradientWire
from peer.stage_optimizer import AVERAGING_TIMEOUT
from swarm.evidence import Evidence
from swarm.robust import PartChanges, RobustRule

pytestmark = pytest.mark.slow

SIZE = 600_000  # float32 elements: hivemind cuts 512 kB parts, so each of the four peers reduces one or two


class RobustAverager(RobustAveraging, DecentralizedAverager):
    pass


# hivemind names its RPC handlers after the averager's class, so a peer that wants into the group uses the
# honest class's name, whatever its code does: a plain hivemind averager (sends what it likes, reduces honestly)
PlainAverager = type("RobustAverager", (DecentralizedAverager,), {})


class LyingReducer(TensorPartReducer):
    """Returns the mean plus 1000 for every part it reduces."""

    def check_current_part_finished(self):
        if self.current_part_accumulated_from == self.num_current_senders:
            self.accumulator.add_(1000.0 * self.denominator)
        super().check_current_part_finished()


class NegatingReducer(TensorPartReducer):
    """Returns the negated mean for every part it reduces: as far from each sender's part as noise-like honest
    averages are, but pointing away from it."""

    def check_current_part_finished(self):
        if self.current_part_accumulated_from == self.num_current_senders:
            self.accumulator.neg_()
        super().check_current_part_finished()


def lying_runner(reducer_cls: type[TensorPartReducer]) -> type[AllReduceRunner]:
    """hivemind's runner with `reducer_cls` reducing this peer's parts (and the robust runner's arguments unused)."""

    class LyingRunner(AllReduceRunner):
        def __init__(self, *args, rule, banned, accuse, changes, evidence, alignment_evidence, direction_evidence,
                     round_number, lanes, **kwargs):
            super().__init__(*args, **kwargs)
            honest = self.tensor_part_reducer
            honest.finished.set()
            self.tensor_part_reducer = reducer_cls(honest.part_shapes, honest.num_senders)

    return LyingRunner


LyingAverager = type("RobustAverager", (RobustAveraging, DecentralizedAverager),
                     {"runner_class": lying_runner(LyingReducer)})
NegatingAverager = type("RobustAverager", (RobustAveraging, DecentralizedAverager),
                        {"runner_class": lying_runner(NegatingReducer)})


def honest_tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(SIZE, generator=torch.Generator().manual_seed(0))
    return [base + 0.1 * torch.randn(SIZE, generator=generator)]


def independent_tensors(seed: int) -> list[torch.Tensor]:
    """Tensors with nothing in common across seeds: gradients of other microbatches, where noise dominates."""
    return [torch.randn(SIZE, generator=torch.Generator().manual_seed(seed))]


STEP_WAIT = 60 + AVERAGING_TIMEOUT + 30  # seconds the test waits for a step: matchmaking, then the all-reduce


def average_once(hostile_cls, hostile_tensors, hostile_weight: float = 1.0, rounds: int = 1, min_group_size: int = 4,
                 fresh: bool = False, wire: GradientWire = GradientWire.FP32, fourth_wire: GradientWire | None = None,
                 make_tensors: Callable[[int], list[torch.Tensor]] = honest_tensors, honest_cls=RobustAverager,
                 judges_by_lane: bool = False, gathered: list[int] | None = None,
                 record_lanes: list[int] | None = None, hostile_fails: bool = False):
    """Three robust peers and one hostile peer average `rounds` times; the honest peers' tensors after each
    round, the honest inputs' means (the first round's; with `fresh`, each round's), the hostile peer's id, what
    each honest peer banned and, for each round, which honest peers averaged in a group with the hostile one (read
    from the group each honest step returns). After the first round the
    hostile peer's step may find no group (the honest peers may have left it out): its failure is not theirs. An
    honest peer's may fail too in a later round while the honest peers' bans differ (one left the hostile peer
    out, another joined its group): that peer's result of the round is then None (its tensors are its own, not
    averaged). `fresh`: every round after the first starts from new honest tensors, as a gradient averager does
    (each round a new step's gradients). `wire`: what the peers send (`fourth_wire`: the fourth peer, if it
    differs); `make_tensors`: each peer's tensors from a seed. `honest_cls`: the honest peers' class, judging senders
    by lane with `judges_by_lane`; `gathered`: the lane each of the four gathers at every step; `record_lanes`: the
    lane each of them names in its record, as the honest peers' `StageService` would hand them over;
    `hostile_fails`: the hostile peer's own step fails in every round (its failure is not the honest peers'; it
    retries until its step's timeout, which is then 20 s from the first round on)."""
    dht = DHT(start=True)
    averagers = []
    try:
        peers = [dht] + [DHT(start=True, initial_peers=dht.get_visible_maddrs()) for _ in range(3)]
        # an all-reduce gives up after AVERAGING_TIMEOUT, as a stage's averagers do: unbounded, a peer waiting for
        # parts its group will not send (a banned one, say) waited forever
        common = dict(prefix="stage1", target_group_size=4, min_group_size=min_group_size, min_matchmaking_time=5.0,
                      request_timeout=3.0, allreduce_timeout=AVERAGING_TIMEOUT, start=True)
        inputs = [make_tensors(seed) for seed in (1, 2, 3)]
        honest_mean = torch.stack([t[0] for t in inputs]).mean(0)
        for peer, tensors in zip(peers[:3], inputs, strict=True):
            averagers.append(honest_cls(averaged_tensors=tensors, dht=peer, judges_by_lane=judges_by_lane, **common,
                                        **wire.averager_options()))
        hostile = hostile_cls(averaged_tensors=hostile_tensors, dht=peers[3], **common,
                              **(fourth_wire or wire).averager_options())
        averagers.append(hostile)
        if record_lanes is not None:
            expiry = get_dht_time() + 3600
            records = {a.peer_id.to_base58(): (lane, expiry) for a, lane in zip(averagers, record_lanes, strict=True)}
            for averager in averagers[:3]:
                averager.set_record_lanes(records)
        results, means, met_hostile = [], [honest_mean], []
        for round_ in range(rounds):
            if fresh and round_:
                new = [make_tensors(seed + 10 * round_)[0] for seed in (1, 2, 3, 4)]
                means.append(torch.stack(new[:3]).mean(0))
                for averager, tensor in zip(averagers, new, strict=True):
                    with averager.get_tensors() as tensors:
                        tensors[0].copy_(tensor)
            # after the first round a hostile peer every honest one banned is refused at matchmaking: it
            # still tries, but waiting 20 s for its step to give up made each round take that long
            banned_by_all = all(hostile.peer_id.to_base58() in a.get_banned_peers(timeout=STEP_WAIT)
                                for a in averagers[:3])
            hostile_timeout = 8 if banned_by_all else 20
            # `timeout` bounds a step's matchmaking only; each wait below bounds the whole step, so that a step
            # that never ends fails this test instead of hanging it (once matchmaking began: hivemind's
            # `step(wait=False)` itself waits, unbounded, for the averager's process to take the step up)
            controls = [a.step(weight=hostile_weight if a is hostile else 1.0, wait=False,
                               timeout=hostile_timeout if a is hostile and (round_ or hostile_fails) else 60,
                               gather=None if gathered is None else gathered[n]) for n, a in enumerate(averagers)]
            done, met = [], []
            for control in controls[:3]:
                try:
                    group = control.result(timeout=STEP_WAIT)  # what each member gathered, keyed by its id
                    done.append(True)
                    met.append(hostile.peer_id in group)
                except AllreduceException:  # a later round while the honest peers' bans differ (docstring)
                    if not round_:
                        raise
                    done.append(False)
                    met.append(False)
            met_hostile.append(met)
            # raises FutureTimeoutError only if the wait ran out; the hostile step's own failure (after the first
            # round it may be left out of every group, or be alone below min_group_size) is returned
            failure = controls[3].exception(timeout=STEP_WAIT)
            if failure is not None and not round_ and not hostile_fails:
                raise failure
            snapshot = []
            for averager, averaged in zip(averagers[:3], done, strict=True):
                with averager.get_tensors() as tensors:
                    snapshot.append(tensors[0].clone() if averaged else None)
            results.append(snapshot)
        bans = [a.get_banned_peers(timeout=STEP_WAIT) for a in averagers[:3]]
        return results, means, hostile.peer_id.to_base58(), bans, met_hostile
    finally:
        for averager in averagers:
            averager.shutdown()
        for peer in peers[1:] if "peers" in locals() else []:
            peer.shutdown()
        dht.shutdown()


def spread() -> float:
    """How far the honest peers' own tensors are from their mean (the scale honest averaging works at)."""
    inputs = torch.stack([honest_tensors(seed)[0] for seed in (1, 2, 3)])
    return float((inputs - inputs.mean(0)).norm(dim=1).mean())


def hostile_sender(send):
    """A plain hivemind averager that contributes `send(tensor)` instead of each of its tensors, every round."""

    async def run_allreduce(self, tensors, group_info, group_id=None, **kwargs):
        sent = [send(tensor) for tensor in tensors]
        await DecentralizedAverager._run_allreduce_inplace_(self, sent, group_info, group_id, **kwargs)

    return type("RobustAverager", (DecentralizedAverager,), {"_run_allreduce_inplace_": run_allreduce})


@pytest.mark.parametrize(
    "name, send, weight",
    [
        ("nan", lambda t: torch.full_like(t, float("nan")), 1.0),
        ("huge", lambda t: torch.full_like(t, 1e6), 1.0),
        ("sign-flipped", lambda t: -10 * t, 1.0),
        ("huge weight", lambda t: torch.full_like(t, 50.0), 1e9),
    ],
)
def test_one_hostile_contribution_of_four_neither_stops_nor_bends_the_average(name, send, weight):
    """Four rounds, each on a new step's tensors, the hostile peer sending its part every round: no round's result
    is bent, and every honest peer bans it (NaN and 1e6 at once; the others once their parts were far from the
    robust average on enough of them, `swarm/evidence.py`). While one honest peer has banned it and another not
    yet, they may fall into different groups and one find none that round (`average_once`). Or the others may join
    the group of the one that banned it and leave it out of every later round: they never meet it again, so only
    the first bans it (seen in 2 of 22 runs of the sign-flipped case, where one honest peer banned it as a reducer
    in round 0: its reduced part held its own flipped contribution). An honest peer that averaged with it after
    the first round and still does not ban it fails the test."""
    results, means, hostile, bans, met_hostile = average_once(
        hostile_sender(send), honest_tensors(4), weight, rounds=4, min_group_size=3, fresh=True)
    for round_results, honest_mean in zip(results, means, strict=True):
        assert any(averaged is not None for averaged in round_results), name
        for averaged in filter(lambda averaged: averaged is not None, round_results):
            assert torch.isfinite(averaged).all(), name
            if None in round_results:  # a split round: a group without every honest peer has another mean
                continue
            # a plain mean would be off by ~1/4 of the hostile part: 2.5e5 per element for "huge"; here the
            # hostile part moves the average by at most about a clip radius (the honest spread) over four
            error = float((averaged - honest_mean).norm())
            assert error < spread(), (name, error, spread())
    banners = [banned for banned in bans if banned]
    assert all(list(banned) == [hostile] for banned in banners), (name, bans)  # nobody honest
    # some honest peer bans it, and every other one never averaged with it again after the first round
    assert banners, (name, bans)
    for peer, banned in enumerate(bans):
        assert banned or not any(met[peer] for met in met_hostile[1:]), (name, peer, bans, met_hostile)
    assert all("(tensor 0, part " in banned[hostile] for banned in banners), bans  # where its part lay


def test_a_lying_reducer_is_refused_banned_and_left_out_of_the_next_group():
    """Round 1: the liar's slice is refused (each honest peer keeps its own values there). Round 2, on a new
    step's tensors: the honest peers form their group without it (three are enough here), so they reduce its
    share of the parts too and end with the same tensors; had it been let in, they would still differ on its
    slice. Nobody honest is accused."""
    tensors = honest_tensors(4)
    results, means, liar, bans, _ = average_once(LyingAverager, tensors, rounds=2, min_group_size=3, fresh=True)
    for round_results, honest_mean in zip(results, means, strict=True):
        for averaged in round_results:
            assert torch.isfinite(averaged).all()
            # the liar's slice is kept as each peer's own (not +1000): within the honest spread of the mean
            assert float((averaged - honest_mean).norm()) < 1.5 * spread()
            assert float((averaged - honest_mean).abs().max()) < 10.0
    assert all(list(banned) == [liar] and "as a reducer" in banned[liar] for banned in bans), bans
    assert all("(tensor 0, part " in banned[liar] for banned in bans), bans
    first, second = results
    assert float((first[0] - first[1]).abs().max()) > 0.01  # the liar's slice: each peer's own after round 1
    for averaged in second[1:]:
        assert float((averaged - second[0]).abs().max()) < 1e-4


def test_a_reducer_returning_the_negated_mean_is_banned_on_the_direction_of_its_rounds():
    """Gradients of other microbatches: each peer's part is mostly its own noise, so the negated mean moves it no
    further than an honest mean does and no part is refused. Its averages point away from every honest peer's
    parts, round after round (`Alignment`): every honest peer bans it once that held in 5 of its rounds, and no
    honest peer is banned."""
    results, _, liar, bans, _ = average_once(NegatingAverager, independent_tensors(4), rounds=6, min_group_size=3,
                                             fresh=True, make_tensors=independent_tensors)
    assert all(torch.isfinite(averaged).all() for round_ in results for averaged in round_ if averaged is not None)
    assert all(list(banned) == [liar] for banned in bans), bans
    assert all("rounds past their bounds" in banned[liar] and "hold -" in banned[liar] for banned in bans), bans


def signal_in_noise(seed: int, size: int = SIZE) -> list[torch.Tensor]:
    """A common direction under each peer's own noise of twice its size: gradients of other microbatches later in
    training, whose mean still points along the expected gradient."""
    common = torch.randn(size, generator=torch.Generator().manual_seed(0))
    return [common / 2 + torch.randn(size, generator=torch.Generator().manual_seed(seed))]


PART_VALUES = DEFAULT_PART_SIZE_BYTES // 4  # the float32 values of one of hivemind's parts


def one_part_up_the_rest_negated(tensor: torch.Tensor) -> torch.Tensor:
    """Every fourth part ×8 (clipped, inside the accusation bound), −g on the other three: 16 parts cut among four
    reducers give each one scaled part and three negated ones, which the scaled part would outweigh if a round's
    parts were judged joined end to end."""
    parts = tensor.reshape(-1).split(PART_VALUES)
    return torch.cat([8 * part if i % 4 == 0 else -part for i, part in enumerate(parts)]).reshape(tensor.shape)


@pytest.mark.parametrize("send, size", [(torch.neg, SIZE), (one_part_up_the_rest_negated, 16 * PART_VALUES)],
                         ids=["negated", "one part up, the rest negated"])
def test_a_sender_of_its_negated_gradient_is_banned_on_the_direction_of_its_rounds(send, size):
    """A plain hivemind peer sends −g (or −g on most parts, and one part per reducer scaled up ×8, which is clipped
    but inside the accusation bound): no part is refused or far enough to accuse, but its parts point away from the
    others' average in every round (`SenderDirection`): every honest peer bans it after 5 rounds, and no honest peer
    is banned."""
    make_tensors = functools.partial(signal_in_noise, size=size)
    results, _, liar, bans, _ = average_once(hostile_sender(send), make_tensors(4), rounds=6, min_group_size=3,
                                             fresh=True, make_tensors=make_tensors)
    assert all(torch.isfinite(averaged).all() for round_ in results for averaged in round_ if averaged is not None)
    assert all(list(banned) == [liar] for banned in bans), bans
    assert all("as a sender" in banned[liar] and "cosine -" in banned[liar] for banned in bans), bans


# the honest peers of a run of lanes, with no grace for a sender whose gathered lane differs from its record
NoGraceAverager = type("RobustAverager", (RobustAveraging, DecentralizedAverager), {"lane_grace": 0.0})


def test_a_sender_naming_another_lane_than_its_record_is_still_judged_in_its_records_lane():
    """A run of two lanes: four peers of lane 0 by their records, and the sender of −g gathers lane 1, where it would
    be a camp of its own, clipped and never judged. Its signed record says lane 0, so the honest peers judge it there,
    and every one of them bans it for its direction (the grace of a lane switch set to 0 here)."""
    make_tensors = signal_in_noise
    results, _, liar, bans, _ = average_once(hostile_sender(torch.neg), make_tensors(4), rounds=6, min_group_size=3,
                                             fresh=True, make_tensors=make_tensors, honest_cls=NoGraceAverager,
                                             judges_by_lane=True, gathered=[0, 0, 0, 1], record_lanes=[0, 0, 0, 0])
    assert all(torch.isfinite(averaged).all() for round_ in results for averaged in round_ if averaged is not None)
    assert all(list(banned) == [liar] for banned in bans), bans
    assert all("as a sender" in banned[liar] and "cosine -" in banned[liar] for banned in bans), bans


def garbling_init(self, *args, **kwargs):
    DecentralizedAverager.__init__(self, *args, **kwargs)
    self.bandwidth = "fast"  # past hivemind's own check of its argument: what goes into its gathered entry


# a plain hivemind averager whose gathered entry names a bandwidth no honest averager sends: hivemind's split of the
# tensors raised on it in every member, and every round it joined failed for all
GarblingAverager = type("RobustAverager", (DecentralizedAverager,), {"__init__": garbling_init})


def test_a_member_whose_gathered_entry_is_garbled_is_left_out_and_the_rounds_run_without_it():
    """Two rounds with a member whose entry is garbled: each honest peer leaves it out (no share, no tensors
    expected, not in what its step returns) and the three get exactly their own mean in both. It was in their groups
    (they form none under four), and is banned by nobody (the leader may have garbled it, `peer/group_members.py`)."""
    results, (honest_mean,), hostile, bans, met = average_once(GarblingAverager, honest_tensors(4), rounds=2,
                                                                hostile_fails=True)
    for round_results in results:
        for averaged in round_results:
            assert averaged is not None and float((averaged - honest_mean).norm()) < 1e-4 * spread()
    assert met == [[False] * 3] * 2 and bans == [{}, {}, {}]


def test_four_honest_peers_ban_nobody_and_get_about_their_mean():
    fourth = honest_tensors(4)
    fourth_before = fourth[0].clone()  # the averager averages its tensors in place
    results, (honest_mean,), _, bans, _ = average_once(RobustAverager, fourth)
    mean_of_four = (3 * honest_mean + fourth_before) / 4
    for averaged in results[0]:
        # CenteredClip clips the honest parts furthest from the centre too: close to the mean, not equal to it
        assert float((averaged - mean_of_four).norm()) < 0.1 * spread()
    assert bans == [{}, {}, {}]


def test_fp16_on_the_wire_keeps_the_mean_and_still_refuses_a_nan_sender():
    """What the stage's gradient averaging sends by default (`GradientWire.FP16`): the honest result stays as close
    to the mean as fp32's does (the rounding is ~2e-4 of a part's spread), and a NaN part decodes as NaN."""
    fourth = honest_tensors(4)
    mean_of_four = (3 * torch.stack([honest_tensors(seed)[0] for seed in (1, 2, 3)]).mean(0) + fourth[0]) / 4
    results, _, _, bans, _ = average_once(RobustAverager, fourth, wire=GradientWire.FP16)
    for averaged in results[0]:
        assert float((averaged - mean_of_four).norm()) < 0.1 * spread()
    assert bans == [{}, {}, {}]
    nan = [torch.full((SIZE,), float("nan"))]
    results, _, hostile, bans, _ = average_once(PlainAverager, nan, wire=GradientWire.FP16)
    assert all(torch.isfinite(averaged).all() for averaged in results[0])
    assert all(hostile in banned for banned in bans), bans


def test_a_peer_sending_fp32_averages_with_peers_sending_fp16():
    """hivemind cuts the tensors into parts by bytes after compression: unless fp16 parts are half the bytes, an
    fp32 peer's parts hold half as many values, every reducer refuses them as misshapen and bans it."""
    fourth = honest_tensors(4)
    mean_of_four = (3 * torch.stack([honest_tensors(seed)[0] for seed in (1, 2, 3)]).mean(0) + fourth[0]) / 4
    results, _, _, bans, _ = average_once(RobustAverager, fourth, wire=GradientWire.FP16, fourth_wire=GradientWire.FP32)
    for averaged in results[0]:
        assert float((averaged - mean_of_four).norm()) < 0.1 * spread()
    assert bans == [{}, {}, {}]


def test_matchmaking_reads_the_dht_at_most_once_an_interval():
    """hivemind re-reads the group key as soon as a read returns while nobody else is declared: paced, a burst of
    reads is spread one interval apart, each still answered."""
    calls: list[float] = []

    class Keys:  # what `pace_lookups` wraps of hivemind's GroupKeyManager
        async def get_averagers(self, group_key, only_active):
            calls.append(time.monotonic())
            return [(group_key, only_active)]

    keys = Keys()
    pace_lookups(keys, 0.05)

    async def burst() -> list:
        return [await keys.get_averagers("stage1", True) for _ in range(5)]

    assert asyncio.run(burst()) == [[("stage1", True)]] * 5
    gaps = [later - earlier for earlier, later in zip(calls, calls[1:], strict=False)]
    # asyncio may wake a timer up to its clock's resolution early: unpaced, the reads would be microseconds apart
    assert len(calls) == 5 and min(gaps) >= 0.04 and keys.reads == 5


def test_a_receiver_refuses_one_reduced_part_keeps_the_order_and_accuses_on_evidence_or_what_no_honest_peer_sends():
    """`CheckedPartContainer` alone: parts from another reducer wait for this peer's own reduction; one past its
    bound is replaced by zeros (this peer keeps its values there) without an accusation, the next ones are used;
    a part beyond the reducer's share is refused and accuses it at once."""
    tensor = torch.randn(3000)
    container = TensorPartContainer([tensor], [1.0, 1.0, 1.0], part_size_bytes=400)  # 10 parts of 100 per peer
    judged: list[tuple[int, str | None]] = []
    evidence = Evidence()

    def judge(peer_index: int, finding, values: int | None) -> bool:
        judged.append((peer_index, finding and finding.why))
        return evidence.judge(peer_index, 0, finding, values) is not None

    aligned: list = []
    CheckedPartContainer.adopt(container, 0, RobustRule(), judge, set(), PartChanges(8),
                               lambda peer_index, finding: aligned.append(peer_index))
    own = [container._input_parts_by_peer[0][i][0] for i in range(10)]
    theirs = [container._input_parts_by_peer[1][i][0] for i in range(3)]
    container.register_processed_part(1, 0, 0.05 * theirs[0])  # before this peer's own reduction: held
    assert container._outputs_registered_by_peer[1] == 0 and not judged
    for i, part in enumerate(own):
        container.register_processed_part(0, i, 0.1 * part)
    container.register_processed_part(1, 1, 5.0 * theirs[1])  # 5 of its norm against 8 × 0.1: refused, not accused
    container.register_processed_part(1, 2, 0.05 * theirs[2])
    outputs = list(container._output_parts_by_peer[1])
    assert torch.equal(outputs[0], 0.05 * theirs[0]) and torch.equal(outputs[2], 0.05 * theirs[2])
    assert torch.equal(outputs[1], torch.zeros(100)) and container.failed_size == 100
    assert [why is not None for _, why in judged] == [False, True, False] and 1 not in container.refused
    assert "(tensor 0, part " in judged[1][1]  # which slice it was
    container.register_processed_part(2, 10, torch.zeros(100))  # peer 2 reduces parts 0-9 only
    assert 2 in container.refused and container._outputs_registered_by_peer[2] == 10
    assert "from a reducer of 10" in judged[-1][1]
    assert aligned == []  # no reducer's round is complete and judged: 1 sent 3 parts of 10, 2 was refused


def test_a_reducer_keeps_its_own_capped_weight_share_for_the_receivers_alignment_floor():
    """`RobustPartReducer.weight_share`, which this peer's container reads for its alignment floor: its own weight
    against an equal share of the part it reduced, weights capped at their median (one huge claim lifts the median,
    so it lowers the share); 0 when this peer's own part was not among those averaged."""

    def share(weights: list[float], own_sender: int | None) -> float:
        async def reduce() -> float:  # hivemind's reducer makes its futures on the running loop
            reducer = RobustPartReducer([torch.Size([100])], len(weights), RobustRule(), lambda *_: False, set(),
                                        lambda *_: False, own_sender)
            assert reducer.weight_share == 1.0  # before any part: the fixed floor
            await asyncio.gather(*(reducer.accumulate_part(sender, 0, torch.randn(100), weight=weight)
                                   for sender, weight in enumerate(weights)))
            return reducer.weight_share

        return asyncio.run(reduce())

    assert share([1.0, 1.0, 1.0, 1.0], 2) == pytest.approx(1.0)
    assert share([1.0, 4.0, 4.0, 4.0], 0) == pytest.approx(4 * 1.0 / 13)
    assert share([1.0, 4.0, 4.0, 4.0], 1) == pytest.approx(4 * 4.0 / 13)
    assert share([1.0, 1.0, 4.0, 1e9], 0) == pytest.approx(4 * 1.0 / 7)  # median 2.5 caps 4 and 1e9
    assert share([1.0, 1.0, 1.0], None) == 0.0


def test_a_gradient_round_judges_each_sender_among_its_own_lanes_senders():
    """The lanes a group gathered, as hivemind gathers them (`[bandwidth, mode, user data]`, the user data the lane
    `StageOptimizer` gathers), and the reducer judging each sender among its lane's: three replicas of lane 0 and one
    of lane 1 whose part is another chunk's gradient. Judged together the lane-1 sender is accused; by lane it is not
    judged, nor is a sender whose gathered data names no lane."""
    pack = MSGPackSerializer.dumps
    peers = [PeerID(f"peer{i}".encode()) for i in range(6)]
    gathered = [pack([1e6, 0, pack(0)]), pack([1e6, 0, pack(1)]), pack([1e6, 0, pack(None)]), b"\xc1junk",
                pack([1e6, 0, pack(True)]), pack([1e6, 0, pack("0")])]
    assert gathered_lanes(peers, gathered) == {peers[0]: 0, peers[1]: 1}
    generator = torch.Generator().manual_seed(0)
    base, other = torch.randn(3000, generator=generator), 3 * torch.randn(3000, generator=generator)
    parts = [base + 0.1 * torch.randn(3000, generator=generator) for _ in range(3)] + [other]

    def accused(camps: dict[int, int] | None) -> set[int]:
        found: set[int] = set()

        def judge(sender: int, finding, values: int) -> bool:
            if finding is not None:
                found.add(sender)
            return False

        async def reduce() -> None:
            reducer = RobustPartReducer([torch.Size([3000])], 4, RobustRule(), judge, set(), lambda *_: False, 0, camps)
            await asyncio.gather(*(reducer.accumulate_part(sender, 0, part) for sender, part in enumerate(parts)))

        asyncio.run(reduce())
        return found

    assert accused(None) == {3}
    assert accused({0: 0, 1: 0, 2: 0, 3: 1}) == set()
    assert accused({0: 0, 1: 0, 2: 0}) == set()  # sender 3 named no lane: a camp of its own


def test_each_lane_has_its_rounds_lowest_sender_judged_for_its_direction():
    """Two lanes of four senders, each with one sender of its lane's −g, a banned sender (ignored) and a refused one
    (NaN) ahead of them: judged across lanes, the two −g senders are each other's next lowest, and neither is apart
    from it; judged per lane, each is its lane's lowest and apart, and the findings name the senders themselves."""
    generator = torch.Generator().manual_seed(0)
    bases = [torch.randn(3000, generator=generator), 3 * torch.randn(3000, generator=generator)]
    lane = [bases[0] + 0.5 * torch.randn(3000, generator=generator) for _ in range(4)]
    other = [bases[1] + 1.5 * torch.randn(3000, generator=generator) for _ in range(4)]
    parts = [torch.randn(3000), torch.full((3000,), float("nan")), *lane[:3], -lane[3], *other[:3], -other[3]]
    camps = {sender: 0 if sender < 6 else 1 for sender in range(len(parts))}
    found: dict[int, str] = {}
    parts_judged: dict[int, float | None] = {}

    def judge(sender: int, finding, values: int) -> bool:
        assert values == 3000  # what a part holds, for its weight as evidence
        parts_judged[sender] = finding and finding.excess
        return False

    def judge_direction(sender: int, finding) -> bool:
        if finding is not None:
            found[sender] = finding.why
        return False

    async def reduce() -> None:
        reducer = RobustPartReducer([torch.Size([3000])], len(parts), RobustRule(), judge, {0}, judge_direction, 2,
                                    camps)
        await asyncio.gather(*(reducer.accumulate_part(sender, 0, part) for sender, part in enumerate(parts)))

    asyncio.run(reduce())
    assert set(found) == {5, 9}, found
    assert all(why.startswith("parts at cosine -0.") for why in found.values()), found
    # the refused NaN sender is the only finding on distance; the banned one is not judged at all
    assert parts_judged == {1: math.inf} | dict.fromkeys(range(2, 10)), parts_judged


def test_a_receiver_judges_each_reducers_direction_once_its_round_is_in():
    """Reducer 1 returns the negated mean of parts that are mostly noise (as far as an honest mean moves them, so
    every part is used), reducer 2 an honest mean: each is judged once, after its last part, and only 1's
    averages point away from this peer's parts."""
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(3000, generator=generator) for _ in range(3)]
    mean = torch.stack(inputs).mean(0)
    container = TensorPartContainer([inputs[0]], [1.0, 1.0, 1.0], part_size_bytes=400)
    aligned: list[tuple[int, str | None]] = []
    CheckedPartContainer.adopt(container, 0, RobustRule(), lambda *_: False, set(), PartChanges(8),
                               lambda peer_index, finding: aligned.append((peer_index, finding and finding.why)))
    for i in range(10):
        container.register_processed_part(0, i, mean[i * 100 : (i + 1) * 100] - inputs[0][i * 100 : (i + 1) * 100])
    for i in range(10):
        region = slice(1000 + i * 100, 1000 + (i + 1) * 100)
        container.register_processed_part(1, i, -mean[region] - inputs[0][region])
        assert aligned == ([(1, aligned[0][1])] if i == 9 else [])
    for i in range(10):
        region = slice(2000 + i * 100, 2000 + (i + 1) * 100)
        container.register_processed_part(2, i, mean[region] - inputs[0][region])
    assert [peer for peer, _ in aligned] == [1, 2] and aligned[1][1] is None
    assert aligned[0][1].startswith("averages that hold -0.") and container.failed_size == 0


def test_a_receiver_whose_own_part_was_not_averaged_does_not_judge_the_reducers_direction():
    """Weight share 0 (this peer's own part was refused or weighed 0 where it reduced): an honest average need not
    hold this peer's parts, so even the negated mean is applied without an alignment judgement."""
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(3000, generator=generator) for _ in range(3)]
    mean = torch.stack(inputs).mean(0)
    container = TensorPartContainer([inputs[0]], [1.0, 1.0, 1.0], part_size_bytes=400)
    aligned: list[int] = []
    CheckedPartContainer.adopt(container, 0, RobustRule(), lambda *_: False, set(), PartChanges(8),
                               lambda peer_index, finding: aligned.append(peer_index), lambda: 0.0)
    for i in range(10):
        container.register_processed_part(0, i, mean[i * 100 : (i + 1) * 100] - inputs[0][i * 100 : (i + 1) * 100])
    for i in range(10):
        region = slice(1000 + i * 100, 1000 + (i + 1) * 100)
        container.register_processed_part(1, i, -mean[region] - inputs[0][region])
    assert aligned == [] and container._outputs_registered_by_peer[1] == 10
