"""Schema-valid stage records for tests that need a swarm's worth of them without running peers."""

from __future__ import annotations

from swarm.manifest import Manifest
from swarm.presets import preset
from swarm.records import SOFTWARE_VERSION, StagePeerRecord

TINY = preset("tiny", stages=3)


def stage_record(stage: int, name: str = "peer", manifest: Manifest = TINY, **changes) -> StagePeerRecord:
    """An idle, online peer of `stage` at U v0 of `manifest`; keyword arguments replace fields."""
    fields = dict(
        peer_id=f"12D3Koo-{stage}-{name}",
        state="online",
        stage=stage,
        throughput=100.0,
        load=0,
        u_version=0,
        u_sha256=manifest.u_sha256,
        t_fixed_sha256=manifest.t_fixed_sha256,
        software_version=SOFTWARE_VERSION,
        public_name=name,
        addrs=[],
        trips=0,
        tokens=0,
        bytes_in=0,
        bytes_out=0,
        errors=0,
        loss=None,
        optimizer_epoch=0,
    )
    fields.update(changes)
    return StagePeerRecord(**fields)
