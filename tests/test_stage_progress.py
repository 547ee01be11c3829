"""Peers of a stage see each other's progress on DHTs that carry the run's validators, so they average.

hivemind's progress tracker signs its records with its own process-wide key unless told otherwise; the run's
signature validator then signs nothing of them and every node refuses them. Each peer saw no other (num_peers
0), skipped every averaging round and stepped alone: replicas of a stage trained apart. Real DHT nodes with
the validators `peer/join.py` gives them, real stage runtimes."""

from __future__ import annotations

import time

import pytest
import torch
from hivemind.dht import DHT
from hivemind.utils.crypto import RSAPrivateKey

from dhtio.validators import make_validators
from peer.runtime import StageRuntime
from swarm.presets import preset

pytestmark = pytest.mark.slow

MANIFEST = preset("tiny", stages=2)


def _peers_seen(runtimes: list[StageRuntime], timeout: float) -> list[int]:
    """Each runtime's count of the stage's peers, once both count two or `timeout` passed."""
    deadline = time.monotonic() + timeout
    while True:
        for samples, runtime in enumerate(runtimes, start=1):
            runtime.optimizer.tracker.report_local_progress(0, samples)
        seen = [r.optimizer.tracker.global_progress.num_peers for r in runtimes]
        if all(n == 2 for n in seen) or time.monotonic() > deadline:
            return seen
        time.sleep(1.0)


@pytest.mark.parametrize("signed", [True, False], ids=["signing key", "hivemind's default key"])
def test_the_peers_of_a_stage_see_each_other_only_when_signing_with_the_dht_key(signed: bool):
    keys = [RSAPrivateKey(), RSAPrivateKey()]
    first = DHT(start=True, record_validators=make_validators(MANIFEST, keys[0])[1])
    dhts = [first, DHT(start=True, initial_peers=first.get_visible_maddrs(),
                       record_validators=make_validators(MANIFEST, keys[1])[1])]
    runtimes = []
    try:
        for at, (dht, key) in enumerate(zip(dhts, keys, strict=True)):
            runtimes.append(StageRuntime(MANIFEST, 1, dht, torch.device("cpu"), f"[peer {at}]",
                                         signing_key=key if signed else None))
        seen = _peers_seen(runtimes, timeout=40.0 if signed else 15.0)
        stored = first.get(f"{runtimes[0].optimizer.run_id}_progress", latest=True)
        if signed:
            assert seen == [2, 2] and stored is not None and len(stored.value) == 2
        else:  # what every peer ran with before: the records refused, nobody seen
            assert stored is None and seen == [0, 0]
    finally:
        for runtime in runtimes:
            runtime.shutdown()
        for dht in dhts:
            dht.shutdown()
