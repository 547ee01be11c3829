"""A burst of trips at the tail holds one autograd graph at a time (the fuzz of issue 12 held one per trip
in flight: +416 MB of peak RSS at the tiny preset)."""

from __future__ import annotations

import asyncio
import weakref
from types import SimpleNamespace

import torch

from peer.next_hop import NextHop
from peer.routing import Router
from peer.runtime import StageRuntime
from peer.trip import Hop, Stats
from swarm.presets import preset

MANIFEST = preset("tiny", stages=2)


def test_concurrent_trips_at_the_tail_never_hold_two_graphs(tail_runtime: StageRuntime):
    runtime = tail_runtime
    outputs: list[weakref.ref] = []
    most_alive = 0
    forward = runtime.forward

    def watched_forward(*args):
        nonlocal most_alive
        most_alive = max(most_alive, sum(ref() is not None for ref in outputs))
        leaf, output, residual = forward(*args)
        outputs.append(weakref.ref(output))
        return leaf, output, residual

    runtime.forward = watched_forward

    async def nobody(*_):
        raise AssertionError("the tail sends nothing downstream")

    link, stats = SimpleNamespace(send=nobody), Stats()
    next_hop = NextHop(MANIFEST, 1, runtime, Router(MANIFEST.t_fixed_sha256, "me"), link, nobody, stats, "[tail]", 30.0)
    hop = Hop(next_hop, stats, "[tail]")
    batch = MANIFEST.batch
    version = runtime.stage.subspace.version

    async def burst() -> list:
        trips = []
        for i in range(8):
            tokens = torch.randint(0, MANIFEST.model.vocab_size, (batch.microbatch_size, batch.seq_len))
            hidden = runtime.stage.subspace.t_fixed[tokens].detach().clone()
            trips.append(hop.hop(hidden, tokens, version, f"trip-{i}"))
        return await asyncio.gather(*trips)

    results = asyncio.run(burst())
    assert most_alive == 0, f"{most_alive} earlier trips' graphs were still alive when a forward started"
    # one forward per trip: no graph went stale behind another trip's optimizer step and was run again
    assert len(outputs) == 8 and all(r.loss is not None and r.input_grad is not None for r in results)
