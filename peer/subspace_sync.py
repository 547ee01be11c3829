"""Agreeing on U across the swarm: publish contributions, commit a new version, switch, catch up.

Every `subspace_update_interval` optimizer epochs of its stage, a peer publishes its stage's
contribution for version v+1 under `{run}_ucontrib`. The coordinator — the online peer with the
smallest peer id among those at version v — waits until every stage has at least one contribution,
derives U' (swarm.subspace_update.next_basis, bit-reproducible) and proposes it under
`{run}_subspace` together with the list of contributions it used. Every peer, the coordinator
included, adopts the proposal of the smallest peer id that it can recompute bit for bit from the
named contribution records (so two racing coordinators cannot split the swarm: both adopt the same
proposal). A peer that missed versions (it was away, or their contributions expired) adopts the
newest U that most online peers announce in their own signed stage records, after checking its
bytes against their hash and its orthonormality. A switch
happens on the stage's worker thread between two microbatches, so it is never half applied; trips
still carrying version v are refused with the version error and retried by their driver.
Every peer keeps re-publishing the version it serves, so a peer that was away can catch up from
anyone.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable

import numpy as np
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.timed_storage import get_dht_time

from dhtio.records import fetch_subspace_records, store_subspace_record
from peer.runtime import StageRuntime
from peer.trip import Hop
from swarm.manifest import Manifest
from swarm.records import PeerEntry, SubspaceRecord, contribution_key, subspace_key
from swarm.subspace import tensor_sha256
from swarm.subspace_update import basis_from_contributions, matrix_from_bytes, matrix_to_bytes

logger = logging.getLogger("peer.subspace")

VERSION_TTL = 3600.0
CONTRIBUTION_TTL = 600.0


def stage_member(stages: dict[int, list[PeerEntry]], stage: int, peer_id: str, now: float) -> bool:
    """Whether `peer_id` holds a live record of `stage` in `stages` (a fetch of the run's stage records)."""
    return any(e.record.peer_id == peer_id and e.expiration > now for e in stages.get(stage, []))


class SubspaceSync:
    """One peer's part in the agreement, for the stage `hop` serves; `announce` re-announces its record
    (with the new U version) after a switch."""

    def __init__(
        self,
        hop: Hop,
        dht,
        signer: RSASignatureValidator,
        peer_id: str,
        announce: Callable[[], Awaitable[None]],
        poll_interval: float = 1.0,
    ):
        self.hop, self.dht, self.signer, self.peer_id, self.announce = hop, dht, signer, peer_id, announce
        self.poll_interval = poll_interval
        self.published_for: int | None = None  # target version we already contributed to
        self.rejected: set[str] = set()  # hashes of versions that failed verification
        self.last_contributors: list[str] = []  # the contributions behind the version we serve

    @property
    def manifest(self) -> Manifest:
        return self.hop.manifest

    @property
    def runtime(self) -> StageRuntime:
        return self.hop.runtime

    @property
    def label(self) -> str:
        return self.hop.label

    @property
    def version(self) -> int:
        return self.runtime.stage.subspace.version

    # --- DHT access (blocking calls run in a thread) -------------------------------------------

    async def _records(self, key: str) -> list[SubspaceRecord]:
        return await asyncio.to_thread(fetch_subspace_records, self.dht, key)

    async def _store(self, key: str, record: SubspaceRecord, ttl: float) -> None:
        await asyncio.to_thread(store_subspace_record, self.dht, self.signer, key, record, ttl)

    def _record(
        self,
        kind: str,
        version: int,
        target_version: int,
        u_sha256: str,
        data: bytes,
        terms: int = 0,
        contributors: list[str] | None = None,
    ) -> SubspaceRecord:
        """A record of this peer's: it names this peer, its stage and the stage's current optimizer epoch."""
        return SubspaceRecord(
            kind=kind,
            peer_id=self.peer_id,
            version=version,
            target_version=target_version,
            stage=self.hop.index,
            epoch=self.runtime.epoch,
            terms=terms,
            u_sha256=u_sha256,
            contributors=contributors or [],
            data=data,
        )

    # --- switching ------------------------------------------------------------------------------

    def _published_basis(self, commit: SubspaceRecord) -> np.ndarray | None:
        """The commit's U bytes, if they match their hash and are orthonormal."""
        shape = self.manifest.model
        try:
            published = matrix_from_bytes(commit.data, shape.d_model, self.manifest.k)
        except ValueError as exc:
            logger.warning("%s ignoring U v%d: %s", self.label, commit.version, exc)
            return None
        if tensor_sha256(torch.from_numpy(published.copy())) != commit.u_sha256:
            logger.warning("%s ignoring U v%d: bytes do not match their hash", self.label, commit.version)
            return None
        gram = published.astype(np.float64).T @ published.astype(np.float64)
        if not np.abs(gram - np.eye(self.manifest.k)).max() < 1e-4:
            logger.warning("%s ignoring U v%d: not orthonormal", self.label, commit.version)
            return None
        return published

    def _recomputed_basis(self, commit: SubspaceRecord, contributions: list[SubspaceRecord]) -> np.ndarray | None:
        """The next version is adopted only if it follows, bit for bit, from the contributions it names."""
        used = {c.peer_id: c for c in contributions if c.target_version == commit.version}
        if not commit.contributors or not all(p in used for p in commit.contributors):
            return None  # not all of them visible yet: wait for the next round
        recomputed = self.derive([used[p] for p in commit.contributors])
        if recomputed is None or tensor_sha256(torch.from_numpy(recomputed.astype(np.float32))) != commit.u_sha256:
            logger.error("%s U v%d does not follow from its contributions; refusing it", self.label, commit.version)
            self.rejected.add(commit.u_sha256)
            return None
        return recomputed.astype(np.float32)

    def _endorsed(self, commit: SubspaceRecord) -> bool:
        """Catching up past versions whose contributions are gone: the bytes must be what most online
        peers at that version announce in their own signed stage records."""
        records = [
            e.record
            for entries in self.hop.router.stages.values()
            for e in entries
            if e.record.state == "online" and e.record.u_version == commit.version
        ]
        supporters = sum(r.u_sha256 == commit.u_sha256 for r in records)
        return supporters >= 1 and 2 * supporters > len(records)

    def derive(self, contributions: list[SubspaceRecord]) -> np.ndarray | None:
        """U' from a complete set of contributions (every stage that has terms), or None."""
        manifest = self.manifest
        per_stage: dict[int, list[bytes]] = {}
        for record in sorted(contributions, key=lambda c: (c.stage, c.peer_id)):
            per_stage.setdefault(record.stage, []).append(record.data)
        needed = {s for s in range(manifest.num_stages) if self._stage_contributes(s)}
        if set(per_stage) != needed:
            return None
        current = self.runtime.stage.subspace.basis.detach().cpu().double().numpy()
        try:
            return basis_from_contributions(current, per_stage, manifest.u_driver, manifest.subspace_step)
        except ValueError:
            return None

    async def apply(self, basis: np.ndarray, version: int) -> None:
        runtime = self.runtime
        tensor = torch.from_numpy(basis.astype(np.float32))
        await runtime.run(runtime.apply_basis, tensor, version)
        logger.info("%s switched to U v%d (%s)", self.label, version, runtime.stage.subspace.basis_sha256[:12])
        await self.announce()
        await self.publish_version()

    async def publish_version(self, contributors: list[str] | None = None) -> None:
        state = self.runtime.stage.subspace
        if state.version == 0:
            return
        record = self._record(
            "version",
            version=state.version,
            target_version=state.version,
            u_sha256=state.basis_sha256,
            data=matrix_to_bytes(state.basis.detach().cpu().double().numpy()),
            contributors=contributors if contributors is not None else self.last_contributors,
        )
        await self._store(subspace_key(self.manifest), record, VERSION_TTL)

    async def catch_up(self) -> bool:
        """Adopt the newest U that most online peers serve (before serving, or after missing switches)."""
        commits = [
            c
            for c in await self._records(subspace_key(self.manifest))
            if c.version > self.version and c.u_sha256 not in self.rejected
        ]
        for commit in sorted(commits, key=lambda c: (-c.version, c.peer_id)):
            if not self._endorsed(commit):
                continue
            basis = self._published_basis(commit)
            if basis is not None:
                self.last_contributors = list(commit.contributors)
                await self.apply(basis, commit.version)
                logger.info("%s caught up to U v%d", self.label, commit.version)
                return True
        return False

    # --- the loop -------------------------------------------------------------------------------

    def _due(self) -> bool:
        interval = self.manifest.subspace_update_interval
        return self.runtime.epoch >= (self.version + 1) * interval

    async def step(self) -> None:
        target = self.version + 1
        published = await self._records(subspace_key(self.manifest))
        if any(c.version > target for c in published) and await self.catch_up():
            return
        commits = [c for c in published if c.version == target and c.u_sha256 not in self.rejected]
        contributions = [
            c
            for c in await self._records(contribution_key(self.manifest))
            if c.target_version == target and self._stage_member(c)
        ]
        for commit in sorted(commits, key=lambda c: c.peer_id):
            if self._published_basis(commit) is None:
                self.rejected.add(commit.u_sha256)
                continue
            basis = self._recomputed_basis(commit, contributions)
            if basis is not None:
                self.last_contributors = list(commit.contributors)
                await self.apply(basis, target)
                return
        accumulator = self.runtime.stage.u_accumulator
        if self._due() and self.published_for != target and accumulator is not None and accumulator.terms:
            mean = await self.runtime.run(accumulator.mean)
            record = self._record(
                "contribution",
                version=self.version,
                target_version=target,
                u_sha256=self.runtime.stage.subspace.basis_sha256,
                data=matrix_to_bytes(mean),
                terms=accumulator.terms,
            )
            await self._store(contribution_key(self.manifest), record, CONTRIBUTION_TTL)
            self.published_for = target
            logger.info("%s published its contribution to U v%d (%d terms)", self.label, target, accumulator.terms)
        if self.is_coordinator():
            await self.try_commit(target, contributions)

    def _stage_member(self, contribution: SubspaceRecord) -> bool:
        """A contribution for stage s counts only from a peer with a live record of stage s (records are
        bound to their signer, so nobody can contribute for a stage it does not serve, or in another's name)."""
        return stage_member(self.hop.router.stages, contribution.stage, contribution.peer_id, get_dht_time())

    def is_coordinator(self) -> bool:
        peers = [
            e.record
            for entries in self.hop.router.stages.values()
            for e in entries
            if e.record.state == "online" and e.record.u_version == self.version
        ]
        others = [r.peer_id for r in peers if r.peer_id != self.peer_id]
        return all(self.peer_id < other for other in others)

    async def try_commit(self, target: int, contributions: list[SubspaceRecord]) -> None:
        valid = [
            c
            for c in contributions
            if c.version == self.version and c.u_sha256 == self.runtime.stage.subspace.basis_sha256
        ]
        stages = {c.stage for c in valid}
        needed = {s for s in range(self.manifest.num_stages) if self._stage_contributes(s)}
        if not needed <= stages:
            return
        chosen = sorted((c for c in valid if c.stage in needed), key=lambda c: (c.stage, c.peer_id))
        basis = self.derive(chosen)
        if basis is None:
            return
        if [c for c in await self._records(subspace_key(self.manifest)) if c.version == target]:
            return  # someone proposed meanwhile: everyone, us included, adopts a proposal in step()
        digest = hashlib.sha256(b"".join(c.data for c in chosen)).hexdigest()[:12]
        logger.info("%s proposing U v%d from %d contributions (%s)", self.label, target, len(chosen), digest)
        proposal = self._record(
            "version",
            version=target,
            target_version=target,
            u_sha256=tensor_sha256(torch.from_numpy(basis.astype(np.float32))),
            data=matrix_to_bytes(basis),
            contributors=[c.peer_id for c in chosen],
        )
        await self._store(subspace_key(self.manifest), proposal, VERSION_TTL)

    def _stage_contributes(self, stage: int) -> bool:
        manifest = self.manifest
        return manifest.u_driver.stage_contributes(manifest.mode, stage, manifest.num_stages)

    async def run(self) -> None:
        await self.publish_version()
        while True:
            await asyncio.sleep(self.poll_interval)
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a DHT hiccup must not stop the peer
                logger.exception("%s subspace sync failed; retrying", self.label)
