"""Audit trips (peer/audit.py): the reply comparison, the verification ledger, and the failover codes that are
no fault of the next hop (peer/routing.py). Pure logic, no swarm."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable
from types import SimpleNamespace

import pytest
import torch

from peer.audit import (
    AUDIT_MAX_LAG,
    COSINE_MIN,
    DRIFT_LAG,
    DRIFT_NORM_LAG,
    DRIFT_WINDOW,
    LANE_LOSS_RTOL,
    LOSS_GAP_MAX,
    LOSS_RTOL,
    LOSS_RTOL_PER_EPOCH,
    Ledger,
    Plan,
    agreement,
    epoch_lag,
    loss_rtol,
    replies_disagree,
)
from peer.next_hop import NextHop, Reply, check_loss, hop_epochs, plausible_loss
from peer.routing import Failover, Router, failover
from peer.stats import Stats
from swarm.codec import BoundaryCodec
from swarm.model import PipelineStage
from swarm.presets import preset
from swarm.records import plausible_loss_bound
from swarm.wire import ErrorCode, WireError


def test_honest_replies_agree_within_the_measured_tolerances():
    torch.manual_seed(0)
    grad = torch.randn(4, 16, 32)
    lagged = grad + 0.5 * torch.randn_like(grad)  # cosine ~0.9: honest peers an epoch or two apart
    assert replies_disagree(grad, 4.0, lagged, 4.0 * (1 + LOSS_RTOL * 0.8)) is None
    assert replies_disagree(grad, None, lagged, 3.0) is None  # a loss the hop after did not publish is not compared
    assert replies_disagree(torch.zeros(3), 0.0, torch.zeros(3), 0.0) is None


def test_fake_replies_disagree():
    torch.manual_seed(0)
    grad = torch.randn(4, 16, 32)
    assert "norms" in replies_disagree(grad, 4.1, torch.zeros_like(grad), 4.1)  # the zero-gradient liar
    assert "losses" in replies_disagree(grad, 4.1, grad.clone(), 0.0123)  # the fake loss
    # a random gradient with a copied loss passes: live honest peers measured cosine 0.09 (peer/audit.py)
    assert replies_disagree(grad, 4.1, torch.randn_like(grad), 4.1) is None
    assert "cosine" in replies_disagree(grad, 4.1, -grad, 4.1)
    assert replies_disagree(grad, 4.1, torch.full_like(grad, math.nan), 4.1) is not None
    assert replies_disagree(grad, 4.1, torch.randn(7), 4.1) is not None
    assert -1.0 < COSINE_MIN < 0.0


def _at_cosine(grad: torch.Tensor, cosine: float) -> torch.Tensor:
    """A tensor of `grad`'s norm at exactly `cosine` to it."""
    other = torch.randn_like(grad)
    other -= (other * grad).sum() / (grad * grad).sum() * grad
    other *= grad.norm() / other.norm()
    return cosine * grad + (1 - cosine**2) ** 0.5 * other


def test_the_cosine_floor_passes_the_most_opposed_honest_pair_and_refuses_a_flip_of_an_agreeing_one():
    """Measured (benchmarks/audit_pairs.py, 928 honest pairs with averaging): the most opposed honest pair was at
    -0.52 (losses equal, weights 2 epochs apart); 90 % were above 0.8, and a sign flip turns those below -0.8."""
    torch.manual_seed(1)
    grad = torch.randn(4, 16, 32)
    assert replies_disagree(grad, 4.0, _at_cosine(grad, -0.52), 4.0) is None
    assert replies_disagree(grad, 4.0, _at_cosine(grad, -0.63), 4.0) is None  # before averaging worked
    assert "cosine" in replies_disagree(grad, 4.0, -_at_cosine(grad, 0.85), 4.0)


def test_agreement_measures_what_the_tolerances_check():
    grad = torch.randn(4, 16, 32)
    seen = agreement(grad, 4.0, -2 * grad, 2.0)
    assert seen.loss_rdiff == 0.5 and abs(seen.cosine + 1) < 1e-12 and abs(seen.norms[1] / seen.norms[0] - 2) < 1e-12
    assert agreement(grad, None, torch.zeros_like(grad), 1.0).cosine is None
    assert not agreement(grad, 1.0, torch.randn(7), 1.0).shapes_match
    assert replies_disagree(grad, 4.0, -2 * grad, 2.0, seen=seen) == replies_disagree(grad, 4.0, -2 * grad, 2.0)


def test_an_unverified_candidate_gets_duplicates_until_verified():
    ledger = Ledger(verify_after=3, audit_rate=0.0)
    # nobody verified: trust on first use of the best candidate, verified after 3 clean trips
    assert ledger.plan(["a", "b"]).primary == "a" and ledger.plan(["a", "b"]).shadow is None
    assert ledger.trusted("a") and ledger.trusted("b")
    assert [ledger.clean_trip("a", now=t, tofu=True) for t in (1, 2, 3)] == [False, False, True]
    # now the faster newcomer "liar" only gets duplicates, "a" carries the trip
    plan = ledger.plan(["liar", "a"])
    assert (plan.primary, plan.shadow) == ("a", "liar")
    assert not ledger.trusted("liar")
    assert ledger.plan(["liar", "a"], busy={"liar"}).shadow is None  # one duplicate at a time
    assert not ledger.clean_trip("liar", now=4, tofu=True)  # trust on first use is over
    assert ledger.loser("a", "liar") == "liar"
    ledger.distrust("liar")
    # an honest newcomer: three matching duplicates make it verified
    assert [ledger.clean_trip("b", now=t, tofu=False) for t in (5, 6, 7)] == [False, False, True]
    # a failure restarts an unverified streak
    ledger.clean_trip("c", now=8, tofu=False)
    ledger.failed("c")
    assert ledger.standings["c"].clean == 0


def test_verified_peers_are_audited_at_a_low_rate_and_the_longer_history_wins():
    ledger = Ledger(verify_after=1, audit_rate=0.02, rng=random.Random(1))
    ledger.clean_trip("old", now=1, tofu=True)
    ledger.clean_trip("new", now=2, tofu=False)
    shadows = [ledger.plan(["new", "old"]).shadow for _ in range(5000)]
    assert all(p.primary == "new" for p in [ledger.plan(["new", "old"])])
    rate = shadows.count("old") / len(shadows)
    assert 0.01 < rate < 0.03 and set(shadows) <= {"old", None}
    assert ledger.loser("new", "old") == "new" and ledger.loser("old", "new") == "new"


def test_back_off_codes_are_no_fault_and_bans_for_lies_are_long():
    assert failover(ErrorCode.UNKNOWN_SENDER, candidates=2, failures=1) is Failover.BACKOFF
    assert failover(ErrorCode.OVERLOADED, candidates=1, failures=9) is Failover.BACKOFF
    r = Router("hash", "me")
    assert r.after_failure("x", ErrorCode.OVERLOADED, hops=1, candidates=2, failures=1, now=0.0) == (
        Failover.BACKOFF, 0.0)
    assert r.bans == {} and "x" not in r.measures
    assert r.ban("x", now=0.0, lied=True) == r.audit_ban
    assert r.ban("x", now=1.0, lied=True) == 2 * r.audit_ban


def test_an_implausible_finite_loss_is_compared_but_not_published():
    manifest = preset("tiny", stages=2)
    bound = plausible_loss_bound(manifest)
    assert check_loss(3.0) == 3.0 and check_loss(None) is None
    assert check_loss(bound * 2) == bound * 2 and check_loss(-1.0) == -1.0  # kept for the audit's comparison
    assert plausible_loss(3.0, manifest) == 3.0 and plausible_loss(None, manifest) is None
    assert plausible_loss(bound * 2, manifest) is None and plausible_loss(-1.0, manifest) is None
    for bad in (math.nan, math.inf, "3"):
        with pytest.raises(WireError) as info:
            check_loss(bad)
        assert info.value.code == ErrorCode.NOT_FINITE
    # a liar that sends a loss out of bounds (dropped, never published) is still compared with the honest one
    grad = torch.randn(4, 16, 32)
    assert "losses" in replies_disagree(grad, 3.0, grad, bound * 2)
    assert "losses" in replies_disagree(grad, 3.0, grad, -1.0)


def test_replies_are_compared_only_at_close_epochs_and_a_lag_is_excused_once_for_a_while():
    # the next hop's own epoch is the last; the hops after it are its word
    assert epoch_lag([3, 40], [3, 29]) == 11 and epoch_lag([40, 3], [29, 3]) == 0
    assert epoch_lag([], []) is None and epoch_lag([1], [1, 1]) is None
    assert hop_epochs({"epochs": [4, 0]}, hops=2) == [4, 0]
    for bad in ({}, {"epochs": [4]}, {"epochs": [-1, 0]}, {"epochs": [True, 0]}, {"epochs": "40"}):
        with pytest.raises(WireError):
            hop_epochs(bad, hops=2)
    ledger = Ledger(lag_grace=60.0, lag_memory=600.0)
    assert ledger.excuse_lag("slow", now=10.0) and ledger.excuse_lag("slow", now=70.0)
    assert not ledger.excuse_lag("slow", now=70.5)
    assert not ledger.excuse_lag("slow", now=500.0)  # one grace per `lag_memory`, caught up in between or not
    assert ledger.excuse_lag("slow", now=611.0)  # forgotten: a new grace


def test_a_peer_within_its_lag_grace_gets_a_duplicate_only_when_no_other_newcomer_is_free():
    ledger = Ledger(audit_rate=0.0, lag_grace=60.0)
    for t in (1.0, 2.0, 3.0):
        ledger.clean_trip("a", now=t, tofu=True)
    assert ledger.excuse_lag("far", now=100.0)
    assert ledger.plan(["far", "new", "a"], now=130.0) == Plan("a", "new")
    assert ledger.plan(["far", "new", "a"], busy={"new"}, now=130.0) == Plan("a", "far")
    assert ledger.plan(["far", "new", "a"], now=161.0) == Plan("a", "far")  # grace spent: ranked as it ranks


def test_older_weights_may_lose_more_the_further_behind_they_are():
    """The honest pairs that a flat 25 % refused (benchmarks/audit_pairs.py, a run's first minute): losses 4.98
    against 3.15 at weights 7 epochs apart, 4.99 against 3.73 at 3. Slack only where the older weights lost more."""
    grad = torch.randn(64)
    for stale, fresh, lag in ((4.98, 3.146, 7), (4.992, 3.728, 3)):
        rtol = loss_rtol(stale, [2, 20], fresh, [2, 20 + lag])
        assert rtol == pytest.approx(LOSS_RTOL + lag * LOSS_RTOL_PER_EPOCH) and rtol < 1
        assert loss_rtol(fresh, [20 + lag], stale, [20]) == rtol  # either order
        assert replies_disagree(grad, stale, grad, fresh, loss_rtol=rtol) is None
        assert replies_disagree(grad, stale, grad, fresh) is not None  # the flat tolerance that banned them
        assert loss_rtol(stale, [20 + lag], fresh, [20]) == LOSS_RTOL  # the newer weights lost more: no slack
    assert loss_rtol(0.0123, [20], 3.0, [27]) == LOSS_RTOL  # a fake low loss claiming older weights: no slack
    assert loss_rtol(4.0, [20], 3.0, [20]) == LOSS_RTOL  # one epoch
    assert loss_rtol(4.0, [20], 3.0, [21 + AUDIT_MAX_LAG]) == math.inf  # too far apart: losses not compared
    assert loss_rtol(None, [20], 3.0, [27]) == LOSS_RTOL and loss_rtol(4.0, [20], 3.0, [1, 27]) == LOSS_RTOL
    # a lane fork's is at least LANE_LOSS_RTOL, the pipeline's where that is larger: the slack does not stack on it
    assert loss_rtol(4.0, [20], 3.0, [20], lane_fork=True) == LANE_LOSS_RTOL
    assert loss_rtol(4.0, [20], 3.0, [27], lane_fork=True) == LANE_LOSS_RTOL
    assert loss_rtol(4.0, [20], 3.0, [30], lane_fork=True) == pytest.approx(LOSS_RTOL + 10 * LOSS_RTOL_PER_EPOCH)
    assert loss_rtol(4.0, [20], 3.0, [21 + AUDIT_MAX_LAG], lane_fork=True) == math.inf


async def _audit(next_hop: NextHop, primary: str, used: Reply, shadow: str, answer: Reply) -> None:
    """One audit through the driver's comparison: `shadow`'s duplicate answered `answer`, and was judged."""

    async def duplicate():
        return answer, 0.1

    next_hop._compare_later(primary, used, shadow, asyncio.ensure_future(duplicate()))
    await asyncio.sleep(0.01)


def test_an_audit_excuses_a_joiner_with_stale_weights_then_verifies_it_and_bans_a_lasting_gap():
    """The audit as a driver runs it (`NextHop._compare_later`, real router and ledger): the failover test's joiner
    answered with weights 21 epochs behind the verified peer's and losses 5.3 against 3.1. It is neither banned nor
    used until its replies compare; a gap that outlasts the grace is a disagreement, and a reply no honest peer
    sends is one at any gap."""
    manifest = preset("tiny", stages=2)
    router = Router(manifest.t_fixed_sha256, "me")

    async def nobody():
        raise AssertionError("the comparison fetches nothing")

    # the driver's stage holds only what a reply's check reads: its codec
    head = SimpleNamespace(codec=BoundaryCodec(manifest, PipelineStage(manifest, 0).subspace))
    tail_codec = BoundaryCodec(manifest, PipelineStage(manifest, 1).subspace)
    next_hop = NextHop(manifest, 0, head, router, None, nobody, Stats(), "[driver]", 30.0)
    ledger = router.ledger
    for t in (1.0, 2.0, 3.0):
        ledger.clean_trip("honest", now=t, tofu=True)
    torch.manual_seed(0)
    grad = torch.randn(4, 16, 32)

    def reply(loss: float, epoch: int, gradient: torch.Tensor = grad) -> Reply:
        return Reply(gradient, loss, [0], [epoch], 100)

    def audit(primary: str, used: Reply, shadow: str, answer: Reply):
        return _audit(next_hop, primary, used, shadow, answer)

    async def run() -> None:
        await audit("honest", reply(3.1, 30), "joiner", reply(5.3, 9, torch.randn_like(grad)))
        assert "joiner" not in router.liars() and not ledger.verified("joiner") and "joiner" in ledger.lagging_since
        for epoch in (31, 32, 33):  # caught up (a state round): its replies now compare, and match
            await audit("honest", reply(3.0, epoch), "joiner", reply(3.0, epoch - 1, grad * 1.01))
        assert ledger.verified("joiner") and not router.liars()
        # 7 epochs behind and a higher loss, as honest stale weights give: agrees; a lower one from older weights not
        await audit("honest", reply(3.15, 40), "joiner", reply(4.98, 33))
        assert ledger.verified("joiner") and not router.liars()
        await audit("honest", reply(3.0, 45), "cheat", reply(2.0, 40))
        assert "cheat" in router.liars()
        # two verified peers too far apart, within the grace: the shorter history loses its standing, unbanned
        await audit("honest", reply(3.0, 50), "joiner", reply(3.0, 50 - AUDIT_MAX_LAG - 1))
        assert not ledger.verified("joiner") and ledger.verified("honest") and "joiner" not in router.liars()
        # once its grace is spent, a gap is a disagreement: a liar cannot claim far epochs turn after turn
        ledger.lagging_since["joiner"] -= ledger.lag_grace + 1
        await audit("honest", reply(3.0, 60), "joiner", reply(0.0123, 60 + AUDIT_MAX_LAG + 1))
        assert "joiner" in router.liars()
        # a zero gradient is no honest reply at any gap: banned at once, grace or not
        await audit("honest", reply(3.0, 70), "zero", reply(3.0, 0, torch.zeros_like(grad)))
        assert "zero" in router.liars()
        # a loss out of bounds arrives as sent (a real reply through the real codec) and is never published, but
        # it is compared: sending one skips no check
        far = 2 * plausible_loss_bound(manifest)
        batch = manifest.batch
        boundary = torch.randn(batch.microbatch_size, batch.seq_len, manifest.model.d_model)
        blob = tail_codec.encode_backward(boundary, "t", 0, loss=far, extra={"versions": [0], "epochs": [80]})
        received = next_hop.check_reply(blob)
        assert received.loss == far and next_hop._believe("honest", received).loss is None
        await audit("honest", reply(3.0, 80, received.grad * 1.01), "out-of-bounds", received)
        assert "out-of-bounds" in router.liars()

    asyncio.run(run())


def test_a_loss_gap_of_older_weights_past_the_slack_is_excused_as_a_lag_once():
    """The long honest run's one remaining ban (benchmarks/results/audit-pairs-long.json): losses 6.128 from weights
    3 epochs older against 3.674, 0.40 apart where the slack at 3 epochs is 0.40. The peer that would lose is not
    banned but loses its standing for its lag grace (between two verified peers at the pair's second gap, as every
    gap of theirs is judged, `Ledger.losses_apart`); a gap the other way, a negated gradient with it, a gap more than
    `LOSS_GAP_EXCUSED` per epoch past the slack or `LOSS_GAP_MAX` apart, or a gap once the grace is spent are
    verdicts. A lane run's honest loss spike (4.332 from weights 4 epochs older against 1.775 after the newer ones
    recovered, 0.59 apart where the slack is 0.45) is excused the same way."""
    router, next_hop = _verified_pair("first", "second")
    ledger = router.ledger
    torch.manual_seed(0)
    grad = torch.randn(4, 16, 32)

    def audit(primary: str, used: Reply, shadow: str, answer: Reply):
        return _audit(next_hop, primary, used, shadow, answer)

    async def run() -> None:
        # between two verified peers one gap is weighed, not judged (`Ledger.losses_apart`); the second is judged
        await audit("first", Reply(grad, 3.674, [0], [23], 100), "second", Reply(grad * 1.1, 6.2, [0], [20], 100))
        assert not router.liars() and ledger.verified("second") and "second" not in ledger.lagging_since
        await audit("first", Reply(grad, 3.674, [0], [23], 100), "second", Reply(grad * 1.1, 6.2, [0], [20], 100))
        assert not router.liars() and not ledger.verified("second") and "second" in ledger.lagging_since
        for epoch in (24, 25, 26):  # caught up: compared, matched, verified again
            await audit("first", Reply(grad, 3.5, [0], [epoch], 100), "second", Reply(grad, 3.6, [0], [epoch], 100))
        assert ledger.verified("second") and not router.liars()
        # the loss spike and its recovery 4 epochs later: a gap further past the slack, over more epochs
        await audit("first", Reply(grad, 1.775, [0], [16], 100), "spiked", Reply(grad * 0.3, 4.332, [0], [12], 100))
        assert not router.liars() and "spiked" in ledger.lagging_since
        # but not one past the band over those epochs (0.85 at 4, capped at 0.75), nor a loss 4 times the other at
        # any lag
        await audit("first", Reply(grad, 0.8, [0], [16], 100), "far", Reply(grad, 6.0, [0], [12], 100))
        await audit("first", Reply(grad, 1.5, [0], [19], 100), "quadruple", Reply(grad, 6.2, [0], [10], 100))
        assert {"far", "quadruple"} <= set(router.liars())
        # the newer weights losing that much more is no lag
        await audit("first", Reply(grad, 3.5, [0], [30], 100), "newer", Reply(grad, 6.2, [0], [33], 100))
        assert "newer" in router.liars()
        # an older copy's loss does not cover a negated gradient, nor a gap further past the slack: the stale
        # liar's losses 5.52 and 3.08 at a lag of 1
        await audit("first", Reply(grad, 3.5, [0], [30], 100), "negated", Reply(-grad, 6.2, [0], [27], 100))
        assert "negated" in router.liars()
        await audit("first", Reply(grad, 3.08, [0], [30], 100), "stale", Reply(grad, 5.52, [0], [29], 100))
        assert "stale" in router.liars()
        # between two verified peers, where loss gaps and cosines are weighed over a window: at the second
        pair_router, pair_hop = _verified_pair("old", "new")
        for audits in (1, 2):
            await _audit(pair_hop, "old", Reply(grad, 3.5, [0], [30], 100), "new", Reply(-grad, 6.2, [0], [27], 100))
            assert ("new" in pair_router.liars()) == (audits == 2)
        # one grace per peer for a while: once it is spent, a gap past the slack judged (the pair's second) is a
        # verdict
        ledger.lagging_since["second"] -= ledger.lag_grace + 1
        for _ in range(2):
            await audit("first", Reply(grad, 3.4, [0], [40], 100), "second", Reply(grad, 6.2, [0], [37], 100))
        assert "second" in router.liars()

    asyncio.run(run())


def _seen(cosine: float, ratio: float) -> object:
    return agreement(*_pair(cosine, ratio))


def _pair(cosine: float, ratio: float) -> tuple:
    """Two gradients with this cosine and norm ratio, and equal losses."""
    a = torch.zeros(64, dtype=torch.float64)
    b = torch.zeros(64, dtype=torch.float64)
    a[0] = 1.0
    b[0], b[1] = cosine, math.sqrt(max(0.0, 1 - cosine**2))
    return a, 3.0, ratio * b, 3.0


def test_honest_pairs_do_not_drift_even_with_an_odd_audit_now_and_then():
    """An honest pair's single audits reach cosine -0.5 and norm ratios of 20 (RESULTS); medians do not."""
    ledger = Ledger()
    audits = [(0.99, 1.0), (-0.52, 1.1), (0.95, 22.0), (0.8, 1.3), (0.1, 3.8), (0.99, 1.0), (0.97, 0.9)] * 5
    for cosine, ratio in audits:
        assert ledger.drift("a", "b", _seen(cosine, ratio), 0) is None


@pytest.mark.parametrize("cosine, ratio", [(0.99, 10.0), (0.99, 0.1), (0.0, 1.0), (-0.3, 1.0)])
def test_a_forged_gradient_with_the_honest_loss_drifts_within_the_window(cosine, ratio):
    ledger = Ledger()
    verdicts = [ledger.drift("honest", "liar", _seen(cosine, ratio), lag) for lag in [0, 1, 0, 1, 0]]
    assert verdicts[:DRIFT_WINDOW - 1] == [None] * (DRIFT_WINDOW - 1) and "median gradient" in verdicts[-1]
    pair = frozenset(("honest", "liar"))
    assert pair not in ledger.drift_cosines and pair not in ledger.drift_norms  # a verdict starts the pair afresh


@pytest.mark.parametrize("ratio", [10.0, 0.1])
def test_a_scaled_gradient_drifts_on_audits_a_few_epochs_apart(ratio):
    """The norm ratio is weighed over audits within `DRIFT_NORM_LAG` epochs (steadier than the direction), so audits
    2 and 3 epochs apart, which do not count toward the direction, still catch a gradient scaled by 10 or 0.1."""
    ledger = Ledger()
    for _ in range(DRIFT_WINDOW):  # the pair agreed before
        assert ledger.drift("honest", "liar", _seen(0.99, 1.0), 0) is None
    lags = [2, DRIFT_NORM_LAG, 2]
    verdicts = [ledger.drift("honest", "liar", _seen(0.99, ratio), lag) for lag in lags]
    assert verdicts[:2] == [None, None] and f"within {DRIFT_NORM_LAG} epochs the median gradient norm" in verdicts[2]
    pair = frozenset(("honest", "liar"))
    # the verdict clears the direction's window too, though the direction did not reach it
    assert pair not in ledger.drift_cosines and pair not in ledger.drift_norms


def test_a_random_direction_is_weighed_only_on_audits_within_drift_lag():
    """Honest directions 2 epochs apart measured a median cosine of 0.06 over 5 audits early in a run (RESULTS), so
    those audits do not count toward the direction: a random gradient (cosine 0, honest norm) is caught by its third
    audit within `DRIFT_LAG` epochs after the pair agreed, however many come between further apart."""
    ledger = Ledger()
    for _ in range(DRIFT_WINDOW):
        assert ledger.drift("honest", "liar", _seen(0.99, 1.0), 0) is None
    far = DRIFT_LAG + 1
    for lag in [far, far, 0, far, DRIFT_LAG, far, far]:
        assert ledger.drift("honest", "liar", _seen(0.0, 1.0), lag) is None
    assert "median gradient cosine" in ledger.drift("honest", "liar", _seen(0.0, 1.0), DRIFT_LAG)


def test_only_audits_at_nearly_the_same_weights_count_toward_drift():
    ledger = Ledger()
    for _ in range(2 * DRIFT_WINDOW):
        assert ledger.drift("a", "b", _seen(0.0, 10.0), DRIFT_NORM_LAG + 1) is None
        assert ledger.drift("a", "b", _seen(0.0, 10.0), None) is None
    assert frozenset(("a", "b")) not in ledger.drift_cosines and frozenset(("a", "b")) not in ledger.drift_norms


def _driver_hop() -> tuple[Router, NextHop]:
    """A driver's next hop to the tiny preset's stage 1, with a real router and ledger; it fetches nothing (the
    tests hand it replies), and its stage holds only what a reply's check reads: its codec."""
    manifest = preset("tiny", stages=2)
    router = Router(manifest.t_fixed_sha256, "me")

    async def nobody():
        raise AssertionError("the comparison fetches nothing")

    head = SimpleNamespace(codec=BoundaryCodec(manifest, PipelineStage(manifest, 0).subspace))
    return router, NextHop(manifest, 0, head, router, None, nobody, Stats(), "[driver]", 30.0)

def _verified_pair(older: str, newer: str) -> tuple[Router, NextHop]:
    """`_driver_hop` with two verified peers: `older` by trust on first use, `newer` after it by three audits."""
    router, next_hop = _driver_hop()
    for t in (1.0, 2.0, 3.0):
        router.ledger.clean_trip(older, now=t, tofu=True)
    for t in (4.0, 5.0, 6.0):
        router.ledger.clean_trip(newer, now=t, tofu=False)
    return router, next_hop



@pytest.mark.parametrize("forge", [lambda g: 10 * g, lambda g: 0.1 * g, lambda g: torch.randn_like(g) * g.norm()])
def test_a_verified_peer_forging_its_gradient_with_the_honest_loss_is_banned_by_the_fifth_audit(forge):
    """Through the driver's comparison (`NextHop._compare_later`, real router and ledger): each audit alone passes
    the per-audit tolerances, their median does not."""
    router, next_hop = _verified_pair("honest", "liar")
    assert router.ledger.verified("liar")
    torch.manual_seed(0)

    async def answered(reply: Reply) -> tuple[Reply, float]:
        return reply, 0.1

    async def run() -> int:
        for audit in range(1, 11):
            grad = torch.randn(4, 16, 32)
            grad = grad / grad.norm()

            used, forged = Reply(grad, 3.0, [0], [20 + audit % 2], 100), Reply(forge(grad), 3.0, [0], [20], 100)
            next_hop._compare_later("honest", used, "liar", asyncio.ensure_future(answered(forged)))
            await asyncio.sleep(0.01)
            if "liar" in router.liars():
                return audit
        return 0

    assert asyncio.run(run()) == DRIFT_WINDOW
    assert "honest" not in router.liars()


def test_comparisons_in_flight_when_a_verdict_lands_on_the_pair_are_not_judged_again():
    """A burst of lane forks, each disagreeing on the loss (as in an all-honest lane run where one episode banned an
    honest peer 9 times within 2 s, each ban doubling): the first comparison to come back bans the peer with the
    shorter verified history once; the others, sent before that verdict, are not judged. A comparison sent after
    it is judged again."""
    router, next_hop = _verified_pair("older", "newer")
    grad = torch.randn(4, 16, 32)

    async def run() -> None:
        replies = [asyncio.get_running_loop().create_future() for _ in range(5)]
        for reply in replies:
            next_hop._compare_later("older", Reply(grad, 2.7, [0], [20], 100), "newer", reply, lane_fork=True)
        for reply in replies:
            reply.set_result((Reply(grad, 0.7, [0], [20], 100), 0.1))
            await asyncio.sleep(0.01)
        assert router.bans["newer"].strikes == 1 and "older" not in router.liars()
        later = asyncio.get_running_loop().create_future()
        next_hop._compare_later("older", Reply(grad, 2.7, [0], [21], 100), "newer", later, lane_fork=True)
        later.set_result((Reply(grad, 0.7, [0], [21], 100), 0.1))
        await asyncio.sleep(0.01)
        assert router.bans["newer"].strikes == 2

    asyncio.run(run())


@pytest.mark.parametrize("lane_fork", [True, False], ids=["lane forks", "pipeline audits"])
def test_a_lane_forks_losses_may_be_three_times_apart_a_pipeline_duplicates_only_a_quarter(
    lane_fork: bool,
):
    """A lane's loss is its chunk's, from replicas that average mostly in pairs: two honest lane-0 replicas at one
    epoch answered 3.217 and 1.789 (an honest peer banned by the pipeline's 25 %, benchmarks/RESULTS.md), and no
    recorded honest lane comparison was more than 0.599 apart (`benchmarks/replay_audits.py --lanes`). A loss past
    `LANE_LOSS_RTOL` is still a lie on a lane fork, also where the reply claims epochs that would give the pipeline's
    slack. Through the driver's comparison (real router and ledger): a lane fork's gap is judged at once, a pipeline
    duplicate's between two verified peers at the pair's second (`Ledger.losses_apart`)."""
    router, next_hop = _verified_pair("older", "newer")
    grad = torch.randn(4, 16, 32)

    async def compare(loss: float, shadow_loss: float) -> None:
        for _ in range(1 if lane_fork else 2):
            reply = asyncio.get_running_loop().create_future()
            next_hop._compare_later("older", Reply(grad, loss, [0], [20], 100), "newer", reply, lane_fork=lane_fork)
            reply.set_result((Reply(grad, shadow_loss, [0], [20], 100), 0.1))
            await asyncio.sleep(0.01)

    async def run() -> None:
        await compare(3.217, 1.789)
        assert ("newer" in router.liars()) == (not lane_fork)
        if lane_fork:
            assert (3.0 - 0.9) / 3.0 > LANE_LOSS_RTOL
            await compare(3.0, 0.9)  # one loss more than 3 times the other
            assert "newer" in router.liars() and "older" not in router.liars()
            router.bans.clear()
            # a liar claiming weights 7 epochs newer, with a loss of 0: the older weights lost more, and the
            # pipeline's slack stacked on the lane's tolerance would have been above 1 there (no loss refused)
            reply = asyncio.get_running_loop().create_future()
            next_hop._compare_later("older", Reply(grad, 3.0, [0], [20], 100), "newer", reply, lane_fork=True)
            reply.set_result((Reply(grad, 0.0, [0], [27], 100), 0.1))
            await asyncio.sleep(0.01)
            assert "newer" in router.liars()

    asyncio.run(run())


@pytest.mark.parametrize("lane_fork", [True, False], ids=["lane forks", "pipeline audits"])
def test_a_pair_is_refused_for_a_sign_flip_over_its_last_three_cosines_not_one(lane_fork: bool):
    """Honest lane replies fell below the cosine floor once in every two or three lane runs, and an honest pipeline
    pair once in a 500-step run (-0.978, benchmarks/results/audit-pairs-long.json); a negating peer does so on most
    audits. Through the driver's comparison of lane forks and of pipeline duplicates (real router and ledger)."""
    router, next_hop = _verified_pair("honest", "other")
    grad = torch.randn(4, 16, 32)

    async def compare(shadow: str, sent: torch.Tensor) -> None:
        reply = asyncio.get_running_loop().create_future()
        next_hop._compare_later("honest", Reply(grad, 3.0, [0], [20], 100), shadow, reply, lane_fork=lane_fork)
        reply.set_result((Reply(sent, 3.0, [0], [20], 100), 0.1))
        await asyncio.sleep(0.01)

    async def run() -> int:
        for sent in (grad, -grad, grad, 0.9 * grad - 0.1 * torch.randn_like(grad), grad):  # honest, one odd cosine
            await compare("other", sent)
        assert not router.liars() and router.ledger.verified("other")
        for audit in range(1, 4):  # turns liar: negates every gradient
            await compare("other", -grad)
            if "other" in router.liars():
                return audit
        return 0

    assert asyncio.run(run()) == 2 and "honest" not in router.liars()


def test_a_negating_newcomer_audited_against_two_verified_peers_in_turn_is_refused_at_its_first_audit():
    """Its flip windows would be split between the two pairs (the primary changes from trip to trip) and none filled
    before its third clean duplicate verified it: a peer not verified yet is refused at one cosine below the floor."""
    router, next_hop = _verified_pair("a", "b")
    grad = torch.randn(4, 16, 32)

    async def run() -> None:
        reply = asyncio.get_running_loop().create_future()
        next_hop._compare_later("a", Reply(grad, 3.0, [0], [20], 100), "newcomer", reply)
        reply.set_result((Reply(-grad, 3.0, [0], [20], 100), 0.1))
        await asyncio.sleep(0.01)

    asyncio.run(run())
    assert "newcomer" in router.liars() and not router.ledger.verified("newcomer")
    assert not {"a", "b"} & set(router.liars())


def test_two_verified_peers_are_judged_on_loss_gaps_in_most_of_their_last_three_comparisons():
    """The third long honest run's one ban (benchmarks/results/audit-pairs-long-3.json): at equal epochs one verified
    replica answered loss 8.786 with a gradient 81 times smaller than its partner's 5.945, and the pair's next 693
    comparisons agreed. One such gap is weighed, not judged; a liar that forges its loss on most audits (the stale
    liar's 5.22 against 3.25) is banned at its second gap in any three, the peer with the shorter history as before.
    Through the driver's comparison (real router and ledger)."""
    router, next_hop = _verified_pair("older", "newer")
    torch.manual_seed(0)
    grad = torch.randn(4, 16, 32)

    def audit(used_loss: float, shadow_loss: float, shadow_grad: torch.Tensor = grad) -> Awaitable[None]:
        return _audit(next_hop, "older", Reply(grad, used_loss, [0], [9], 100), "newer",
                      Reply(shadow_grad, shadow_loss, [0], [9], 100))

    async def run() -> None:
        await audit(8.786, 5.945, grad * 81)  # the outlier
        for _ in range(5):
            await audit(3.2, 3.21)
        assert not router.liars() and router.ledger.verified("newer")
        await audit(3.25, 5.22)  # gap, agree, gap: the second gap of three is the verdict
        await audit(3.2, 3.21)
        assert not router.liars()
        await audit(3.25, 5.22)
        assert "newer" in router.liars() and "older" not in router.liars()

    asyncio.run(run())
    ledger = Ledger()
    seen = agreement(grad, 3.25, grad, 5.22)
    # one gap in every three is never most of a window: a limit, as for the other windowed rules
    assert not any(ledger.losses_apart("a", "b", s, LOSS_RTOL) for s in [seen, _seen(1.0, 1.0), _seen(1.0, 1.0)] * 4)
    assert ledger.losses_apart("a", "b", seen, LOSS_RTOL) is False
    assert ledger.losses_apart("a", "b", seen, LOSS_RTOL) is True and frozenset("ab") not in ledger.loss_gaps
    # a comparison without both losses is not weighed
    assert not ledger.losses_apart("a", "b", agreement(grad, None, grad, 3.0), LOSS_RTOL)


def test_a_loss_gap_no_honest_pair_showed_is_judged_at_once_and_a_gap_weighed_is_no_match():
    """Between two verified peers a gap past `LOSS_GAP_MAX` (one loss 4 times the other; no recorded honest pair was
    past 0.60) is a verdict at its first audit, as before the window. A gap weighed is neither a verdict nor a match:
    its norm ratio does not enter the drift window and its service time is not taken."""
    router, next_hop = _verified_pair("older", "newer")
    grad = torch.randn(4, 16, 32)

    async def run() -> None:
        await _audit(next_hop, "older", Reply(grad, 3.0, [0], [9], 100), "newer", Reply(grad * 81, 5.0, [0], [9], 100))
        assert not router.liars() and not router.ledger.drift_norms and "newer" not in router.measures
        await _audit(next_hop, "older", Reply(grad, 3.0, [0], [9], 100), "newer", Reply(grad, 3.0, [0], [9], 100))
        assert "newer" in router.measures and router.ledger.drift_norms
        await _audit(next_hop, "older", Reply(grad, 3.0, [0], [9], 100), "newer", Reply(grad, 0.7, [0], [9], 100))
        assert (3.0 - 0.7) / 3.0 > LOSS_GAP_MAX and "newer" in router.liars()

    asyncio.run(run())
