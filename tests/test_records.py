"""A record speaks only for its signer (real RSA identities, real hivemind validators), and claims are clamped."""

from __future__ import annotations

import math
from types import SimpleNamespace

import multihash
import pydantic.v1 as pydantic
import pytest
from builders import stage_record
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import P2P, PeerID
from hivemind.utils import MSGPackSerializer
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

from dhtio.identity import load_identity_key, peer_id_of_owner
from dhtio.records import parse_stage_entries, parse_subspace_entries
from dhtio.validators import make_validators
from swarm.presets import preset
from swarm.records import (
    PeerEntry,
    SubspaceRecord,
    claimed_throughput,
    contribution_key,
    is_peer_id,
    plausible_loss_bound,
    plausible_throughput,
    stage_key,
    subspace_key,
)

MANIFEST = preset("tiny", stages=3)


def identity(tmp_path, name):
    """A libp2p identity as hivemind writes it, its peer id, and the validators of a peer signing with it."""
    path = tmp_path / name
    P2P.generate_identity(str(path))
    peer_id = PeerID.from_identity(path.read_bytes()).to_base58()
    signer, validators = make_validators(MANIFEST, load_identity_key(path))
    return peer_id, signer, CompositeValidator(validators)


def signed(validator: CompositeValidator, signer, record) -> DHTRecord:
    """What a DHT node stores for `record` under the stage key, signed as `signer` (as `DHTNode.store` does)."""
    unsigned = DHTRecord(
        key=DHTID.generate(source=stage_key(MANIFEST, record.stage)).to_bytes(),
        subkey=MSGPackSerializer.dumps(signer.local_public_key),
        value=MSGPackSerializer.dumps(record.dict()),
        expiration_time=get_dht_time() + 30,
    )
    return DHTRecord(unsigned.key, unsigned.subkey, validator.sign_value(unsigned), unsigned.expiration_time)


def test_the_signer_is_the_libp2p_identity(tmp_path):
    peer_id, signer, _ = identity(tmp_path, "a.id")
    assert peer_id_of_owner(signer.local_public_key) == peer_id
    assert peer_id_of_owner(b"no key here") is None


def _hivemind_reads_a_peer_id(text: str) -> bool:
    """The relay check as it was written with hivemind's `PeerID`, before `swarm` stopped importing hivemind."""
    try:
        raw = PeerID.from_base58(text).to_bytes()
        multihash.decode(raw)
        return PeerID(raw).to_base58() == text
    except Exception:  # noqa: BLE001 - base58 or multihash errors alike
        return False


def test_a_peer_id_is_checked_as_hivemind_reads_one(tmp_path):
    peer_id, _, _ = identity(tmp_path, "a.id")
    raw = PeerID.from_base58(peer_id).to_bytes()
    candidates = [
        peer_id,
        "1" + peer_id,  # a leading zero byte: still base58, no longer a multihash
        peer_id[:-1],  # truncated: the digest is shorter than its length says
        peer_id.replace(peer_id[3], "0"),  # "0" is not a base58 digit
        PeerID(raw + b"\0").to_base58(),  # a trailing byte after the digest
        "",
        "not a peer id",
        "Qm" + "1" * 44,
    ]
    for text in candidates:
        assert is_peer_id(text) == _hivemind_reads_a_peer_id(text), text
    assert is_peer_id(peer_id) and not is_peer_id("1" + peer_id)
    assert stage_record(1, relay=peer_id).relay == peer_id
    with pytest.raises(pydantic.ValidationError, match="relay is not a canonical peer id"):
        stage_record(1, relay="1" + peer_id)


def test_a_record_naming_another_peer_is_refused_at_storage(tmp_path):
    a_id, a_signer, a_validator = identity(tmp_path, "a.id")
    _, b_signer, b_validator = identity(tmp_path, "b.id")
    _, _, storing_node = identity(tmp_path, "c.id")  # a third node checks what it is asked to store
    own = signed(a_validator, a_signer, stage_record(1, "a", peer_id=a_id))
    forged = signed(b_validator, b_signer, stage_record(1, "b", peer_id=a_id, throughput=1e12, trips=10**9))
    assert storing_node.validate(own)
    assert not storing_node.validate(forged)
    # the signature itself is fine: only the claimed id is wrong
    b_id = peer_id_of_owner(b_signer.local_public_key)
    assert storing_node.validate(signed(b_validator, b_signer, stage_record(1, "b", peer_id=b_id)))
    # deleting one's own record (value None) is not a claim
    deletion = DHTRecord(own.key, own.subkey, MSGPackSerializer.dumps(None), own.expiration_time)
    assert storing_node.validate(
        DHTRecord(deletion.key, deletion.subkey, a_validator.sign_value(deletion), deletion.expiration_time)
    )


def test_reading_keeps_one_record_per_peer_id_its_own(tmp_path):
    a_id, a_signer, _ = identity(tmp_path, "a.id")
    _, b_signer, _ = identity(tmp_path, "b.id")
    expires = get_dht_time() + 30
    raw = SimpleNamespace(
        value={
            a_signer.local_public_key: ValueWithExpiration(stage_record(1, "a", peer_id=a_id).dict(), expires),
            b_signer.local_public_key: ValueWithExpiration(
                stage_record(1, "b", peer_id=a_id, throughput=1e12).dict(), expires
            ),
        }
    )
    entries = parse_stage_entries(raw)
    assert [(e.record.public_name, e.owner) for e in entries] == [("a", a_signer.local_public_key)]


def test_claims_are_clamped_to_what_hardware_can_do():
    for stage in range(MANIFEST.num_stages):
        bound = plausible_throughput(MANIFEST, stage)
        assert 1e6 < bound < 1e10  # a tiny stage: generous, but finite
        assert claimed_throughput(stage_record(stage, throughput=1e12), MANIFEST) == bound
        assert claimed_throughput(stage_record(stage, throughput=5e3), MANIFEST) == 5e3
    big = preset("8b", stages=8)
    assert plausible_throughput(big, 3) < 1e6  # 4 layers of an 8B model: under a million tokens/s anywhere
    assert plausible_loss_bound(MANIFEST) > 2 * math.log(256)


def _signed_subspace(validator: CompositeValidator, signer, key: str, record: SubspaceRecord) -> DHTRecord:
    unsigned = DHTRecord(
        key=DHTID.generate(source=key).to_bytes(),
        subkey=MSGPackSerializer.dumps(signer.local_public_key),
        value=MSGPackSerializer.dumps(record.dict()),
        expiration_time=get_dht_time() + 30,
    )
    return DHTRecord(unsigned.key, unsigned.subkey, validator.sign_value(unsigned), unsigned.expiration_time)


def _contribution(peer_id: str, stage: int = 1) -> SubspaceRecord:
    return SubspaceRecord(
        kind="contribution",
        peer_id=peer_id,
        version=0,
        target_version=1,
        stage=stage,
        epoch=3,
        terms=2,
        u_sha256="ab" * 32,
        contributors=[],
        data=b"\0" * 16,
    )


def test_subspace_and_contribution_records_naming_another_peer_are_refused(tmp_path):
    a_id, a_signer, a_validator = identity(tmp_path, "a.id")
    _, b_signer, b_validator = identity(tmp_path, "b.id")
    _, _, storing_node = identity(tmp_path, "c.id")
    for key in (contribution_key(MANIFEST), subspace_key(MANIFEST)):
        assert storing_node.validate(_signed_subspace(a_validator, a_signer, key, _contribution(a_id)))
        assert not storing_node.validate(_signed_subspace(b_validator, b_signer, key, _contribution(a_id)))
    # and on reading: a record under B's key naming A is dropped
    expires = get_dht_time() + 30
    raw = SimpleNamespace(
        value={
            a_signer.local_public_key: ValueWithExpiration(_contribution(a_id).dict(), expires),
            b_signer.local_public_key: ValueWithExpiration(_contribution(a_id, stage=2).dict(), expires),
        }
    )
    assert [(r.peer_id, r.stage) for r in parse_subspace_entries(raw)] == [(a_id, 1)]


def test_a_contribution_counts_only_from_a_live_member_of_its_stage():
    from peer.subspace_sync import stage_member

    now = get_dht_time()
    stages = {
        1: [PeerEntry(stage_record(1, "a", peer_id="A"), expiration=now + 10, owner=b"a")],
        2: [PeerEntry(stage_record(2, "b", peer_id="B"), expiration=now - 1, owner=b"b")],
    }
    assert stage_member(stages, 1, "A", now)
    assert not stage_member(stages, 2, "A", now)  # A serves stage 1, not 2
    assert not stage_member(stages, 2, "B", now)  # B's record expired
    assert not stage_member(stages, 0, "A", now)
