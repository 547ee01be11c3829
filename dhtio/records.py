"""Reading and writing a run's records through a live hivemind DHT (blocking calls: from a thread), and
turning what a read returns into records that speak for their signers.

The schemas are `swarm.records`, the validators nodes store with `dhtio.validators`.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any

import pydantic.v1 as pydantic
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.timed_storage import get_dht_time

from dhtio.identity import peer_id_of_owner
from swarm.manifest import Manifest
from swarm.records import RECORD_TTL, PeerEntry, StagePeerRecord, SubspaceRecord, stage_key

# A store lands on the `num_replicas` (hivemind's default: 5) DHT nodes nearest to its key. Reading the latest
# value from the READ_BEAM nearest of them, merged, finds every record that reached a majority of them; hivemind's
# default beam (its bucket size, 20) asks every node of a small swarm, each answering with the whole stage.
READ_BEAM = 3
# A store first searches for the `num_replicas` nodes nearest to its key, and every node it asks answers with the
# key's whole value (all the stage's signed records) as well: hivemind's default beam (20) asks every node of a
# swarm of up to 20, this asks about as many as it stores to.
STORE_BEAM = 5


def fetch_stages(dht, manifest: Manifest, stages: Iterable[int] | None = None) -> dict[int, list[PeerEntry]]:
    """The live peer records of `stages` (default: every stage), the latest the DHT nodes nearest to each
    stage's key hold; only the stages asked for are keys of the result.

    One traversal for all the keys (a DHT request names several keys), not one per stage, and it asks the
    READ_BEAM nodes nearest to each key rather than every node it can find. The cost: a record that reached
    none of those nodes (they joined the DHT since its last store) is missed until its peer re-announces
    (`ANNOUNCE_INTERVAL`). Every node answers with every signed record of a stage, so a reader that needs
    only some stages (a peer routing to its neighbours) names them: the bytes grow with the stages read."""
    indices = sorted(set(range(manifest.num_stages) if stages is None else stages))
    keys = [stage_key(manifest, i) for i in indices]
    found = dht.run_coroutine(partial(_get_latest, keys), return_future=False) if keys else {}
    return {i: parse_stage_entries(found[key]) for i, key in zip(indices, keys, strict=True)}


async def _get_latest(keys: list[str], _dht, node) -> dict:
    """Run inside the DHT process: the latest value of every key from the READ_BEAM nodes nearest to it."""
    return await node.get_many(keys, sufficient_expiration_time=float("inf"), beam_size=READ_BEAM)


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
            beam_size=STORE_BEAM,
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


def parse_stage_entries(raw: Any) -> list[PeerEntry]:
    """Turn the value of a `{run}_stage{i}` key into peer entries; anything malformed, or naming another peer id
    than its signer's (a node may store without checking), is dropped."""
    if raw is None or not isinstance(getattr(raw, "value", None), dict):
        return []
    entries = []
    for subkey, item in raw.value.items():
        value = getattr(item, "value", None)
        if not isinstance(value, dict):
            continue
        try:
            record = StagePeerRecord.parse_obj(value)
        except pydantic.ValidationError:
            continue
        if record.peer_id != peer_id_of_owner(subkey if isinstance(subkey, bytes) else b""):
            continue  # signed by a key that is not this peer id's: it speaks for someone else
        entries.append(PeerEntry(record=record, expiration=float(item.expiration_time), owner=subkey))
    return entries


def parse_subspace_entries(raw: Any) -> list[SubspaceRecord]:
    """Records under a subspace key; anything malformed, or naming another peer id than its signer's, is dropped."""
    if raw is None or not isinstance(getattr(raw, "value", None), dict):
        return []
    found = []
    for subkey, item in raw.value.items():
        value = getattr(item, "value", None)
        if isinstance(value, dict):
            try:
                record = SubspaceRecord.parse_obj(value)
            except pydantic.ValidationError:
                continue
            if record.peer_id == peer_id_of_owner(subkey if isinstance(subkey, bytes) else b""):
                found.append(record)  # only records that speak for their signer
    return found
