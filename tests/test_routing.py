"""Next-hop choice: compatible peers only, least expected queue first, bans with backoff."""

from builders import stage_record

from peer.routing import Router
from swarm.records import PeerEntry


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
    r = router(
        entry("bad-hash", 1000, t_fixed="c" * 64),
        entry("leaving", 1000, state="leaving"),
        entry("me", 1000),
        entry("good", 1.0),
    )
    assert [e.record.peer_id for e in r.candidates(1)] == ["good"]


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

    from peer.daemon import hop_versions
    from swarm.wire import ErrorCode, WireError

    assert hop_versions({"versions": [3, 3]}, num_stages=3) == [3, 3]
    for bad in ({}, {"versions": "3"}, {"versions": []}, {"versions": [1, 2, 3, 4]}, {"versions": [True]},
                {"versions": [-1]}, {"versions": [1.5]}):
        with pytest.raises(WireError) as info:
            hop_versions(bad, num_stages=3)
        assert info.value.code == ErrorCode.MALFORMED


def test_expired_bans_are_forgotten_on_update():
    r = router(entry("x", 10.0))
    r.ban("x", now=0.0)
    r.update(r.stages, now=1.0)
    assert "x" in r.bans
    r.update(r.stages, now=100.0)
    assert r.bans == {}


def test_identity_key_is_private_from_creation(tmp_path):
    import stat

    from swarm.records import load_or_create_rsa_key

    path = tmp_path / "keys" / "peer.rsa"
    first = load_or_create_rsa_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_rsa_key(path).to_bytes() == first.to_bytes()
