"""Lane trips (issue 17, `peer/lane_trip.py`): the claim a lane trip's boundary message carries, and whole trips
over a group of 2 stages × 2 lanes, each lane a real `StageRuntime` (hivemind DHT and optimizer) with its
`KVService` on the DHT's libp2p daemon; boundary messages go from hop to hop in this process."""

from __future__ import annotations

import asyncio
import random
import re
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from builders import stage_record, tiny_manifest
from hivemind.dht import DHT
from hivemind.utils.timed_storage import get_dht_time

from peer.kv_exchange import KVService, message_limit
from peer.lane_claim import LaneClaim, new_fork, read_claim, split_claims
from peer.lane_trip import LaneHop, lane_codec
from peer.lanes import Strikes, pick_audit, pick_group
from peer.next_hop import NextHop
from peer.routing import Router
from peer.runtime import StageRuntime
from peer.trip import HopResult, Stats
from swarm.model import build_stages, next_token_loss
from swarm.records import RECORD_TTL, PeerEntry
from swarm.wire import ErrorCode, WireError, encode_error

CP = {"size": 2, "compression": "subspace", "wire_dtype": "fp32"}
MANIFEST = tiny_manifest("subspace", n_layers=2, stages=2, target=10_000, context_parallel=CP)
GROUP = (("a0", "a1"), ("b0", "b1"))


def tokens(seed: int = 1) -> torch.Tensor:
    batch = MANIFEST.batch
    return torch.randint(0, 256, (batch.microbatch_size, batch.seq_len), generator=torch.Generator().manual_seed(seed))


def claim_extra(lane: int = 1, **changes) -> dict:
    extra = LaneClaim(lane, GROUP, 32, None if lane == 1 else (5, 6)).extra()
    extra.update(changes)
    return extra


def refusal(extra: dict, stage: int = 1, lane: int = 1, own: str = "b1", sender: str = "a1") -> ErrorCode | None:
    try:
        read_claim(extra, MANIFEST, stage, lane, own, sender, (2, 16))
    except WireError as exc:
        return exc.code
    return None


def test_claims_are_checked_before_any_compute():
    assert refusal(claim_extra()) is None
    assert refusal(claim_extra(0), lane=0, own="b0", sender="a0") is None
    assert refusal(claim_extra(0), stage=0, lane=0, own="a0", sender="a1") is None  # the driver: any stage-0 peer
    assert refusal(claim_extra(group=[["a0", "a1"]])) is ErrorCode.MALFORMED  # not S × P
    assert refusal(claim_extra(group=[["a0", "a1"], ["b0", "x" * 200]])) is ErrorCode.MALFORMED
    assert refusal(claim_extra(group=[["a0", "a1"], ["b1", "b1"]])) is ErrorCode.MALFORMED  # a peer twice
    assert refusal(claim_extra(lane=True)) is ErrorCode.MALFORMED
    assert refusal(claim_extra(0)) is ErrorCode.WRONG_STAGE  # another lane
    assert refusal(claim_extra(), own="b9") is ErrorCode.WRONG_STAGE  # this peer not named
    assert refusal(claim_extra(), sender="a0") is ErrorCode.UNKNOWN_SENDER  # lane 0's stage-0 peer
    assert refusal(claim_extra(seq=48)) is ErrorCode.WRONG_SHAPE
    assert refusal(claim_extra(next=[1, 2])) is ErrorCode.MALFORMED  # the last lane has no next chunk
    assert refusal(claim_extra(0, next=[1, 256]), lane=0, own="b0", sender="a0") is ErrorCode.BAD_TOKENS
    assert refusal(claim_extra(0, next=[1]), lane=0, own="b0", sender="a0") is ErrorCode.BAD_TOKENS


def test_an_audit_fork_is_checked_and_forks_only_the_stage_before_it():
    fork_id = "0123456789abcdef" * 2
    fork = [1, ["b0", "x1"], fork_id]
    assert refusal(claim_extra(audit=fork)) is None
    for bad in ([0, ["b0", "x1"], fork_id], [2, ["b0", "x1"], fork_id], [1, ["x1"], fork_id],
                [1, ["x1", "x1"], fork_id], [1, ["b0", 7], fork_id], [True, [], fork_id],
                [1, ["b0", "x" * 200], fork_id], [1, ["b0", "x1"]], [1, ["b0", "x1"], "trip.audit"],
                [1, ["b0", "x1"], 7], "b0"):
        assert refusal(claim_extra(audit=bad)) is ErrorCode.MALFORMED, bad
    claim = read_claim(claim_extra(1, audit=fork), MANIFEST, 0, 1, "a1", "a0", (2, 16))
    assert claim.forked(1) is None and claim.onward(1) == claim  # stage 1 is the fork itself
    forked, trip_id = claim.forked(0)
    assert forked.group == (("a0", "a1"), ("b0", "x1")) and trip_id == fork_id
    # neither message to the audited stage says that the trip is audited: the trip's and the fork's claims differ
    # only in the peer they name at stage 1, and the fork's id looks like any trip's
    assert claim.onward(0).audit is None and forked.audit is None
    assert forked.extra() == claim.onward(0).extra() | {"group": [["a0", "a1"], ["b0", "x1"]]}
    # the fork's peer of lane 1 reads the forked claim: it names it at its lane and the same sender
    assert read_claim(forked.extra(), MANIFEST, 1, 1, "x1", "a1", (2, 16)).group == forked.group


def entry(stage: int, name: str, lane: int) -> PeerEntry:
    return PeerEntry(record=stage_record(stage, name, MANIFEST, lane=lane), expiration=get_dht_time() + RECORD_TTL,
                     owner=b"")


def test_an_audit_fork_takes_the_slots_other_peers_and_keeps_a_lane_that_has_none():
    router = Router(MANIFEST.t_fixed_sha256, "me", lanes=2)
    entries = {name: entry(1, name, lane) for name, lane in (("b0", 0), ("b1", 1), ("x1", 1), ("y1", 1))}
    router.update({1: list(entries.values())})
    b0, b1, x1, y1 = (entries[name].record.peer_id for name in ("b0", "b1", "x1", "y1"))
    group, rng = (("a0", "a1"), (b0, b1)), random.Random(3)
    assert pick_audit(router, group, 0.0, rng) is None
    forks = {pick_audit(router, group, 1.0, rng) for _ in range(40)}
    assert forks == {(1, (b0, x1)), (1, (b0, y1))}  # both other peers of lane 1, in turn; lane 0 has no other
    struck = {pick_audit(router, group, 1.0, rng, strikes={x1: 1}) for _ in range(20)}
    assert struck == {(1, (b0, y1))}  # fewer strikes first
    router.ban(x1)
    router.ban(y1)
    assert pick_audit(router, group, 1.0, rng) is None  # nobody else to fork to


def test_split_claims_hand_each_lane_the_next_chunks_first_token():
    batch = tokens()
    (first, chunk0), (last, chunk1) = split_claims(batch, GROUP)
    assert torch.equal(torch.cat([chunk0, chunk1], dim=1), batch)
    assert first.next_tokens == tuple(int(t) for t in batch[:, 16]) and last.next_tokens is None


def test_a_lane_peer_with_strikes_is_picked_only_where_its_lane_has_no_other():
    entries = [PeerEntry(record=stage_record(1, name, MANIFEST, lane=lane), expiration=get_dht_time() + RECORD_TTL,
                         owner=b"") for name, lane in (("stale", 1), ("good", 1), ("only0", 0))]
    router = Router(MANIFEST.t_fixed_sha256, "me", lanes=2)
    router.update({1: entries})
    stale, good, only0 = (e.record.peer_id for e in entries)
    router.observe(stale, seconds=0.1, tokens=100)  # measured the fastest of its lane
    router.observe(good, seconds=10.0, tokens=100)
    assert pick_group(router, 1, 2).peers == (only0, stale)
    assert pick_group(router, 1, 2, strikes={stale: 1, only0: 1}).peers == (only0, good)


def test_strikes_are_cleared_by_a_good_trip_and_forgotten_a_while_after_the_last():
    strikes = Strikes(memory=30.0)
    strikes.strike(["stale", "good"], now=0.0)
    strikes.strike(["stale"], now=10.0)
    strikes.clear(["good"])  # its next group came back
    listed = {"stale", "good"}
    assert strikes.current(listed, now=39.0) == {"stale": 2}  # 29 s after its last strike: still avoided
    assert strikes.current(listed, now=40.0) == {}  # tried again: it may have failed for a passing cause
    strikes.strike(["gone"], now=41.0)
    assert strikes.current(listed, now=41.0) == {}  # a peer whose record is gone is forgotten at once


class LyingLaneHop(LaneHop):
    """A lane peer that runs its lane honestly (its partners' K/V keep flowing) and answers with a fake reply (a
    zero gradient, a hundredth of its loss) whenever it sees no sign of an audit: none in its claim, a trip id
    like any other."""

    async def lane_hop(self, claim, hidden, tokens, version, trip_id) -> HopResult:
        result = await super().lane_hop(claim, hidden, tokens, version, trip_id)
        if claim.audit is not None or not re.fullmatch(r"[0-9a-f]{32}", trip_id):
            return result
        loss = None if result.loss is None else result.loss / 100
        return replace(result, input_grad=torch.zeros_like(result.input_grad), loss=loss)


class Swarm:
    """Lane peers: stage s lane c is `peers[2 * s + c]`, then `extra` ones (slot, hop class)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, extra: tuple = ()):
        self.loop = loop
        self.slots = [((stage, lane), LaneHop) for stage in range(2) for lane in range(2)] + list(extra)
        self.dhts: list[DHT] = []
        self.runtimes: list[StageRuntime] = []
        self.services: list[KVService] = []
        self.hops: dict[str, LaneHop] = {}
        self.ids: list[str] = []

    def start(self) -> None:
        for (stage, lane), hop_class in self.slots:
            initial = [str(a) for a in self.dhts[0].get_visible_maddrs()] if self.dhts else []
            dht = DHT(start=True, initial_peers=initial)
            runtime = StageRuntime(MANIFEST, stage, dht, torch.device("cpu"), f"[lane test {stage}.{lane}]")
            self.dhts.append(dht)
            self.runtimes.append(runtime)
            self.loop.run_until_complete(self._serve(dht, runtime, stage, lane, hop_class))

    async def _serve(self, dht: DHT, runtime: StageRuntime, stage: int, lane: int, hop_class: type) -> None:
        p2p = await dht.replicate_p2p()
        codec = lane_codec(MANIFEST, runtime.stage)
        service = KVService(p2p, MANIFEST.run_id, message_limit(codec, lane, codec.spec.mode))
        service.serve(codec, lane)
        await service.start()
        peer_id = p2p.peer_id.to_base58()
        router = Router(runtime.stage.subspace.t_fixed_sha256, peer_id)

        async def fetch():
            return {}

        async def send(to: str, blob: bytes, timeout: float, max_reply: int) -> bytes:
            refuse = lambda code, message, hops: encode_error(code, message, hops)  # noqa: E731
            return await asyncio.wait_for(self.hops[to].serve(blob, refuse, peer_id), timeout)

        link, stats = SimpleNamespace(send=send), Stats()  # a `peer/link.py` Link to the hops of this process
        next_hop = NextHop(MANIFEST, stage, runtime, router, link, fetch, stats, runtime.label, 60.0)
        hop = hop_class(next_hop, stats, runtime.label, lane=lane, kv=service, peer_id=peer_id)
        self.services.append(service)
        self.ids.append(peer_id)
        self.hops[peer_id] = hop

    @property
    def group(self) -> tuple[tuple[str, ...], ...]:
        return (tuple(self.ids[:2]), tuple(self.ids[2:4]))

    def accumulated(self) -> list[int]:
        return [runtime.optimizer.grad_averager.local_samples_accumulated for runtime in self.runtimes]

    def stop(self) -> None:
        for service in self.services:
            self.loop.run_until_complete(service.stop())
        for runtime, dht in zip(self.runtimes, self.dhts, strict=True):
            runtime.shutdown()
            dht.shutdown()


@pytest.fixture(scope="module")
def swarm():
    """The four peers of `Swarm.group`, and a fifth on stage 1 lane 1 that lies (`LyingLaneHop`), outside the group
    unless a test names it."""
    loop = asyncio.new_event_loop()
    running = Swarm(loop, (((1, 1), LyingLaneHop),))
    try:
        running.start()
        yield running
    finally:
        running.stop()
        loop.close()


def in_process(batch: torch.Tensor) -> tuple[float, list[dict[str, torch.Tensor]]]:
    """The whole sequence through freshly built stages in one graph: the loss and each stage's gradients."""
    stages, hidden = build_stages(MANIFEST), None
    for stage in stages:
        hidden = stage(hidden, batch)
    loss = next_token_loss(hidden, batch)
    loss.backward()
    grads = [{n: p.grad for n, p in stage.named_parameters() if p.grad is not None} for stage in stages]
    return float(loss.detach()), grads


def accumulated_grads(runtime: StageRuntime) -> dict[str, torch.Tensor]:
    """What hivemind's gradient accumulators hold, by parameter name (the optimizer's parameters in its order)."""
    names = {id(p): n for n, p in runtime.stage.named_parameters()}
    params = [p for group in runtime.optimizer.opt.param_groups for p in group["params"]]
    grads = runtime.optimizer.grad_averager._grad_accumulators()
    return {names[id(p)]: g.clone() for p, g in zip(params, grads, strict=True)}


def kv_sends(loop: asyncio.AbstractEventLoop) -> list[asyncio.Task]:
    """K/V sends still running on `loop`: they run in the background of their lane trip, which may not outlive them."""
    return [t for t in asyncio.all_tasks(loop)
            if getattr(t.get_coro(), "__qualname__", "").startswith(("LaneExchange.send", "KVService.send"))]


def test_a_trip_over_two_stages_of_two_lanes_is_the_whole_sequence(swarm):
    driver = swarm.hops[swarm.ids[0]]
    batch = tokens(7)
    before = swarm.accumulated()
    swarm.loop.run_until_complete(driver.drive_group(batch, swarm.group))
    assert driver.stats.trips == 1 and len(driver.stats.losses) == 1
    loss, grads = in_process(batch)
    assert driver.stats.losses[0] == pytest.approx(loss, rel=1e-4)  # the lanes' losses sum to the mean loss
    # every lane stepped its chunk once (B sequences), nothing else
    assert [after - was for after, was in zip(swarm.accumulated(), before, strict=True)] == [2, 2, 2, 2, 0]
    # the two lanes of a stage together hold the stage's gradient (each unclipped: its norm is below grad_clip)
    for stage in range(2):
        lanes = [accumulated_grads(runtime) for runtime in swarm.runtimes[2 * stage : 2 * stage + 2]]
        for name, want in grads[stage].items():
            got = lanes[0][name] + lanes[1][name]
            assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max()) + 1e-7, name
    assert all(swarm.hops[peer].stats.kv_bytes > 0 for peers in swarm.group for peer in peers)
    assert all(not service.exchanges for service in swarm.services)  # every exchange closed
    assert not kv_sends(swarm.loop)  # every send awaited before its trip's step


def test_a_lane_peer_gone_fails_the_whole_trip_and_applies_nothing(swarm):
    driver = swarm.hops[swarm.ids[0]]
    gone = swarm.services[3]  # stage 1, lane 1
    codec = gone.codec
    gone.serve(None)  # it leaves its lane: its K/V are refused `leaving`
    before, trips = swarm.accumulated(), driver.stats.trips
    try:
        with pytest.raises(WireError):
            swarm.loop.run_until_complete(asyncio.wait_for(driver.drive_group(tokens(8), swarm.group), 90))
    finally:
        gone.serve(codec, 1)
    assert swarm.accumulated() == before and driver.stats.trips == trips
    assert all(runtime.stage.t_s.grad is None for runtime in swarm.runtimes[:1])
    swarm.loop.run_until_complete(asyncio.sleep(0.5))  # the cancelled lanes' exchanges close
    assert all(not service.exchanges for service in swarm.services)
    assert not kv_sends(swarm.loop)  # a failed trip's pending sends were cancelled and awaited


def test_a_lying_lane_peer_is_audited_by_a_fork_and_banned(swarm):
    driver, partner = swarm.hops[swarm.ids[0]], swarm.hops[swarm.ids[1]]  # a0 and a1, the stage-0 lanes
    b0, b1, liar = swarm.ids[2], swarm.ids[3], swarm.ids[4]
    run, stats = swarm.loop.run_until_complete, driver.stats
    for seed in range(3):  # trust on first use: a1 verifies b1, its only next hop so far
        run(driver.drive_group(tokens(seed), swarm.group))
    ledger = partner.router.ledger
    trips, losses = stats.trips, len(stats.losses)
    assert ledger.verified(b1) and not ledger.verified(liar)
    # a trip through the liar, unverified: its gradient is used (trips go on), its loss is not published
    run(driver.drive_group(tokens(3), ((swarm.ids[0], swarm.ids[1]), (b0, liar))))
    assert (stats.trips, len(stats.losses)) == (trips + 1, losses)
    # a trip forked at stage 1: lane 0 keeps b0 (no other peer), lane 1 duplicates to the liar and compares
    run(driver.drive_group(tokens(4), swarm.group, audit=new_fork(1, (b0, liar))))
    assert (stats.trips, len(stats.losses)) == (trips + 2, losses + 1)  # the trip's own replies are honest
    deadline = time.monotonic() + 60
    while liar not in partner.router.liars() and time.monotonic() < deadline:
        run(asyncio.sleep(0.2))
    assert liar in partner.router.liars() and ledger.verified(b1) and not ledger.verified(liar)
    assert not driver.router.liars()  # lane 0 compared nothing: b0 served both trips
    # a group naming the liar now fails at a1 (the driver strikes the group and picks another)
    with pytest.raises(WireError) as refused:
        run(asyncio.wait_for(driver.drive_group(tokens(5), ((swarm.ids[0], swarm.ids[1]), (b0, liar))), 90))
    assert refused.value.code is ErrorCode.NO_PEER
    run(asyncio.sleep(0.5))  # the cancelled lanes' exchanges close
