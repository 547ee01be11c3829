"""Agreeing on U across the swarm: publish contributions, commit a new version, switch, catch up.

Every `subspace_update_interval` optimizer epochs of its stage, a peer publishes its stage's
contribution for version v+1 under `{run}_ucontrib`. The coordinator — the online peer with the
smallest peer id among those at version v — waits until every stage has at least one contribution,
derives U' (swarm.subspace_update.next_basis, bit-reproducible) and publishes it under
`{run}_subspace` together with the list of contributions it used. Every other peer recomputes U'
from those same contribution records and switches only if the hash matches; when the records
have expired (a late joiner) it checks the published bytes against their hash instead. A switch
happens on the stage's worker thread between two microbatches, so it is never half applied; trips
still carrying version v are refused with the version error and retried by their driver.
Every peer keeps re-publishing the version it serves, so a peer that was away can catch up from
anyone.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging

import numpy as np
import torch
from hivemind.utils.timed_storage import get_dht_time

from swarm.records import (
    SubspaceRecord,
    contribution_key,
    parse_subspace_entries,
    subspace_key,
)
from swarm.subspace import tensor_sha256
from swarm.subspace_update import combine, matrix_from_bytes, matrix_to_bytes, next_basis

logger = logging.getLogger("peer.subspace")

VERSION_TTL = 3600.0
CONTRIBUTION_TTL = 600.0


class SubspaceSync:
    def __init__(self, daemon, poll_interval: float = 1.0):
        self.daemon = daemon
        self.poll_interval = poll_interval
        self.published_for: int | None = None  # target version we already contributed to
        self.rejected: set[str] = set()  # hashes of versions that failed verification
        self.last_contributors: list[str] = []  # the contributions behind the version we serve

    @property
    def manifest(self):
        return self.daemon.manifest

    @property
    def runtime(self):
        return self.daemon.runtime

    @property
    def version(self) -> int:
        return self.runtime.stage.subspace.version

    # --- DHT access (blocking calls run in a thread) -------------------------------------------

    async def _records(self, key: str) -> list[SubspaceRecord]:
        raw = await asyncio.to_thread(self.daemon.dht.get, key, True)
        return parse_subspace_entries(raw)

    async def _store(self, key: str, record: SubspaceRecord, ttl: float) -> None:
        await asyncio.to_thread(
            self.daemon.dht.store, key, record.dict(), get_dht_time() + ttl, self.daemon.signer.local_public_key
        )

    # --- switching ------------------------------------------------------------------------------

    def _verified_basis(self, commit: SubspaceRecord, contributions: list[SubspaceRecord]) -> np.ndarray | None:
        """U' from the commit, if it checks out: recomputed from its contributions when they are all
        still in the DHT, else its published bytes against its hash."""
        shape = self.manifest.model
        try:
            published = matrix_from_bytes(commit.data, shape.d_model, self.manifest.k)
        except ValueError as exc:
            logger.warning("%s ignoring U v%d: %s", self.daemon.label, commit.version, exc)
            return None
        if tensor_sha256(torch.from_numpy(published.copy())) != commit.u_sha256:
            logger.warning("%s ignoring U v%d: bytes do not match their hash", self.daemon.label, commit.version)
            return None
        used = {c.peer_id: c for c in contributions if c.target_version == commit.version}
        if commit.version == self.version + 1 and commit.contributors and all(p in used for p in commit.contributors):
            recomputed = self.derive([used[p] for p in commit.contributors])
            if recomputed is None or tensor_sha256(torch.from_numpy(recomputed.astype(np.float32))) != commit.u_sha256:
                logger.error(
                    "%s U v%d does not follow from its contributions; refusing it", self.daemon.label, commit.version
                )
                return None
        return published

    def derive(self, contributions: list[SubspaceRecord]) -> np.ndarray | None:
        """U' from a complete set of contributions (every stage that has terms), or None."""
        shape = self.manifest.model
        per_stage: dict[int, list[np.ndarray]] = {}
        for record in sorted(contributions, key=lambda c: (c.stage, c.peer_id)):
            try:
                per_stage.setdefault(record.stage, []).append(
                    matrix_from_bytes(record.data, shape.d_model, self.manifest.k)
                )
            except ValueError:
                return None
        needed = {s for s in range(self.manifest.num_stages) if self._stage_contributes(s)}
        if set(per_stage) != needed:
            return None
        current = self.runtime.stage.subspace.basis.detach().cpu().double().numpy()
        return next_basis(current, combine(per_stage), self.manifest.subspace_driver, self.manifest.subspace_step)

    async def apply(self, basis: np.ndarray, version: int) -> None:
        runtime = self.runtime
        tensor = torch.from_numpy(basis.astype(np.float32))
        await runtime.run(runtime.apply_basis, tensor, version)
        logger.info("%s switched to U v%d (%s)", self.daemon.label, version, runtime.stage.subspace.basis_sha256[:12])
        await self.daemon.announce_now()
        await self.publish_version()

    async def publish_version(self, contributors: list[str] | None = None) -> None:
        state = self.runtime.stage.subspace
        if state.version == 0:
            return
        record = SubspaceRecord(
            kind="version",
            peer_id=self.daemon.peer_id,
            version=state.version,
            target_version=state.version,
            stage=self.daemon.index,
            epoch=self.runtime.epoch,
            terms=0,
            u_sha256=state.basis_sha256,
            contributors=contributors if contributors is not None else self.last_contributors,
            data=matrix_to_bytes(state.basis.detach().cpu().double().numpy()),
        )
        await self._store(subspace_key(self.manifest), record, VERSION_TTL)

    async def catch_up(self) -> None:
        """Before serving: adopt the newest verified U the swarm publishes."""
        commits = [c for c in await self._records(subspace_key(self.manifest)) if c.version > self.version]
        for commit in sorted(commits, key=lambda c: (-c.version, c.peer_id)):
            basis = self._verified_basis(commit, [])
            if basis is not None:
                self.last_contributors = list(commit.contributors)
                await self.apply(basis, commit.version)
                logger.info("%s caught up to U v%d before serving", self.daemon.label, commit.version)
                return

    # --- the loop -------------------------------------------------------------------------------

    def _due(self) -> bool:
        interval = self.manifest.subspace_update_interval
        return self.runtime.epoch >= (self.version + 1) * interval

    async def step(self) -> None:
        target = self.version + 1
        commits = [
            c
            for c in await self._records(subspace_key(self.manifest))
            if c.version == target and c.u_sha256 not in self.rejected
        ]
        contributions = [c for c in await self._records(contribution_key(self.manifest)) if c.target_version == target]
        if commits:
            commit = min(commits, key=lambda c: c.peer_id)
            basis = self._verified_basis(commit, contributions)
            if basis is None:
                self.rejected.add(commit.u_sha256)
                return
            self.last_contributors = list(commit.contributors)
            await self.apply(basis, target)
            return
        accumulator = self.runtime.stage.u_accumulator
        if self._due() and self.published_for != target and accumulator is not None and accumulator.terms:
            mean = await self.runtime.run(accumulator.mean)
            record = SubspaceRecord(
                kind="contribution",
                peer_id=self.daemon.peer_id,
                version=self.version,
                target_version=target,
                stage=self.daemon.index,
                epoch=self.runtime.epoch,
                terms=accumulator.terms,
                u_sha256=self.runtime.stage.subspace.basis_sha256,
                contributors=[],
                data=matrix_to_bytes(mean),
            )
            await self._store(contribution_key(self.manifest), record, CONTRIBUTION_TTL)
            self.published_for = target
            logger.info(
                "%s published its contribution to U v%d (%d terms)", self.daemon.label, target, accumulator.terms
            )
        if self.is_coordinator():
            await self.try_commit(target, contributions)

    def is_coordinator(self) -> bool:
        peers = [
            e.record
            for entries in self.daemon.router.stages.values()
            for e in entries
            if e.record.state == "online" and e.record.u_version == self.version
        ]
        others = [r.peer_id for r in peers if r.peer_id != self.daemon.peer_id]
        return all(self.daemon.peer_id < other for other in others)

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
            return  # someone committed meanwhile: adopt theirs on the next round
        self.last_contributors = [c.peer_id for c in chosen]
        digest = hashlib.sha256(b"".join(c.data for c in chosen)).hexdigest()[:12]
        logger.info("%s committing U v%d from %d contributions (%s)", self.daemon.label, target, len(chosen), digest)
        await self.apply(basis.astype(np.float64), target)

    def _stage_contributes(self, stage: int) -> bool:
        """In subspace mode with the gradient driver the tail holds no constrained tensor."""
        manifest = self.manifest
        if manifest.compression == "subspace" and manifest.subspace_driver == "gradient":
            return stage < manifest.num_stages - 1
        if manifest.subspace_driver == "energy":
            return stage > 0
        return True

    async def run(self) -> None:
        await self.publish_version()
        while True:
            await asyncio.sleep(self.poll_interval)
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a DHT hiccup must not stop the peer
                logger.exception("%s subspace sync failed; retrying", self.daemon.label)
