"""What a lane trip's boundary message claims about the trip beyond its chunk, and the check of that claim.

Every boundary message of a lane trip (`peer/lane_trip.py`) carries its `LaneClaim` in the header's `extra`:
the lane, the group (S × P peer ids), the sequence length, the first token of the next chunk (the tail's last
target; none on the last lane) and, on an audited trip, its *audit fork*. `read_claim` checks it before any
compute, as decode checks the rest: shape, bounded strings, no peer twice in a stage, this peer named at (its
stage, its lane), and the sender named where it must be (the lane-c peer of the stage before, or a stage-0 peer
of the group for a chunk the driver hands to stage 0).

The audit fork is how lane peers are verified (issue 25). A pipeline hop audits its next peer by sending the
same message to a second one, but one lane hop cannot be duplicated alone: the duplicate's peer needs the other
lanes' K/V of the same trip. So the driver forks a whole stage: `audit = (s, peers, fork id)` makes every lane of
stage s-1 send its boundary message also to `peers[lane]`, as a second trip with the fork's own random id over
the same group with stage s replaced (`LaneClaim.forked`). Both messages leave stage s-1 without the audit
(`LaneClaim.onward`), so the audited peers cannot tell the trip from its fork, nor either from a trip that is not
audited. The peers of the fork exchange K/V among themselves, like any group; each lane of stage s-1 compares
the two replies it got, as a pipeline hop compares a duplicate's (`peer/next_hop.py`). Only the lanes whose fork
peer differs compare anything.

Limit: stages 0..s-2 carry the audit on, so they can tell that this trip audits a later stage, not them; a liar
there can lie on such trips (at most the fork rate of them) unseen, and must answer honestly on all others, where
it cannot tell whether it is audited. Hiding the fork from them needs it encrypted to the stage before it.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, replace

import torch

from swarm.manifest import Manifest
from swarm.wire import ErrorCode, WireError

MAX_PEER_ID = 128  # characters of one peer id in a claim (base58 ids are ~52)
TRIP_ID = re.compile(r"[0-9a-f]{32}")  # a fork's id looks like any trip's (`uuid4().hex`)

Group = tuple[tuple[str, ...], ...]  # group[stage][lane]: the peer serving it for this trip
Fork = tuple[int, tuple[str, ...], str]  # an audit fork: (stage s, one peer per lane of s, the fork's trip id)


@dataclass(frozen=True)
class LaneClaim:
    """What a lane trip's boundary message says about the trip beyond its chunk."""

    lane: int
    group: Group
    seq_len: int
    next_tokens: tuple[int, ...] | None  # the first token of the next chunk, per sequence (None: last lane)
    audit: Fork | None = None  # (stage s, one peer per lane, the fork's trip id): module docstring

    def extra(self) -> dict:
        extra = {
            "lane": self.lane,
            "group": [list(peers) for peers in self.group],
            "seq": self.seq_len,
            "next": None if self.next_tokens is None else list(self.next_tokens),
        }
        if self.audit is not None:
            extra["audit"] = [self.audit[0], list(self.audit[1]), self.audit[2]]
        return extra

    def forks_after(self, stage: int) -> bool:
        """Whether the lanes of `stage` fork this trip (the audit is of the stage after it)."""
        return self.audit is not None and self.audit[0] == stage + 1

    def onward(self, stage: int) -> LaneClaim:
        """The claim the lanes of `stage` send on: without the audit once it is theirs to carry out."""
        return replace(self, audit=None) if self.forks_after(stage) else self

    def forked(self, stage: int) -> tuple[LaneClaim, str] | None:
        """The claim and trip id of the audit fork that this trip's lane of `stage` sends, or None."""
        if not self.forks_after(stage):
            return None
        audited, peers, fork_id = self.audit
        group = tuple(peers if s == audited else others for s, others in enumerate(self.group))
        return replace(self, group=group, audit=None), fork_id


def new_fork(stage: int, peers: tuple[str, ...]) -> Fork:
    return stage, peers, uuid.uuid4().hex


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _peer_ids(value, lanes: int) -> bool:
    """A list of `lanes` bounded peer id strings (one stage's row of a group, or a fork's)."""
    return (
        isinstance(value, list)
        and len(value) == lanes
        and all(isinstance(p, str) and 0 < len(p) <= MAX_PEER_ID for p in value)
    )


def _read_audit(value, stages: int, lanes: int) -> Fork | None:
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 3 and _is_int(value[0]) and 1 <= value[0] < stages
            and _peer_ids(value[1], lanes) and len(set(value[1])) == lanes
            and isinstance(value[2], str) and TRIP_ID.fullmatch(value[2])):
        raise WireError(ErrorCode.MALFORMED, f"an audit fork names a stage in 1..{stages - 1}, {lanes} peers and an id")
    return value[0], tuple(value[1]), value[2]


def read_claim(
    extra: dict, manifest: Manifest, stage: int, lane: int, own_id: str, sender: str, tokens_shape: tuple[int, ...]
) -> LaneClaim:
    """The claim of a lane trip's forward message to lane `lane` of `stage` (this peer, `own_id`), from `sender`,
    whose chunk has `tokens_shape` (B, n); WireError with a code for anything off."""
    lanes, stages = manifest.lanes, manifest.num_stages
    group, seq, nxt, claimed = extra.get("group"), extra.get("seq"), extra.get("next"), extra.get("lane")
    shape_ok = isinstance(group, list) and len(group) == stages and all(_peer_ids(peers, lanes) for peers in group)
    if not shape_ok or not _is_int(claimed) or not _is_int(seq):
        raise WireError(ErrorCode.MALFORMED, f"a lane trip names its lane, sequence and {stages}×{lanes} peers")
    if any(len(set(peers)) != lanes for peers in group):
        raise WireError(ErrorCode.MALFORMED, "a lane trip names one peer twice in a stage")
    audit = _read_audit(extra.get("audit"), stages, lanes)
    if claimed != lane or group[stage][lane] != own_id:
        raise WireError(ErrorCode.WRONG_STAGE, f"trip is for lane {claimed}; this peer serves lane {lane} of {stage}")
    batch, chunk = tokens_shape
    if seq != chunk * lanes or seq > manifest.model.max_seq_len:
        raise WireError(ErrorCode.WRONG_SHAPE, f"sequence of {seq} is not {lanes} chunks of {chunk}")
    last = lane == lanes - 1
    if last:
        next_tokens = None
        if nxt is not None:
            raise WireError(ErrorCode.MALFORMED, "the last lane has no next chunk")
    else:
        vocab = manifest.model.vocab_size
        if not isinstance(nxt, list) or len(nxt) != batch or not all(_is_int(t) and 0 <= t < vocab for t in nxt):
            raise WireError(ErrorCode.BAD_TOKENS, f"the next chunk's first tokens: {batch} ids in [0, {vocab})")
        next_tokens = tuple(nxt)
    senders = group[0] if stage == 0 else [group[stage - 1][lane]]
    if sender not in senders:
        raise WireError(ErrorCode.UNKNOWN_SENDER, "the trip's group does not name the sender where it sent from")
    return LaneClaim(lane, tuple(tuple(peers) for peers in group), seq, next_tokens, audit)


def split_claims(tokens: torch.Tensor, group: Group, audit: Fork | None = None) -> list[tuple[LaneClaim, torch.Tensor]]:
    """The P chunks of `tokens` (B, L) and their claims: chunk c with the first token of chunk c+1."""
    lanes, seq = len(group[0]), tokens.shape[1]
    n = seq // lanes
    if n * lanes != seq:
        raise ValueError(f"a sequence of {seq} tokens is not {lanes} chunks")
    out = []
    for c in range(lanes):
        nxt = None if c == lanes - 1 else tuple(int(t) for t in tokens[:, (c + 1) * n])
        out.append((LaneClaim(c, group, seq, nxt, audit), tokens[:, c * n : (c + 1) * n]))
    return out
