"""The peer's signed record in the DHT: what it serves and how it is doing, re-announced every few seconds.

The record is what placement, routing, the subspace agreement and the tracker know of this peer; it
expires after `RECORD_TTL` unless re-announced, so a peer that vanishes drops out within that time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from hivemind.dht.crypto import RSASignatureValidator

from dhtio.records import announce
from peer.runtime import StageRuntime
from peer.stats import Stats
from swarm.manifest import Manifest
from swarm.records import ANNOUNCE_INTERVAL, SOFTWARE_VERSION, StagePeerRecord

logger = logging.getLogger("peer")


def stage_record(
    *,
    peer_id: str,
    state: str,
    stage: int,
    lane: int = 0,
    throughput: float,
    runtime: StageRuntime,
    stats: Stats,
    public_name: str,
    addrs: list[str],
    reachability: str = "",
    relay: str = "",
) -> StagePeerRecord:
    """This peer's record now. The losses of the trips completed since the last record are averaged into
    one (and the list started over); with none, the last reported loss is repeated."""
    subspace = runtime.stage.subspace
    losses = stats.losses
    loss = sum(losses) / len(losses) if losses else stats.last_loss
    stats.last_loss, stats.losses = loss, []
    return StagePeerRecord(
        peer_id=peer_id,
        state=state,
        stage=stage,
        throughput=float(throughput),
        lane=lane,
        load=stats.load,
        u_version=subspace.version,
        u_sha256=subspace.basis_sha256,
        t_fixed_sha256=subspace.t_fixed_sha256,
        software_version=SOFTWARE_VERSION,
        public_name=public_name[:64],
        addrs=addrs[:8],
        trips=stats.trips,
        tokens=stats.tokens,
        bytes_in=stats.bytes_in,
        bytes_out=stats.bytes_out,
        errors=sum(stats.errors.values()),
        loss=None if loss is None else float(loss),
        optimizer_epoch=runtime.epoch,
        state_sha256=runtime.state_sha256,
        state_hashes=list(runtime.state_hashes),
        loaded_state=runtime.loaded_state,
        served_states=list(runtime.served_states),
        trip_versions=[f"{v}:{n}" for v, n in sorted(stats.trip_versions.items())][-16:],
        mixed_trips=stats.mixed_trips,
        reachability=reachability,
        relay=relay,
    )


class Announcer:
    """Stores `describe()` under this peer's signed subkey, now and every `ANNOUNCE_INTERVAL` seconds."""

    def __init__(
        self,
        dht,
        manifest: Manifest,
        signer: RSASignatureValidator,
        describe: Callable[[], StagePeerRecord],
        label: Callable[[], str],
    ):
        self.dht, self.manifest, self.signer = dht, manifest, signer
        self.describe, self.label = describe, label

    async def announce_now(self, timeout: float | None = None) -> None:
        record = self.describe()
        try:
            await asyncio.wait_for(
                asyncio.to_thread(announce, self.dht, self.manifest, self.signer, record), timeout=timeout
            )
        except Exception as exc:  # noqa: BLE001 - the DHT may be briefly unreachable; retry next round
            logger.warning("%s announce failed: %s", self.label(), exc or type(exc).__name__)

    async def run(self) -> None:
        while True:
            await self.announce_now()
            await asyncio.sleep(ANNOUNCE_INTERVAL)
