"""Peers of a stage see each other's progress on DHTs that carry the run's validators, so they average.

hivemind's progress tracker signs its records with its own process-wide key unless told otherwise; the run's
signature validator then signs nothing of them and every node refuses them. Each peer saw no other (num_peers
0), skipped every averaging round and stepped alone: replicas of a stage trained apart. Real DHT nodes with
the validators `peer/join.py` gives them, real stage runtimes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from builders import stage_record
from hivemind.dht import DHT
from hivemind.utils.crypto import RSAPrivateKey

from dhtio.validators import make_validators
from peer.runtime import StageRuntime
from peer.stage_optimizer import MAX_STALE
from swarm.live_state import confirmations, parameters_sha256, state_entry
from swarm.presets import preset
from swarm.records import PeerEntry

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


@contextmanager
def _two_peers(signed: bool = True) -> Iterator[tuple[DHT, list[StageRuntime]]]:
    """Two runtimes of stage 1, each on its own DHT node with the run's validators; the first node too."""
    keys = [RSAPrivateKey(), RSAPrivateKey()]
    first = DHT(start=True, record_validators=make_validators(MANIFEST, keys[0])[1])
    dhts = [first, DHT(start=True, initial_peers=first.get_visible_maddrs(),
                       record_validators=make_validators(MANIFEST, keys[1])[1])]
    runtimes = []
    try:
        for at, (dht, key) in enumerate(zip(dhts, keys, strict=True)):
            runtimes.append(StageRuntime(MANIFEST, 1, dht, torch.device("cpu"), f"[peer {at}]",
                                         signing_key=key if signed else None))
        yield first, runtimes
    finally:
        for runtime in runtimes:
            runtime.shutdown()
        for dht in dhts:
            dht.shutdown()


@pytest.mark.parametrize("signed", [True, False], ids=["signing key", "hivemind's default key"])
def test_the_peers_of_a_stage_see_each_other_only_when_signing_with_the_dht_key(signed: bool):
    with _two_peers(signed) as (first, runtimes):
        seen = _peers_seen(runtimes, timeout=40.0 if signed else 15.0)
        stored = first.get(f"{runtimes[0].optimizer.run_id}_progress", latest=True)
        if signed:
            assert seen == [2, 2] and stored is not None and len(stored.value) == 2
        else:  # what every peer ran with before: the records refused, nobody seen
            assert stored is None and seen == [0, 0]


def test_a_peer_that_fell_behind_and_downloads_inside_its_step_is_no_witness_of_the_state_it_took():
    """A peer more than MAX_STALE epochs behind downloads the stage's state inside hivemind's `step`, which calls
    the optimizer's `load_state_from_peers`, not the join's `StageRuntime.load_from_peers`. It must note that state
    as loaded: had it hashed it as its own (it did, at the next epoch change), a hostile donor's state would gain a
    witness and the next joiner would take it (a CI run of tests/test_state_load_swarm.py saw exactly that). The
    records' rule is bypassed here (`choose` takes the first state) so the download is sure to land: what is
    checked is the bookkeeping around it."""
    with _two_peers() as (first, runtimes):
        behind, ahead = runtimes
        with torch.no_grad():  # the peer ahead trained: its parameters differ from the seed's
            for param in ahead.stage.parameters():
                param.add_(0.01)
        epoch = MAX_STALE + 3
        ahead.optimizer.state_averager.local_epoch = epoch
        ahead.optimizer.state_averager.state_sharing_priority = epoch  # declares it a donor
        behind.optimizer.state_averager.choose = lambda candidates: 0
        taken = parameters_sha256(ahead.stage)
        deadline = time.monotonic() + 30.0
        while not first.get(f"{behind.optimizer.run_id}_state_averager.all_averagers", latest=True):
            assert time.monotonic() < deadline, "the donor never declared itself"
            time.sleep(0.5)
        assert behind.optimizer.load_state_from_peers()  # what hivemind's step calls when out of sync
        assert behind.epoch == epoch and behind.loaded_state == state_entry(epoch, taken)
        record = stage_record(1, "behind", state_hashes=list(behind.state_hashes), loaded_state=behind.loaded_state)
        assert not confirmations([PeerEntry(record, 0.0, b"")], 1, behind.loaded_state, donor="ahead")
