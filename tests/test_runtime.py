"""The stage runtime on a real (single-node) hivemind DHT: what a joining peer is served."""

from __future__ import annotations

import torch
from hivemind.dht import DHT

from peer.runtime import StageRuntime, parameters_sha256
from swarm.presets import preset
from swarm.subspace import tensor_sha256


def test_state_served_to_joiners_is_a_copy_not_the_live_tensors():
    manifest = preset("tiny", stages=2)
    dht = DHT(start=True)
    runtime = StageRuntime(manifest, 1, dht, torch.device("cpu"), "[test stage 1]")
    try:
        before = parameters_sha256(runtime.stage)
        _, tensors, _ = runtime.optimizer.state_averager.get_current_state()
        with torch.no_grad():  # the peer goes on training while the joiner's download is serialised
            for param in runtime.stage.parameters():
                param.add_(1.0)
        assert parameters_sha256(runtime.stage) != before
        served = torch.cat([t.flatten() for t in tensors[: len(list(runtime.stage.parameters()))]])
        assert tensor_sha256(served) == before
    finally:
        runtime.shutdown()
        dht.shutdown()
