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
from hivemind.compression import NoCompression, ScaledFloat16Compression
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
            # gradients go out as fp16 (`GradientWire`), the state rounds as they are
            optimizer = runtimes[0].optimizer
            assert isinstance(optimizer.grad_averager.allreduce_kwargs["compression"], ScaledFloat16Compression)
            assert isinstance(optimizer.state_averager.allreduce_kwargs["compression"], NoCompression)
        else:  # what every peer ran with before: the records refused, nobody seen
            assert stored is None and seen == [0, 0]


def _ahead(runtime: StageRuntime, epoch: int) -> None:
    """The peer trained on (its parameters moved) and reached `epoch`; it declares itself a state donor."""
    with torch.no_grad():
        for param in runtime.stage.parameters():
            param.add_(0.01)
    runtime.optimizer.state_averager.local_epoch = epoch
    runtime.optimizer.state_averager.state_sharing_priority = epoch


def _step_until_caught_up(runtime: StageRuntime, ahead: StageRuntime, timeout: float = 90.0) -> None:
    """Both report progress, as training peers do; `runtime` steps (a microbatch of zero gradients) whenever it
    sees the stage more than MAX_STALE epochs ahead, until it reached `ahead`'s epoch."""
    deadline = time.monotonic() + timeout
    while runtime.epoch < ahead.epoch and time.monotonic() < deadline:
        ahead.optimizer.tracker.report_local_progress(ahead.epoch, 2)
        runtime.optimizer.tracker.report_local_progress(runtime.epoch, 1)
        if runtime.optimizer.tracker.global_epoch > runtime.epoch + MAX_STALE:
            for param in runtime.stage.parameters():
                param.grad = torch.zeros_like(param)
            runtime.step(batch_size=1)
        time.sleep(1.0)
    assert runtime.epoch >= ahead.epoch, (runtime.epoch, runtime.optimizer.tracker.global_epoch)


def test_a_peer_that_fell_behind_downloads_inside_its_step_and_is_no_witness_of_the_state_it_took():
    """A peer more than MAX_STALE epochs behind downloads the stage's state inside hivemind's `step`, not through
    the join's `StageRuntime.load_from_peers`. It must note that state as loaded: had it hashed it as its own (it
    did, at the next epoch change), a hostile donor's state would gain a witness and the next joiner would take
    it (a CI run of tests/test_state_load_swarm.py saw exactly that). The records' rule is bypassed here
    (`choose` takes the first state) so the download is sure to land: what is checked is the bookkeeping."""
    with _two_peers() as (_, (behind, ahead)):
        _ahead(ahead, MAX_STALE + 3)
        taken = parameters_sha256(ahead.stage)
        behind.optimizer.state_averager.choose = lambda candidates: 0
        _step_until_caught_up(behind, ahead)
        assert behind.loaded_state == state_entry(MAX_STALE + 3, taken)
        assert behind.optimizer.weights_epoch == behind.epoch  # the stage's weights: what its replies tell audits
        record = stage_record(1, "behind", state_hashes=list(behind.state_hashes), loaded_state=behind.loaded_state)
        assert not confirmations([PeerEntry(record, 0.0, b"")], 1, behind.loaded_state, donor="ahead")


def test_a_peer_that_trained_keeps_its_own_state_when_its_catch_up_takes_nothing():
    """Where no state can be taken (here `choose` refuses all), a peer that trained (epoch 1) moves to the stage's
    epoch with its own parameters at the next step, instead of dropping every microbatch until its next download
    (`StageOptimizer._should_load_state_from_peers`)."""
    with _two_peers() as (_, (behind, ahead)):
        with behind.optimizer.tracker.pause_updates():
            behind.optimizer.state_averager.local_epoch = 1
            behind.optimizer.tracker.update_epoch(1)
        _ahead(ahead, MAX_STALE + 3)
        own = [param.detach().clone() for param in behind.stage.parameters()]
        behind.optimizer.state_averager.choose = lambda candidates: None
        _step_until_caught_up(behind, ahead)
        # its own parameters (the step that moved it may have ended an epoch of zero gradients), not the stage's,
        # which are 0.01 away
        params = [param.detach() for param in behind.stage.parameters()]
        moved = max(float((param - was).abs().max()) for param, was in zip(params, own, strict=True))
        assert moved < 0.005 and behind.loaded_state == "", moved
        # and its replies tell the drivers' audits that its weights are those of its epoch 1 (2 if that step ended
        # an epoch), not of the epoch it moved to (peer/audit.py AUDIT_MAX_LAG)
        assert behind.optimizer.weights_epoch in (1, 2) and behind.epoch - behind.optimizer.weights_epoch >= MAX_STALE
        assert behind.optimizer.state_averager.retry_at > time.monotonic()  # it did try a download first
