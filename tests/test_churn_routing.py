"""Routing under churn (issue 14): what a hop verified of a peer that left does not outlive its record."""

from builders import stage_record

from peer.routing import Router
from swarm.records import PeerEntry


def entry(stage: int, name: str) -> PeerEntry:
    return PeerEntry(stage_record(stage, name), 1e12, name.encode())


def test_a_departed_verified_peer_no_longer_blocks_trust_on_first_use():
    old, new = entry(1, "old"), entry(1, "new")
    router = Router(old.record.t_fixed_sha256, "me")
    router.update({1: [old]})
    ledger = router.ledger
    for _ in range(ledger.verify_after):
        ledger.clean_trip(old.record.peer_id, 0.0, tofu=True)
    assert ledger.verified(old.record.peer_id) and not ledger.trusted(new.record.peer_id)
    router.update({1: [old, new]})  # both listed: the newcomer must be verified by audit trips first
    assert not ledger.trusted(new.record.peer_id)
    router.update({1: [new]})  # the verified peer's record expired: the newcomer is trusted on first use
    assert ledger.trusted(new.record.peer_id) and ledger.plan([new.record.peer_id]).primary == new.record.peer_id
    for _ in range(ledger.verify_after):
        ledger.clean_trip(new.record.peer_id, 1.0, tofu=True)
    assert ledger.verified(new.record.peer_id)
