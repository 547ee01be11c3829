"""U moves during training: the same U bytes everywhere, no trip mixes versions, late peers catch up."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from harness import entries_by_name, online, swarm_of, wait_for

from swarm.presets import preset
from swarm.simulate import simulate


@pytest.mark.parametrize(
    "compression,driver", [("subspace", "gradient"), ("boundary", "gradient"), ("subspace", "energy")]
)
def test_simulated_updates_keep_reconstruction_exact(compression, driver):
    manifest = preset(
        "tiny", stages=3, compression=compression, subspace_update_interval=2, wire_dtype="fp32", subspace_driver=driver
    )
    result = simulate(manifest, steps=6, val_batches=1)
    assert result.u_version == 3
    assert [u["u_version"] for u in result.subspace_updates] == [1, 2, 3]
    assert len({u["u_sha256"] for u in result.subspace_updates} | {manifest.u_sha256}) == 4  # it really moved
    for update in result.subspace_updates:
        assert update["same_u_on_every_stage"]
        assert update["reconstruction_error_fp32"] < 1e-5
        assert update["max_subspace_residual"] < 1e-5
    assert result.max_reconstruction_error < 1e-5  # through the fp32 wire, after the switches too
    assert result.val_loss_last < result.val_loss_first


@pytest.mark.slow
def test_swarm_update_under_traffic_and_a_late_peer_catches_up():
    manifest = preset("tiny", stages=3, subspace_update_interval=6)
    with swarm_of(manifest, name="subspace-updates", extra_peer_args=["--max-inflight", "4"]) as swarm:
        for name, stage in (("s0", "0"), ("s1", "1"), ("late", "1"), ("s2", "2")):
            swarm.spawn_peer(name, stage)
        wait_for(lambda: online(swarm, ["s0", "s1", "late", "s2"]), 150, "four peers online")
        late = next(c for c in swarm.children if c.name == "late")
        late.process.send_signal(signal.SIGTERM)  # away before the first update
        late.process.wait(timeout=60)

        def all_at_least(version: int):
            peers = entries_by_name(swarm)
            names = ["s0", "s1", "s2"]
            return all(n in peers and peers[n].record.u_version >= version for n in names) and peers

        wait_for(lambda: all_at_least(2), 300, "two U updates on every stage", interval=0.5)

        def agreed():
            peers = entries_by_name(swarm)
            records = [peers[n].record for n in ("s0", "s1", "s2")]
            return len({(r.u_version, r.u_sha256) for r in records}) == 1 and records

        records = wait_for(agreed, 60, "every stage to serve the same U bytes", interval=0.5)
        assert records[0].u_sha256 != manifest.u_sha256
        driver = entries_by_name(swarm)["s0"].record
        assert driver.mixed_trips == 0
        versions = {int(item.split(":")[0]): int(item.split(":")[1]) for item in driver.trip_versions}
        assert len([v for v, n in versions.items() if n > 0]) >= 2, driver.trip_versions  # traffic spanned updates

        current = records[0].u_version
        swarm.spawn_peer("late", "1")  # the same peer returns after the updates
        back = wait_for(lambda: online(swarm, ["late"]), 150, "the returning peer online")["late"].record
        assert back.u_version >= current
        log_path = Path(swarm.workdir / "late.log")
        log = wait_for(
            lambda: "online:" in log_path.read_text(errors="replace") and log_path.read_text(errors="replace"),
            30,
            "the returning peer's online log line",
        )
        assert "caught up to U v" in log
        assert log.index("caught up to U v") < log.index("online:")
