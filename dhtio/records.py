"""Reading and writing a run's records through a live hivemind DHT (blocking calls: from a thread).

The schemas, the validators and the parsing of what comes back are `swarm.records`; this module
only moves records in and out of the DHT.
"""

from __future__ import annotations

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.timed_storage import get_dht_time

from swarm.manifest import Manifest
from swarm.records import (
    RECORD_TTL,
    PeerEntry,
    StagePeerRecord,
    SubspaceRecord,
    parse_stage_entries,
    parse_subspace_entries,
    stage_key,
)


def fetch_stages(dht, manifest: Manifest) -> dict[int, list[PeerEntry]]:
    """Every stage's live peer records."""
    found = {}
    for i in range(manifest.num_stages):
        found[i] = parse_stage_entries(dht.get(stage_key(manifest, i), latest=True, return_future=False))
    return found


def announce(
    dht, manifest: Manifest, signer: RSASignatureValidator, record: StagePeerRecord, ttl: float = RECORD_TTL
) -> bool:
    """Store this peer's stage record under its own signed subkey; whether the DHT accepted it."""
    return bool(
        dht.store(
            stage_key(manifest, record.stage),
            subkey=signer.local_public_key,
            value=record.dict(),
            expiration_time=get_dht_time() + ttl,
            return_future=False,
        )
    )


def fetch_subspace_records(dht, key: str) -> list[SubspaceRecord]:
    """The records under a subspace key (`swarm.records.subspace_key` or `contribution_key`)."""
    return parse_subspace_entries(dht.get(key, latest=True, return_future=False))


def store_subspace_record(dht, signer: RSASignatureValidator, key: str, record: SubspaceRecord, ttl: float) -> bool:
    """Store a subspace record under this peer's signed subkey of `key`."""
    return bool(
        dht.store(
            key,
            record.dict(),
            get_dht_time() + ttl,
            subkey=signer.local_public_key,
            return_future=False,
        )
    )
