"""The stage runtime on a real (single-node) hivemind DHT: what a joining peer is served."""

from __future__ import annotations

import time

import pytest
import torch

from peer.runtime import StageRuntime
from swarm.live_state import parameters_sha256
from swarm.presets import preset
from swarm.subspace import tensor_sha256

MANIFEST = preset("tiny", stages=2)


@pytest.fixture
def runtime(tail_runtime: StageRuntime) -> StageRuntime:
    """The tail stage of a 2-stage run, alone on its own DHT node (`conftest.tail_runtime`)."""
    return tail_runtime


def test_state_served_to_joiners_is_a_copy_not_the_live_tensors(runtime: StageRuntime):
    before = parameters_sha256(runtime.stage)
    _, tensors, _ = runtime.optimizer.state_averager.get_current_state()
    with torch.no_grad():  # the peer goes on training while the joiner's download is serialised
        for param in runtime.stage.parameters():
            param.add_(1.0)
    assert parameters_sha256(runtime.stage) != before
    served = torch.cat([t.flatten() for t in tensors[: len(list(runtime.stage.parameters()))]])
    assert tensor_sha256(served) == before


def test_a_pipeline_runtime_judges_its_gradient_senders_all_together(runtime: StageRuntime):
    """No lanes given (a pipeline run's flavour): no sender waits out a lane grace, none is judged by a lane it
    names (`peer/averaging_lanes.py`); the state averager never judges by lane."""
    assert runtime.optimizer.grad_averager.lane_check is None
    assert runtime.optimizer.state_averager.lane_check is None


def test_a_stage_alone_books_no_averaging_groups_and_still_steps(runtime: StageRuntime):
    batch = MANIFEST.batch
    tokens = torch.randint(0, MANIFEST.model.vocab_size, (batch.microbatch_size, batch.seq_len))
    hidden = runtime.stage.subspace.t_fixed[tokens].detach().clone()
    booked = []
    deadline = time.monotonic() + 15  # long enough for the progress tracker to estimate the epoch's end
    while time.monotonic() < deadline:
        leaf, output, residual = runtime.forward(hidden, tokens)
        runtime.backward(leaf, output, None, tokens, residual)
        runtime.step(batch.microbatch_size)
        booked.append(runtime.optimizer.scheduled_grads is not None)
        time.sleep(0.1)  # trips arrive one by one
    assert runtime.epoch >= 5  # epochs still end, with local gradients
    assert not any(booked)  # and no matchmaking was started for them
