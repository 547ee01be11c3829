"""Typed, owner-signed DHT records of a run (DESIGN.md §3).

Keys: `{run_id}_stage{i}` (one subkey per peer, the subkey carries the owner's RSA public key
so only that peer can write it) and `{run_id}_subspace` (U versions and per-stage contributions).
hivemind's `SchemaValidator` joins a prefix to a field name with '_', so the keys use '_' where
DESIGN.md wrote '.'. Values are checked with strict pydantic v1 types (hivemind's validator
refuses any record that would need a type conversion).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

import pydantic.v1 as pydantic
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from swarm.manifest import Manifest

PEER_STATES = ("joining", "online", "leaving")
RECORD_TTL = 30.0  # seconds a record lives unless re-announced
ANNOUNCE_INTERVAL = 5.0
SOFTWARE_VERSION = "0.1.0"

_Count = pydantic.conint(strict=True, ge=0)
_NonNegative = pydantic.confloat(strict=True, ge=0.0, allow_inf_nan=False)
_Hash = pydantic.constr(strict=True, max_length=64, regex=r"^[0-9a-f]*$")


class StagePeerRecord(pydantic.BaseModel):
    """What a peer says about itself; `public_name` is untrusted text and shown escaped."""

    peer_id: pydantic.constr(strict=True, min_length=1, max_length=128)
    state: pydantic.constr(strict=True, regex=r"^(joining|online|leaving)$")
    stage: _Count
    throughput: _NonNegative  # tokens/s this peer can serve
    load: _Count  # trips in flight
    u_version: _Count
    u_sha256: _Hash
    t_fixed_sha256: _Hash
    software_version: pydantic.constr(strict=True, max_length=32)
    public_name: pydantic.constr(strict=True, max_length=64)
    addrs: pydantic.conlist(pydantic.constr(strict=True, max_length=256), max_items=8)
    trips: _Count
    tokens: _Count
    bytes_in: _Count
    bytes_out: _Count
    errors: _Count
    loss: Optional[pydantic.confloat(strict=True, allow_inf_nan=False)]
    optimizer_epoch: _Count
    state_sha256: _Hash = ""  # hash of the stage's parameters at optimizer_epoch: peers of a stage agree
    # the last few "epoch:hash-prefix" pairs, so peers that announce at different moments can be compared
    state_hashes: pydantic.conlist(pydantic.constr(strict=True, max_length=48), max_items=16) = []
    # "epoch:hash-prefix" of the parameters as downloaded from the stage's peers when this peer joined
    # ("" if it started from the seed or a checkpoint): proof of what it joined with, kept for good
    loaded_state: pydantic.constr(strict=True, max_length=48) = ""
    # drivers: completed trips per U version ("version:count"), and trips whose hops disagreed on U
    trip_versions: pydantic.conlist(pydantic.constr(strict=True, max_length=48), max_items=16) = []
    mixed_trips: _Count = 0

    class Config:
        extra = pydantic.Extra.forbid


class SubspaceRecord(pydantic.BaseModel):
    """A peer's entry under `{run}_subspace` (kind "version": the U it serves, as float32 bytes, and the
    contributions it was computed from) or `{run}_ucontrib` (kind "contribution": its stage's d×k term
    for the update to `target_version`)."""

    kind: pydantic.constr(strict=True, regex=r"^(version|contribution)$")
    peer_id: pydantic.constr(strict=True, max_length=128)
    version: _Count
    target_version: _Count
    stage: _Count
    epoch: _Count
    terms: _Count
    u_sha256: _Hash
    contributors: pydantic.conlist(pydantic.constr(strict=True, max_length=128), max_items=256)
    data: pydantic.conbytes(strict=True, max_length=4 << 20)

    class Config:
        extra = pydantic.Extra.forbid


def _run_schema(manifest: Manifest) -> type[pydantic.BaseModel]:
    fields: dict[str, Any] = {
        f"stage{i}": (Optional[Dict[BytesWithPublicKey, Optional[StagePeerRecord]]], None)
        for i in range(manifest.num_stages)
    }
    fields["subspace"] = (Optional[Dict[BytesWithPublicKey, Optional[SubspaceRecord]]], None)
    fields["ucontrib"] = (Optional[Dict[BytesWithPublicKey, Optional[SubspaceRecord]]], None)
    return pydantic.create_model("RunRecords", **fields)


def stage_key(manifest: Manifest, stage: int) -> str:
    return f"{manifest.run_id}_stage{stage}"


def subspace_key(manifest: Manifest) -> str:
    return f"{manifest.run_id}_subspace"


def contribution_key(manifest: Manifest) -> str:
    return f"{manifest.run_id}_ucontrib"


def parse_subspace_entries(raw: Any) -> list[SubspaceRecord]:
    """Records under a subspace key; anything malformed is dropped."""
    if raw is None or not isinstance(getattr(raw, "value", None), dict):
        return []
    found = []
    for item in raw.value.values():
        value = getattr(item, "value", None)
        if isinstance(value, dict):
            try:
                found.append(SubspaceRecord.parse_obj(value))
            except pydantic.ValidationError:
                continue
    return found


def load_or_create_rsa_key(path: str | Path | None) -> RSAPrivateKey:
    """The key that signs this peer's records; persisted so a restart keeps its identity."""
    if path is None:
        return RSAPrivateKey()
    path = Path(path)
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    if path.exists():
        key.__setstate__({"_private_key": path.read_bytes()})
        return key
    key = RSAPrivateKey()
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # private from the first byte
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(key.to_bytes())
    return key


def make_validators(manifest: Manifest, rsa_key: RSAPrivateKey) -> tuple[RSASignatureValidator, list]:
    signer = RSASignatureValidator(rsa_key)
    return signer, [SchemaValidator(_run_schema(manifest), allow_extra_keys=True, prefix=manifest.run_id), signer]


@dataclass(frozen=True)
class PeerEntry:
    record: StagePeerRecord
    expiration: float
    owner: bytes  # the subkey: the owner's public key marker

    @property
    def seconds_left(self) -> float:
        return self.expiration - get_dht_time()


def parse_stage_entries(raw: Any) -> list[PeerEntry]:
    """Turn the value of a `{run}_stage{i}` key into peer entries; anything malformed is dropped."""
    if raw is None or not isinstance(getattr(raw, "value", None), dict):
        return []
    entries = []
    for subkey, item in raw.value.items():
        value = getattr(item, "value", None)
        if not isinstance(value, dict):
            continue
        try:
            record = StagePeerRecord.parse_obj(value)
            PeerID.from_base58(record.peer_id)  # a record nobody can dial is worthless to a router
        except (pydantic.ValidationError, ValueError):
            continue
        entries.append(PeerEntry(record=record, expiration=float(item.expiration_time), owner=subkey))
    return entries


def fetch_stages(dht, manifest: Manifest) -> dict[int, list[PeerEntry]]:
    """Every stage's live peer records (blocking; call from a thread in async code)."""
    found = {}
    for i in range(manifest.num_stages):
        found[i] = parse_stage_entries(dht.get(stage_key(manifest, i), latest=True, return_future=False))
    return found


def announce(
    dht, manifest: Manifest, signer: RSASignatureValidator, record: StagePeerRecord, ttl: float = RECORD_TTL
) -> bool:
    return bool(
        dht.store(
            stage_key(manifest, record.stage),
            subkey=signer.local_public_key,
            value=record.dict(),
            expiration_time=get_dht_time() + ttl,
            return_future=False,
        )
    )
