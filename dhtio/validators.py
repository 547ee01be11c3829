"""The validators every DHT node of a run checks records with: the owner's signature, the schema of
`swarm.records`, and that a record names its signer's peer id.

Built on hivemind's DHT validator classes, so here beside the DHT calls rather than beside the schemas
(importing any of hivemind loads its DHT node and P2P daemon; tests/test_layering.py).
"""

from __future__ import annotations

from typing import Any

import pydantic.v1 as pydantic
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer
from hivemind.utils.crypto import RSAPrivateKey

from dhtio.identity import peer_id_of_owner
from swarm.manifest import Manifest
from swarm.records import StagePeerRecord, SubspaceRecord, contribution_key, stage_key, subspace_key


def _run_schema(manifest: Manifest) -> type[pydantic.BaseModel]:
    """The run's keys as one pydantic model: hivemind's `SchemaValidator` joins its prefix (the run id) to a
    field name with '_', giving the keys of `swarm.records`; every subkey must carry its owner's public key."""
    fields: dict[str, Any] = {
        f"stage{i}": (dict[BytesWithPublicKey, StagePeerRecord | None] | None, None) for i in range(manifest.num_stages)
    }
    fields["subspace"] = (dict[BytesWithPublicKey, SubspaceRecord | None] | None, None)
    fields["ucontrib"] = (dict[BytesWithPublicKey, SubspaceRecord | None] | None, None)
    return pydantic.create_model("RunRecords", **fields)


class BoundPeerIdValidator(RecordValidatorBase):
    """Refuses a stage, subspace or contribution record whose `peer_id` is not the id of the key that signed
    it (runs after the signature check and the schema, on the stripped value). Deletions and other keys pass.
    A forged contribution naming an honest peer's id would make peers rebuild another contribution set than
    the coordinator used, and reject the honest proposal for good."""

    def __init__(self, manifest: Manifest):
        keys = [stage_key(manifest, i) for i in range(manifest.num_stages)]
        keys += [subspace_key(manifest), contribution_key(manifest)]  # U versions and contributions too
        self._stage_keys = {DHTID.generate(source=key).to_bytes() for key in keys}

    def validate(self, record: DHTRecord) -> bool:
        if record.key not in self._stage_keys:
            return True
        try:
            value = MSGPackSerializer.loads(record.value)
        except Exception:  # noqa: BLE001 - the schema validator refuses what does not parse
            return False
        if value is None:
            return True
        claimed = value.get("peer_id") if isinstance(value, dict) else None
        return isinstance(claimed, str) and claimed == peer_id_of_owner(record.subkey or b"")

    @property
    def priority(self) -> int:
        return -10  # validated last: after the signature is checked and stripped

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, BoundPeerIdValidator)


def make_validators(manifest: Manifest, rsa_key: RSAPrivateKey) -> tuple[RSASignatureValidator, list]:
    """The signer of this peer's records (its subkey is the owner marker) and the validators its DHT node
    starts with: every node of the run checks what it is asked to store with the same three."""
    signer = RSASignatureValidator(rsa_key)
    schema = SchemaValidator(_run_schema(manifest), allow_extra_keys=True, prefix=manifest.run_id)
    return signer, [schema, signer, BoundPeerIdValidator(manifest)]
