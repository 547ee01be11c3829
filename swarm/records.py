"""Typed, owner-signed DHT records of a run (DESIGN.md §3).

Keys: `{run_id}_stage{i}` (one subkey per peer, the subkey carries the owner's RSA public key
so only that peer can write it), `{run_id}_subspace` (U versions) and `{run_id}_ucontrib` (per-stage
contributions to the next U).
hivemind's `SchemaValidator` joins a prefix to a field name with '_', so the keys use '_' where
DESIGN.md wrote '.'. Values are checked with strict pydantic v1 types (hivemind's validator
refuses any record that would need a type conversion).

This module is the records and their rules only, without hivemind: importing any hivemind module loads
its DHT node and P2P daemon, and `swarm` stays importable without them (tests/test_layering.py). The
validators DHT nodes check stores with are `dhtio/validators.py`, the signing keys and the peer id of a
key `dhtio/identity.py`, and the parsing of what a DHT read returns `dhtio/records.py`.

A record speaks only for its signer. A stage record is signed by an RSA key (the subkey carries
its public key) and names a libp2p `peer_id`; a peer signs its records with its libp2p identity
key itself (hivemind identities are RSA), so the two are one key and the binding is checkable by
anyone: `peer_id` must be the libp2p id derived from the signer's public key. `BoundPeerIdValidator`
refuses any other stage record at storage, and `parse_stage_entries` drops it on reading (against
nodes that store without checking; both in `dhtio`). So a record signed with key B cannot name peer A:
at most one signer, A's own key, can ever publish records under A's id, and a record cannot move trips,
placement or the tracker's numbers onto a peer that did not write it. (Dialling is authenticated
by libp2p as well: a trip sent to a `peer_id` reaches only the holder of that id.)

What a record *claims* about itself (throughput, trips, epochs) stays a claim: `plausible_throughput`
bounds a throughput claim by what the stage's arithmetic allows on any hardware (see there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import multihash
import pydantic.v1 as pydantic

from swarm.manifest import Manifest

PEER_STATES = ("joining", "online", "leaving")
RECORD_TTL = 30.0  # seconds a record lives unless re-announced: three announces, so it survives two missed ones
# Seconds between a peer's announces. Each announce is a DHT search and a signed store of ~1.8 KB to several
# nodes (issue 13); how soon a dead peer stops counting is each reader's own window (e.g. placement's liveness).
ANNOUNCE_INTERVAL = 10.0
# 0.2.0: records are bound to their signer (the `peer_id` of a stage, subspace or contribution record must be
# the libp2p id of the key that signed it, `BoundPeerIdValidator`). Records signed the old way (a separate
# record key, or naming another id) are refused by peers of this version: a swarm mixing 0.1.0 and 0.2.0 peers
# does not see the old peers' records.
# 0.3.0: a backward reply's header carries the epoch of each hop's weights (`epochs`, beside `versions`); a reply
# without it is refused as malformed, so 0.2.0 and 0.3.0 peers cannot carry each other's trips (the tracker
# flags a peer whose version differs from its own; peers route around it, `speaks_our_wire`).
SOFTWARE_VERSION = "0.3.0"

_Count = pydantic.conint(strict=True, ge=0)
_NonNegative = pydantic.confloat(strict=True, ge=0.0, allow_inf_nan=False)
_Hash = pydantic.constr(strict=True, max_length=64, regex=r"^[0-9a-f]*$")


def is_peer_id(text: str) -> bool:
    """Whether `text` is a libp2p peer id as hivemind spells one: the base58 of a multihash, written the one
    way base58 writes those bytes. The same check as hivemind's `PeerID.from_base58` and `to_base58` (both are
    plain base58), spelled with the multihash package because importing hivemind loads its networking
    (tests/test_records.py compares the two)."""
    try:
        raw = multihash.from_b58_string(text)
        multihash.decode(raw)  # a peer id is a multihash of the public key
    except Exception:  # noqa: BLE001 - base58 or multihash errors alike
        return False
    return multihash.to_b58_string(raw) == text


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
    # "epoch:hash-prefix" of the last states this peer served joiners, each hashed from the copy it sent (a state
    # it held): a joiner's loaded_state is found here, however many epochs the donor stepped before announcing
    served_states: pydantic.conlist(pydantic.constr(strict=True, max_length=48), max_items=4) = []
    # drivers: completed trips per U version ("version:count"), and trips whose hops disagreed on U
    trip_versions: pydantic.conlist(pydantic.constr(strict=True, max_length=48), max_items=16) = []
    mixed_trips: _Count = 0
    # how the swarm reaches this peer (peer/reachability.py): "direct", "via relay", "unreachable", or "" when
    # not yet known. Compatibility: a record without it (an older peer) reads as ""; peers older than this
    # field refuse records that carry it (extra fields are forbidden), as with every field added since 0.2.0.
    reachability: pydantic.constr(strict=True, regex=r"^(|direct|via relay|unreachable)$") = ""
    # the chunk of every sequence this peer holds when the run splits sequences over a stage's peers (the
    # manifest's context_parallel.size P > 1): a lane in [0, P); 0 when context parallelism is off. A claim like
    # any other: readers drop a record whose lane is not below the run's P (peer/lanes.py).
    lane: _Count = 0
    # the peer id of the relay that carries trips to this peer (peer/relay.py) when it is not directly reachable
    # ("" when it is, or relays none). A claim: a sender only ever asks that relay to reach this peer id, and the
    # relay opens the stream to it over the peer's own authenticated connection.
    relay: pydantic.constr(strict=True, max_length=128) = ""

    @pydantic.validator("relay")
    def _relay_is_a_peer_id(cls, value: str) -> str:  # noqa: N805 - pydantic's validator signature
        if value and not is_peer_id(value):
            raise ValueError("relay is not a canonical peer id")
        return value

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


def stage_key(manifest: Manifest, stage: int) -> str:
    return f"{manifest.run_id}_stage{stage}"


def subspace_key(manifest: Manifest) -> str:
    return f"{manifest.run_id}_subspace"


def contribution_key(manifest: Manifest) -> str:
    return f"{manifest.run_id}_ucontrib"


# --- plausibility of claims -----------------------------------------------------------------------

# A generous ceiling on what one peer's hardware does: 2 PFLOP/s is about a dense bf16 H100 SXM
# (~1 PFLOP/s) twice over, so no honest volunteer gets near it on one stage.
HARDWARE_FLOPS_CEILING = 2e15


def stage_flops_per_token(manifest: Manifest, stage: int) -> float:
    """A lower bound on the FLOPs one token costs a stage for forward + backward: 6 × the stage's
    matrix parameters (attention projections, SwiGLU, the LM head on the tail) plus causal attention
    scores (6 × seq_len × d_model per layer). Embedding look-ups, norms and projections onto U are left
    out, so the bound errs on the generous side."""
    shape = manifest.model
    d, head = shape.d_model, shape.d_model // shape.n_heads
    attention = 2 * d * d + 2 * d * head * shape.n_kv_heads
    per_layer = attention + 3 * d * shape.d_ff
    params = len(manifest.layers_of(stage)) * per_layer
    if stage == manifest.num_stages - 1:
        params += d * shape.vocab_size
    scores = len(manifest.layers_of(stage)) * 6 * manifest.batch.seq_len * d
    return 6.0 * params + scores


def plausible_throughput(manifest: Manifest, stage: int) -> float:
    """The most tokens/s a peer of `stage` can serve: HARDWARE_FLOPS_CEILING over the stage's FLOPs per
    token (e.g. 4.3e8 for the one-layer middle stage of the 3-stage tiny preset, 3.6e5 for a 4-layer stage of
    the 8b preset over 8 stages)."""
    return HARDWARE_FLOPS_CEILING / max(stage_flops_per_token(manifest, stage), 1.0)


def claimed_throughput(record: StagePeerRecord, manifest: Manifest) -> float:
    """A record's throughput claim, clamped to the plausible bound of its stage."""
    stage = min(record.stage, manifest.num_stages - 1)
    return min(record.throughput, plausible_throughput(manifest, stage))


def plausible_loss_bound(manifest: Manifest) -> float:
    """The largest next-token loss a trip may report: a model no better than uniform scores ln(V); an
    honest, badly trained one may be over-confident and wrong by a few times that, never by more than
    2·ln(V) + 10 nats (e.g. 21.1 for V = 256, 31.6 for V = 50304). Negative or larger is a lie or a bug."""
    return 2.0 * math.log(manifest.model.vocab_size) + 10.0


@dataclass(frozen=True)
class PeerEntry:
    record: StagePeerRecord
    expiration: float
    owner: bytes  # the subkey: the owner's public key marker


def speaks_our_wire(software_version: str) -> bool:
    """Whether a peer of `software_version` carries our trips: a release before 1.0 changes the wire at each minor
    version (0.2 and 0.3 refuse each other's replies), so the major and minor must match ours. A claim only: a
    peer that claims ours and sends another wire is refused reply by reply, as any malformed one."""
    ours = SOFTWARE_VERSION.split(".")[:2]
    return software_version.split(".")[:2] == ours


def usable_peer(record: StagePeerRecord, t_fixed_sha256: str, own_peer_id: str) -> bool:
    """Online, serving our `T_fixed`, on our wire, and not ourselves: a peer to send trips to (one at another
    `T_fixed` could not decode what we send; one of another release would be banned for replies it cannot help
    sending malformed)."""
    return (record.state == "online" and record.t_fixed_sha256 == t_fixed_sha256
            and speaks_our_wire(record.software_version) and record.peer_id != own_peer_id)
