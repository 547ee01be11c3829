"""Audit trips (peer/audit.py): the reply comparison, the verification ledger, and the failover codes that are
no fault of the next hop (peer/routing.py). Pure logic, no swarm."""

from __future__ import annotations

import math
import random

import pytest
import torch

from peer.audit import COSINE_MIN, LOSS_RTOL, Ledger, agreement, replies_disagree
from peer.next_hop import check_loss
from peer.routing import Failover, Router, failover
from swarm.presets import preset
from swarm.records import plausible_loss_bound
from swarm.wire import ErrorCode, WireError


def test_honest_replies_agree_within_the_measured_tolerances():
    torch.manual_seed(0)
    grad = torch.randn(4, 16, 32)
    lagged = grad + 0.5 * torch.randn_like(grad)  # cosine ~0.9: honest peers an epoch or two apart
    assert replies_disagree(grad, 4.0, lagged, 4.0 * (1 + LOSS_RTOL * 0.8)) is None
    assert replies_disagree(grad, None, lagged, 3.0) is None  # a dropped (implausible) loss is not compared
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


def test_an_implausible_finite_loss_is_dropped_not_refused():
    manifest = preset("tiny", stages=2)
    bound = plausible_loss_bound(manifest)
    assert check_loss(3.0, manifest) == 3.0 and check_loss(None, manifest) is None
    assert check_loss(bound * 2, manifest) is None and check_loss(-1.0, manifest) is None
    for bad in (math.nan, math.inf, "3"):
        with pytest.raises(WireError) as info:
            check_loss(bad, manifest)
        assert info.value.code == ErrorCode.NOT_FINITE
