"""Shared test setup."""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny tensors on two shared cores: one torch thread avoids oversubscription (20x faster here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tail_runtime() -> Iterator:
    """The tail stage of a 2-stage tiny run, alone on its own (real) DHT node."""
    from hivemind.dht import DHT

    from peer.runtime import StageRuntime
    from swarm.presets import preset

    dht = DHT(start=True)
    stage = StageRuntime(preset("tiny", stages=2), 1, dht, torch.device("cpu"), "[test stage 1]")
    try:
        yield stage
    finally:
        stage.shutdown()
        dht.shutdown()
