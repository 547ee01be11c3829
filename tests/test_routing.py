"""Next-hop choice: compatible peers only, least expected queue first, bans with backoff."""

import math

import torch
from builders import stage_record

from peer.audit import agreement
from peer.routing import Router
from swarm.records import SOFTWARE_VERSION, PeerEntry, speaks_our_wire


def entry(
    peer_id: str, throughput: float, load: int = 0, t_fixed: str = "a" * 64, u_version: int = 0, state: str = "online"
) -> PeerEntry:
    record = stage_record(
        1, peer_id, peer_id=peer_id, throughput=float(throughput), load=load, t_fixed_sha256=t_fixed,
        u_version=u_version, state=state,
    )
    return PeerEntry(record=record, expiration=0.0, owner=b"")


def router(*entries: PeerEntry) -> Router:
    r = Router(t_fixed_sha256="a" * 64, own_peer_id="me")
    r.update({1: list(entries)})
    return r


def test_incompatible_peers_are_never_chosen():
    old_release = entry("old-release", 1000)
    old_release = PeerEntry(old_release.record.copy(update={"software_version": "0.2.0"}), 0.0, b"")
    patched = entry("patched", 1.0)
    major, minor, _ = SOFTWARE_VERSION.split(".")
    patched = PeerEntry(patched.record.copy(update={"software_version": f"{major}.{minor}.99"}), 0.0, b"")
    r = router(
        entry("bad-hash", 1000, t_fixed="c" * 64),
        entry("leaving", 1000, state="leaving"),
        entry("me", 1000),
        old_release,  # a release whose replies we refuse (0.2.0 sends no epochs): routed around, never banned
        entry("good", 1.0),
        patched,  # a patch release speaks our wire
    )
    assert sorted(e.record.peer_id for e in r.candidates(1)) == ["good", "patched"]
    assert not speaks_our_wire("garbage") and not speaks_our_wire("") and speaks_our_wire(SOFTWARE_VERSION)


def test_a_lane_the_run_does_not_have_serves_nothing():
    lane_one = entry("lane-1", 1000)
    lane_one = PeerEntry(lane_one.record.copy(update={"lane": 1}), 0.0, b"")
    assert [e.record.peer_id for e in router(lane_one, entry("good", 1.0)).candidates(1)] == ["good"]
    two_lanes = Router(t_fixed_sha256="a" * 64, own_peer_id="me", lanes=2)
    two_lanes.update({1: [lane_one]})
    assert [e.record.peer_id for e in two_lanes.candidates(1)] == ["lane-1"]


def test_least_expected_queue_first():
    r = router(entry("slow", 100.0), entry("fast-busy", 1000.0, load=30), entry("fast", 1000.0, load=1))
    assert [e.record.peer_id for e in r.candidates(1)] == ["fast", "slow", "fast-busy"]


def test_ban_backs_off_and_expires():
    r = router(entry("x", 10.0), entry("y", 5.0))
    assert r.ban("x", now=0.0) == 5.0
    assert [e.record.peer_id for e in r.candidates(1, now=1.0)] == ["y"]
    assert [e.record.peer_id for e in r.candidates(1, now=6.0)][0] == "x"
    assert r.ban("x", now=6.0) == 10.0
    r.forgive("x")
    assert r.ban("x", now=7.0) == 5.0


def test_an_answer_lifts_a_ban_for_failures_never_one_for_a_lie_and_keeps_a_lies_strikes():
    """A liar's trips still in flight when an audit refuted it come back answered: they must not lift its ban, and
    once the ban ran out its first answered trip must not wipe the strikes that make its next ban longer."""
    r = router(entry("liar", 10.0), entry("flaky", 5.0))
    assert r.ban("liar", now=0.0, lied=True) == r.audit_ban
    r.forgive("liar", now=1.0)
    assert r.unreachable(now=1.0) == {"liar"} and r.liars(now=1.0) == {"liar"}
    r.forgive("liar", now=r.audit_ban + 1)  # its ban ran out; it is verified again, answering honestly
    assert not r.unreachable(now=r.audit_ban + 1)
    assert r.ban("liar", now=r.audit_ban + 2, lied=True) == 2 * r.audit_ban  # its next lie: twice as long
    r.ban("flaky", now=0.0)
    r.forgive("flaky", now=1.0)
    assert "flaky" not in r.bans


def test_a_peer_that_keeps_refusing_trips_is_banned_and_one_answer_clears_its_record():
    r = router(entry("stuck", 1000.0), entry("other", 10.0))
    assert r.refused("stuck", now=0.0) == 0.0
    r.forgive("stuck")  # it then carried a trip: the count starts over
    # a U switch refuses every trip in flight at once: one burst counts once
    assert [r.refused("stuck", now=10.0 + i / 100) for i in range(10)] == [0.0] * 10
    assert r.refused("stuck", now=12.5) == 0.0
    assert r.refused("stuck", now=15.0) == 5.0  # the third burst with no trip carried between
    assert [e.record.peer_id for e in r.candidates(1, now=16.0)] == ["other"]
    r.refused("other", now=16.0)
    r.update({1: [entry("stuck", 1000.0)]}, now=17.0)  # gone from the DHT: nothing kept about it
    assert r.refusals == {}


def test_hop_versions_audit_refuses_malformed_lists():
    import pytest

    from peer.next_hop import hop_versions
    from swarm.wire import ErrorCode, WireError

    assert hop_versions({"versions": [3, 3]}, num_stages=3) == [3, 3]
    for bad in ({}, {"versions": "3"}, {"versions": []}, {"versions": [1, 2, 3, 4]}, {"versions": [True]},
                {"versions": [-1]}, {"versions": [1.5]}):
        with pytest.raises(WireError) as info:
            hop_versions(bad, num_stages=3)
        assert info.value.code == ErrorCode.MALFORMED


def test_strikes_outlive_their_ban_so_bans_escalate_and_are_forgotten_by_age():
    r = router(entry("x", 10.0))
    assert r.ban("x", now=0.0) == 5.0
    r.update(r.stages, now=100.0)  # the ban ran out, the strike is kept
    assert [e.record.peer_id for e in r.candidates(1, now=100.0)] == ["x"]
    assert r.ban("x", now=100.0) == 10.0
    r.update(r.stages, now=100.0 + 4 * r.max_ban + 1)  # no new strike for 4 x max_ban: forgotten
    assert r.bans == {}
    assert r.ban("x", now=400.0) == 5.0


def test_a_liar_banned_again_after_its_ban_ran_out_is_banned_twice_as_long():
    """An audit ban (300 s) outlasts 4 × `max_ban`: had lies been forgotten by that measure, a liar's every ban
    would be its first."""
    r = router(entry("liar", 10.0))
    assert r.ban("liar", now=0.0, lied=True) == r.audit_ban
    r.update(r.stages, now=r.audit_ban + 4 * r.max_ban + 1)  # its ban ran out long ago: the strike is kept
    assert r.ban("liar", now=r.audit_ban + 4 * r.max_ban + 1, lied=True) == 2 * r.audit_ban
    later = r.bans["liar"].struck + 4 * r.max_audit_ban + 1
    r.update(r.stages, now=later)  # no new strike for 4 × max_audit_ban: forgotten
    assert r.bans == {} and r.ban("liar", now=later, lied=True) == r.audit_ban


def test_a_failure_after_a_lie_does_not_wipe_the_lie_from_the_record():
    r = router(entry("liar", 10.0))
    r.ban("liar", now=0.0, lied=True)
    r.ban("liar", now=r.audit_ban + 1)  # its ban ran out; one failed duplicate: a short ban, not a lie
    after = r.audit_ban + 1 + 4 * r.max_ban + 1
    r.update(r.stages, now=after)  # the failure's memory has passed, the lie's has not
    assert r.ban("liar", now=after, lied=True) == 4 * r.audit_ban  # its third strike


def test_identity_key_is_private_from_creation(tmp_path):
    import stat

    from dhtio.identity import load_or_create_rsa_key

    path = tmp_path / "keys" / "peer.rsa"
    first = load_or_create_rsa_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_rsa_key(path).to_bytes() == first.to_bytes()


def test_measured_rates_replace_claims_and_an_unmeasured_claim_buys_one_probe():
    r = router(entry("honest", 5_000.0), entry("liar", 1e12))
    r.claim_bounds = {1: 1e8}
    assert r.candidates(1)[0].record.peer_id == "liar"  # nothing measured yet: the (clamped) claim decides
    r.observe("honest", seconds=1.0, tokens=1000)  # 1000 tokens/s measured
    # the liar's claim now counts for at most 2x the best measured peer: still worth one probe
    assert r.rate(r.stages[1][1], 1, 1000.0) == 2000.0
    assert r.candidates(1)[0].record.peer_id == "liar"
    r.inflight["liar"] = 1  # the probe is in flight: no second trip for an unmeasured peer
    r.inflight["honest"] = 5
    assert [e.record.peer_id for e in r.candidates(1)] == ["honest", "liar"]
    r.inflight = {}
    r.observe("liar", seconds=10.0, tokens=1000)  # it answered, slowly: its claim no longer matters
    assert [e.record.peer_id for e in r.candidates(1)] == ["honest", "liar"]
    r.failed("honest")
    r.failed("honest")  # two failures halve the measured rate twice
    assert r.rate(r.stages[1][0], 1, None) == 250.0
    r.observe("honest", seconds=1.0, tokens=1000)  # an answer clears the failures
    assert r.rate(r.stages[1][0], 1, None) == 1000.0
    r.update({1: [entry("honest", 5_000.0)]})  # gone from the DHT: its measurements go too
    assert set(r.measures) == {"honest"}


def test_a_peer_measured_slow_once_is_probed_again_after_a_while_without_trips():
    r = router(entry("steady", 5_000.0), entry("joiner", 5_000.0))
    r.observe("steady", seconds=1.0, tokens=1000, now=0.0)  # 1000 tokens/s
    r.observe("joiner", seconds=100.0, tokens=1000, now=0.0)  # its first trip waited for a state download
    r.inflight["steady"] = 50  # even 50 trips queued at the steady peer beat one at a peer measured 100x slower
    assert r.candidates(1, now=5.0)[0].record.peer_id == "steady"
    # no trip of ours there and no answer for `remeasure_after`: its old measure no longer counts
    assert r.measured_rate("joiner", now=r.remeasure_after + 1) is None
    assert r.candidates(1, now=r.remeasure_after + 1)[0].record.peer_id == "joiner"
    r.inflight["joiner"] = 1  # the probe is in flight: the old measure decides again, so one probe at a time
    assert r.candidates(1, now=r.remeasure_after + 2)[0].record.peer_id == "steady"
    del r.inflight["joiner"]
    # the probe's answer replaces the old measure instead of moving an average that is out of date
    r.observe("joiner", seconds=1.0, tokens=1000, now=r.remeasure_after + 3)
    assert r.measured_rate("joiner", now=r.remeasure_after + 3) == 1000.0
    # a peer that keeps answering keeps its measure, however long ago it was first measured
    for t in range(20, 60, 5):
        r.observe("steady", seconds=1.0, tokens=1000, now=float(t))
    assert r.measured_rate("steady", now=60.0) == 1000.0


def simulate(behaviours: dict[str, tuple[float, bool]], claims: dict[str, float], trips: int, inflight: int = 4):
    """A driver keeping `inflight` trips in flight through the daemon's routing steps, in simulated time.

    behaviours: peer -> (seconds one trip takes it, whether its answer passes the checks); each peer
    serves one trip at a time (a queue). Returns which peer carried each trip, in order of sending."""
    import heapq

    r = router(*(entry(name, claim) for name, claim in claims.items()))
    r.claim_bounds = {1: 2e8}
    r.rng.seed(0)
    busy_until = dict.fromkeys(behaviours, 0.0)
    events, carried, now, sent = [], [], 0.0, 0

    def send(now: float) -> None:
        nonlocal sent
        peer = r.candidates(1, now=now)[0].record.peer_id
        r.sending(peer)
        seconds, ok = behaviours[peer]
        busy_until[peer] = max(busy_until[peer], now) + seconds
        heapq.heappush(events, (busy_until[peer], sent, peer, now, ok))
        carried.append(peer)
        sent += 1

    for _ in range(inflight):
        send(now)
    while sent < trips:
        now, _, peer, started, ok = heapq.heappop(events)
        r.done_sending(peer)
        if ok:
            r.observe(peer, now - started, tokens=1024, now=now)
            r.forgive(peer)
        else:
            r.failed(peer)
            r.ban(peer, now=now)
        send(now)
    return carried


def test_a_claim_of_1e12_does_not_draw_the_stage_from_a_measured_honest_peer():
    # the liar is slower than the honest peer (it is a small machine, or it stalls on purpose)
    carried = simulate({"honest": (0.1, True), "liar": (1.0, True)}, {"honest": 5_000.0, "liar": 1e12}, trips=500)
    after = carried[20:]  # the first few trips are the measurement
    assert after.count("honest") / len(after) >= 0.9, after.count("liar")
    assert carried.count("liar") <= 15
    # the liar answers at honest speed but its replies fail the checks (zero gradients, absurd loss): banned
    carried = simulate({"honest": (0.1, True), "liar": (0.1, False)}, {"honest": 5_000.0, "liar": 1e12}, trips=500)
    after = carried[20:]
    assert after.count("honest") / len(after) >= 0.9, after.count("liar")


def test_two_honest_peers_share_by_measured_speed():
    carried = simulate({"a": (0.1, True), "b": (0.1, True)}, {"a": 5_000.0, "b": 50_000.0}, trips=400)
    share = carried[50:].count("a") / len(carried[50:])
    assert 0.3 < share < 0.7  # b's tenfold claim does not matter once both are measured equal


def test_refusals_are_one_line_per_sender_per_interval():
    from peer.refusals import OTHERS, RefusalLog

    log = RefusalLog(interval=30.0, max_senders=2, started=0.0)
    for i in range(9000):
        log.note("QmAttacker", "unknown_sender" if i % 3 else "malformed")
    log.note("QmOther", "overloaded")
    assert log.flush(now=10.0) == []  # not yet: one line per interval
    lines = log.flush(now=30.0)
    assert lines == [
        "refused 9000 trip(s) from QmAttacker in 30s: unknown_sender 6000, malformed 3000",
        "refused 1 trip(s) from QmOther in 30s: overloaded 1",
    ]
    assert sum(len(line) + 1 for line in lines) < 200  # bytes for 9k refused trips, before the log prefix
    for i in range(100):  # a hundred fresh identities: bounded lines and memory
        log.note(f"Qm{i}", "unknown_sender")
    lines = log.flush(now=60.0)
    assert len(lines) == 3 and lines[0].startswith(f"refused 98 trip(s) from {OTHERS}")  # most first
    assert log.flush(now=90.0) == []  # nothing refused: nothing written


def test_sender_limits_cap_in_flight_and_rate():
    from peer.refusals import SenderLimits

    limits = SenderLimits(rate=10.0, burst=4.0, max_inflight=3)
    assert [limits.admit("a", now=0.0) for _ in range(3)] == [None] * 3
    assert "in flight" in limits.admit("a", now=0.0)
    assert limits.admit("b", now=0.0) is None  # another sender has its own allowance
    limits.release("a")
    assert limits.admit("a", now=0.0) is None  # the 4th token of the burst
    limits.release("a")
    assert "trips/s" in limits.admit("a", now=0.0)  # burst spent
    assert limits.admit("a", now=0.1) is None  # 0.1 s at 10/s refills one


def test_failover_policy():
    from peer.routing import Failover, counts_as_stuck, failover
    from swarm.wire import ErrorCode

    # an empty stage behind, or a U switch: the driver runs the trip again, whoever failed
    assert failover(ErrorCode.NO_PEER, candidates=3, failures=1) is Failover.GIVE_UP
    assert failover(ErrorCode.WRONG_VERSION, candidates=1, failures=5) is Failover.GIVE_UP
    # the stage's only peer gets three tries before a ban; a stage with others fails over at once
    assert [failover(ErrorCode.TIMEOUT, candidates=1, failures=n) for n in (1, 2, 3)] == [
        Failover.RETRY, Failover.RETRY, Failover.NEXT
    ]
    assert failover(ErrorCode.UNREACHABLE, candidates=2, failures=1) is Failover.NEXT
    # only the next hop's own version refusals, in a stage with other peers, count against it
    assert counts_as_stuck(ErrorCode.WRONG_VERSION, hops=1, candidates=2)
    assert not counts_as_stuck(ErrorCode.WRONG_VERSION, hops=2, candidates=2)
    assert not counts_as_stuck(ErrorCode.WRONG_VERSION, hops=1, candidates=1)
    assert not counts_as_stuck(ErrorCode.TIMEOUT, hops=1, candidates=2)


def test_after_failure_bans_counts_refusals_and_tracks_sends():
    from peer.routing import Failover
    from swarm.wire import ErrorCode

    r = router(entry("x", 10.0), entry("y", 5.0))
    r.sending("x")
    assert r.inflight == {"x": 1}
    assert r.after_failure("x", ErrorCode.TIMEOUT, hops=0, candidates=2, failures=1, now=0.0) == (Failover.NEXT, 5.0)
    assert r.measures["x"].failures == 1
    r.done_sending("x")
    assert r.inflight == {}
    # a version refusal from a peer with company: counted, banned at the third burst
    results = [
        r.after_failure("y", ErrorCode.WRONG_VERSION, hops=1, candidates=2, failures=1, now=t) for t in (0, 5, 10)
    ]
    assert results == [(Failover.GIVE_UP, 0.0), (Failover.GIVE_UP, 0.0), (Failover.GIVE_UP, 5.0)]
    r.answered("x", seconds=1.0, tokens=100)
    assert "x" not in r.bans and r.measured_rate("x") == 100.0


def test_a_relayed_peer_serves_when_alone_and_loses_to_a_direct_one_unless_faster():
    relay = "QmZ5dV2ukSB2jHZ2dfu9JmVqYLgz3UBGWvRzzTumj6HUjx"

    def relayed(peer_id: str, throughput: float) -> PeerEntry:
        e = entry(peer_id, throughput)
        return PeerEntry(record=e.record.copy(update={"relay": relay}), expiration=0.0, owner=b"")

    alone = router(relayed("home", 100.0))
    assert [e.record.peer_id for e in alone.candidates(1)] == ["home"]  # a stage is never left unserved
    assert alone.relay_of("home") == relay and alone.relay_of("nobody") == ""
    for _ in range(20):  # same claim, then the same measured speed: the direct peer wins every tie
        r = router(relayed("home", 100.0), entry("public", 100.0))
        assert [e.record.peer_id for e in r.candidates(1)] == ["public", "home"]
    r.observe("home", 1.0, 100)
    r.observe("public", 1.0, 100)
    assert [e.record.peer_id for e in r.candidates(1)] == ["public", "home"]
    r.observe("public", 4.0, 100)  # the direct peer became slower than the relayed one: the relayed one leads
    r.observe("public", 4.0, 100)
    assert [e.record.peer_id for e in r.candidates(1)] == ["home", "public"]


def test_a_pair_of_peers_is_no_longer_weighed_for_drift_once_one_of_its_records_expires():
    """`Router.update` drops the drift windows (`Ledger.drift`) of every pair with a peer no longer listed."""
    grad = torch.ones(16, dtype=torch.float64)
    seen = agreement(grad, 3.0, 2 * grad, 3.0)
    r = router(entry("x", 10.0), entry("y", 10.0), entry("z", 10.0))
    assert r.ledger.drift("x", "y", seen, 0) is None and r.ledger.drift("x", "z", seen, 2) is None
    assert set(r.ledger.drift_norms) == {frozenset("xy"), frozenset("xz")} and set(r.ledger.drift_cosines) == {
        frozenset("xy")}
    r.update({1: [entry("x", 10.0), entry("z", 10.0)]})  # y's record expired
    assert set(r.ledger.drift_norms) == {frozenset("xz")} and not r.ledger.drift_cosines
    assert math.isclose(r.ledger.drift_norms[frozenset("xz")][0], math.log(2))
