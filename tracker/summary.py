"""Pure logic of the tracker: turn fetched DHT records into the swarm summary.

Nothing here touches the network, a clock or a database, so every rule (what counts as online,
when the swarm is healthy, how much traffic compression saved) is unit-tested on plain
records. The service layer (`tracker.service`) fetches records, keeps last-seen times and
history, and hands everything to `summarize`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from swarm.manifest import Manifest
from swarm.records import (
    ANNOUNCE_INTERVAL,
    SOFTWARE_VERSION,
    PeerEntry,
    StagePeerRecord,
    claimed_throughput,
    plausible_loss_bound,
    plausible_throughput,
)
from tracker.loss import capped_weights, plausible_loss, weighted_median

# A peer re-announces every ANNOUNCE_INTERVAL (10 s) and its record lives RECORD_TTL (30 s): a record not
# refreshed for 25 s (two missed announces and half a period) is still alive, but its peer is in trouble and may be
# about to vanish.
DEFAULT_STALE_AFTER = 2.5 * ANNOUNCE_INTERVAL
# Seconds between the tracker's reads of every stage's records (each returns every signed record, issue 13): one
# read per announce, so a live peer is seen refreshed at least twice before DEFAULT_STALE_AFTER; the page lags the
# swarm by up to this.
POLL_INTERVAL = ANNOUNCE_INTERVAL
# Bounds on what one response may hold, whatever peers publish into the DHT.
MAX_PEERS_PER_STAGE = 256
MAX_PEERS_LISTED = 2048  # over all stages: a 32-stage run lists up to 64 peers per stage
MAX_WARNINGS = 200
# Tokens a peer is credited with: what its stage could do at `plausible_throughput` for as long as the tracker
# has seen it, plus this slack (a peer's counter starts before its first record reaches the tracker's poll:
# one announce period, one poll, and the seconds its first trips took).
TOKENS_SLACK_S = 60.0


@dataclass(frozen=True)
class PeerView:
    """A peer record as the tracker saw it: the record plus when the tracker last saw it refreshed."""

    record: StagePeerRecord
    expiration: float
    owner: bytes
    last_seen: float
    first_seen: float | None = None  # when the tracker first saw this owner's record; None: at `last_seen`

    @property
    def key(self) -> str:
        """A short stable id derived from the owner's signing key (the record's `peer_id` is only a claim)."""
        return owner_fingerprint(self.owner)


def owner_fingerprint(owner: bytes) -> str:
    return hashlib.sha256(owner).hexdigest()[:16]


def current_u_version(stages: Mapping[int, Sequence[PeerView | PeerEntry]]) -> int:
    """The highest U version any online peer runs; 0 when nobody is online (the manifest's v0)."""
    versions = [e.record.u_version for peers in stages.values() for e in peers if e.record.state == "online"]
    return max(versions, default=0)


def is_serving(record: StagePeerRecord, manifest: Manifest) -> bool:
    """Online, computing the run's function (a peer with another T_fixed cannot serve this run) on a lane the
    run has."""
    return (
        record.state == "online"
        and (not manifest.t_fixed_sha256 or record.t_fixed_sha256 == manifest.t_fixed_sha256)
        and record.lane < manifest.lanes
    )


def boundary_directions(stage: int, num_stages: int) -> int:
    """How many boundary messages a stage sends per token: activations forward, gradients back."""
    return int(stage < num_stages - 1) + int(stage > 0)


def peer_warnings(
    view: PeerView, manifest: Manifest, u_version: int, now: float, stale_after: float
) -> list[dict[str, Any]]:
    """What is wrong with one peer, judged against the manifest and the swarm's current U version."""
    record, out = view.record, []
    where = dict(stage=record.stage, peer=view.key)
    if manifest.t_fixed_sha256 and record.t_fixed_sha256 != manifest.t_fixed_sha256:
        out.append(
            dict(
                level="error",
                code="t_fixed_mismatch",
                **where,
                message="T_fixed hash differs from the manifest: this peer computes another function",
            )
        )
    if record.u_version == 0 and manifest.u_sha256 and record.u_sha256 != manifest.u_sha256:
        out.append(dict(level="error", code="u_hash_mismatch", **where, message="U v0 hash differs from the manifest"))
    if record.state == "online" and record.u_version < u_version:
        out.append(
            dict(
                level="warning",
                code="u_version_behind",
                **where,
                message=f"runs U v{record.u_version}, the swarm is at v{u_version}",
            )
        )
    if record.lane >= manifest.lanes:
        last = manifest.lanes - 1
        out.append(
            dict(level="error", code="bad_lane", **where, message=f"claims lane {record.lane}, the run has 0..{last}")
        )
    if record.software_version != SOFTWARE_VERSION:
        out.append(
            dict(
                level="info",
                code="software_version",
                **where,
                message=f"software version differs from the tracker's {SOFTWARE_VERSION}",
            )
        )
    if now - view.last_seen > stale_after:
        out.append(
            dict(
                level="warning",
                code="stale_peer",
                **where,
                message=f"record not refreshed for {now - view.last_seen:.0f}s",
            )
        )
    return out


def peer_summary(view: PeerView, now: float, manifest: Manifest | None = None) -> dict[str, Any]:
    """One peer's row. Its numbers are what it claims of itself; `throughput` is that claim clamped to
    what the stage's arithmetic allows on any hardware (`swarm.records.plausible_throughput`), also
    given as `claimed_throughput`, with the unclamped claim in `claimed_throughput_raw`."""
    r = view.record
    claim = claimed_throughput(r, manifest) if manifest is not None else r.throughput
    return dict(
        key=view.key,
        peer_id=r.peer_id,
        public_name=r.public_name,
        state=r.state,
        throughput=claim,
        claimed_throughput=claim,
        claimed_throughput_raw=r.throughput,
        load=r.load,
        lane=r.lane,
        u_version=r.u_version,
        u_sha256=r.u_sha256,
        t_fixed_sha256=r.t_fixed_sha256,
        software_version=r.software_version,
        trips=r.trips,
        tokens=r.tokens,
        bytes_in=r.bytes_in,
        bytes_out=r.bytes_out,
        errors=r.errors,
        loss=r.loss,
        optimizer_epoch=r.optimizer_epoch,
        reachability=r.reachability,  # "direct", "via relay", "unreachable", "" (not reported)
        relay=r.relay,  # the peer id of the relay that carries its trips ("" when none)
        last_seen=view.last_seen,
        seconds_since_seen=max(0.0, now - view.last_seen),
        expires_in=max(0.0, view.expiration - now),
    )


def credited_tokens(claimed: int, bound: float, seen_for: float, slack: float = TOKENS_SLACK_S) -> int:
    """The tokens the tracker counts for a peer claiming `claimed`: at most what a peer of its stage could
    have trained at `bound` tokens/s (`plausible_throughput`) in the `seen_for` seconds the tracker has seen
    it, plus `slack` seconds. A record claiming 1e18 tokens is counted as at most ~a minute of the fastest
    plausible hardware; an honest peer is far below the bound (2 PFLOP/s), so its count is unchanged, except
    that a peer that trained long before the tracker started is counted from then on."""
    return int(max(0, min(claimed, bound * max(0.0, seen_for + slack))))


def peer_counters(view: PeerView, manifest: Manifest, stage: int, bound: float, now: float) -> dict[str, int]:
    """What one record counts towards the run's counters: its credited tokens at stage 0 (every trip starts
    there, `credited_tokens`), the boundary bytes it sent, and what its credited tokens would have cost
    uncompressed across the boundaries its stage sends over."""
    first_seen = view.last_seen if view.first_seen is None else view.first_seen
    tokens = credited_tokens(view.record.tokens, bound, now - first_seen)
    directions = boundary_directions(stage, manifest.num_stages)
    return dict(
        tokens_trained=tokens if stage == 0 else 0,
        bytes_sent=max(0, view.record.bytes_out),
        dense_equivalent_bytes=tokens * manifest.dense_bytes_per_token() * directions,
    )


def run_counters(
    manifest: Manifest, stages: Mapping[int, Sequence[PeerView]], now: float
) -> dict[str, dict[str, int]]:
    """{peer key: `peer_counters`} for every record of a stage the manifest has (what `tracker.counters`
    accumulates into the run's totals)."""
    return {
        v.key: peer_counters(v, manifest, i, plausible_throughput(manifest, i), now)
        for i in range(manifest.num_stages)
        for v in stages.get(i, ())
    }


def peers_listed_per_stage(num_stages: int) -> int:
    """How many peers a stage lists in full (the best first); the rest are only counted."""
    return max(8, min(MAX_PEERS_PER_STAGE, MAX_PEERS_LISTED // max(1, num_stages)))


def summarize(
    manifest: Manifest,
    stages: Mapping[int, Sequence[PeerView]],
    now: float,
    *,
    stale_after: float = DEFAULT_STALE_AFTER,
    polled: bool = True,
    run_totals: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The swarm summary served by `/api/v1/swarm` (minus history), the page and `/metrics`.

    `healthy` holds only when every stage has a serving peer (online, right T_fixed, a lane the run has) on
    every lane: a trip needs every stage, and with context parallelism (P = `lanes` > 1) every lane of each, so
    one empty stage or lane stops training for the whole swarm. With P > 1 a stage row lists its `lanes` (serving
    peers and throughput of each) and its `empty_lanes`.
    Totals: `capacity_tokens_per_s` is the pipeline's bottleneck (the weakest stage's throughput: the summed
    throughput of its weakest lane, as its peers claim it,
    each claim clamped to `throughput_bound`: see `peer_summary`);
    `tokens_trained` sums the stage-0 drivers' counters (every trip starts there), each clamped to what
    plausible hardware could have done while the tracker saw it (`credited_tokens`); `loss` is the
    weighted median of the online drivers' losses within the plausible bound (`plausible_loss_bound`),
    weighted by credited tokens capped at the typical driver's (`capped_weights`), so one record claiming
    1e18 tokens at loss 0.01 sets neither number;
    `dense_equivalent_bytes` is what the same tokens would have cost uncompressed across the same
    boundaries, so `bytes_sent / dense_equivalent_bytes` is the achieved compression.
    Those three counters are summed over the records online now in `online`; in `totals` they are the
    run's (`run_totals`, accumulated by `tracker.counters` and never decreasing when a peer leaves), or
    the online sums when no run totals are given.
    """
    u_version = current_u_version(stages)
    warnings: list[dict[str, Any]] = []
    if not polled:
        warnings.append(
            dict(
                level="warning",
                code="no_data",
                stage=None,
                peer=None,
                message="the tracker has not read the DHT yet",
            )
        )
    dense_per_token = manifest.dense_bytes_per_token()
    stage_rows, bytes_sent, dense_bytes, capacity = [], 0, 0, []
    tokens_trained, losses = 0, []
    per_stage = peers_listed_per_stage(manifest.num_stages)
    loss_bound = plausible_loss_bound(manifest)
    lanes = manifest.lanes
    for i in range(manifest.num_stages):
        bound = plausible_throughput(manifest, i)
        views = sorted(
            stages.get(i, ()), key=lambda v: (v.record.state != "online", -min(v.record.throughput, bound), v.key)
        )
        serving = [v for v in views if is_serving(v.record, manifest)]
        online = [v for v in views if v.record.state == "online"]
        lane_peers = [[v for v in serving if v.record.lane == lane] for lane in range(lanes)]
        lane_capacity = [sum(claimed_throughput(v.record, manifest) for v in group) for group in lane_peers]
        stage_capacity = min(lane_capacity)
        capacity.append(stage_capacity)
        for v in views:
            counts = peer_counters(v, manifest, i, bound, now)
            bytes_sent += counts["bytes_sent"]
            dense_bytes += counts["dense_equivalent_bytes"]
            warnings.extend(peer_warnings(v, manifest, u_version, now, stale_after))
            if i == 0:
                tokens_trained += counts["tokens_trained"]
                if v.record.state == "online" and plausible_loss(v.record.loss, loss_bound):
                    losses.append((v.record.loss, max(counts["tokens_trained"], 1)))
        if not serving:
            warnings.append(
                dict(
                    level="error",
                    code="empty_stage",
                    stage=i,
                    peer=None,
                    message=f"stage {i} has no online peer: training is stalled",
                )
            )
        empty_lanes = [lane for lane, group in enumerate(lane_peers) if not group]
        for lane in empty_lanes if serving else ():
            message = f"lane {lane} of stage {i} has no online peer: no trip can cross the stage"
            warnings.append(dict(level="error", code="empty_lane", stage=i, peer=None, message=message))
        spec = manifest.stages[i]
        stage_rows.append(
            dict(
                stage=i,
                layers=[spec.first_layer, spec.end_layer],
                peers_total=len(views),
                peers_online=len(online),
                peers_serving=len(serving),
                # drivers audit a peer's replies against a second serving peer of its stage (with lanes: of its
                # lane, by audit forks, peer/lane_claim.py); a lone one is trusted on first use
                audited=all(len(group) >= 2 for group in lane_peers),
                throughput=stage_capacity,  # claimed by its peers, each claim clamped to the bound
                claimed_throughput=stage_capacity,
                throughput_bound=bound,
                load=sum(v.record.load for v in views),
                peers=[peer_summary(v, now, manifest) for v in views[:per_stage]],
                peers_omitted=max(0, len(views) - per_stage),
            )
        )
        if lanes > 1:
            stage_rows[-1]["lanes"] = [
                dict(lane=lane, peers_serving=len(group), throughput=total, empty=not group)
                for lane, (group, total) in enumerate(zip(lane_peers, lane_capacity, strict=True))
            ]
            stage_rows[-1]["empty_lanes"] = empty_lanes
    healthy = polled and all(row["peers_serving"] > 0 and not row.get("empty_lanes") for row in stage_rows)
    loss = weighted_median(capped_weights(losses))
    online = dict(tokens_trained=tokens_trained, bytes_sent=bytes_sent, dense_equivalent_bytes=dense_bytes)
    run = {name: int(run_totals.get(name, 0)) for name in online} if run_totals is not None else online
    return dict(
        run_id=manifest.run_id,
        time=now,
        healthy=healthy,
        u_version=u_version,
        lanes=lanes,
        stages=stage_rows,
        totals=dict(
            peers=sum(r["peers_total"] for r in stage_rows),
            peers_online=sum(r["peers_online"] for r in stage_rows),
            capacity_tokens_per_s=min(capacity) if capacity else 0.0,
            **run,
            compression_ratio=(run["bytes_sent"] / run["dense_equivalent_bytes"])
            if run["dense_equivalent_bytes"]
            else None,
            manifest_bytes_ratio=manifest.compressed_bytes_per_token() / dense_per_token,
            loss=loss,
        ),
        online=online,
        warnings=warnings[:MAX_WARNINGS],
        warnings_omitted=max(0, len(warnings) - MAX_WARNINGS),
    )


def track_last_seen(
    previous: Mapping[bytes, tuple[float, float, float]], entries: Iterable[PeerEntry], now: float
) -> dict[bytes, tuple[float, float, float]]:
    """Update {owner: (expiration, last_seen, first_seen)}: a record counts as seen when its expiration moved.

    A peer refreshes its record by re-announcing with a new expiration, so an unchanged
    expiration means no news from that peer since the last poll. `first_seen` is when the tracker
    first saw the owner (the time its token claims are clamped over, `credited_tokens`). Owners whose
    records vanished are dropped, which keeps the map as small as the swarm (a peer that comes back
    starts over).
    """
    out = {}
    for entry in entries:
        old = previous.get(entry.owner)
        first = now if old is None else old[2]
        if old is not None and old[0] == entry.expiration:
            out[entry.owner] = (old[0], old[1], first)
        else:
            out[entry.owner] = (entry.expiration, now, first)
    return out


def history_sample(summary: Mapping[str, Any]) -> dict[str, Any]:
    """The row a poll adds to the history: what the charts plot over time."""
    totals = summary["totals"]
    return dict(
        time=summary["time"],
        loss=totals["loss"],
        capacity=totals["capacity_tokens_per_s"],
        tokens=totals["tokens_trained"],
        peers=totals["peers_online"],
        bytes_sent=totals["bytes_sent"],
    )
