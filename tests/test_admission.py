"""Admission of trip streams (issue 12, H1/M3): only known upstream peers get a receive slot, the
upstream set survives bad DHT reads, and when all slots are full the slowest stream is cut.

The slow test runs real hivemind P2P daemons on loopback: a `TripServicer` whose `admit` is a real
`TripServer.admit_stream`, 16 fresh identities each holding a stalled stream, and an honest known
sender whose trips must be served at once."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hivemind.p2p import P2P
from hivemind.utils.timed_storage import get_dht_time

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(REPO))

from benchmarks import attack_clients as ac  # noqa: E402
from peer.admission import RefreshGate, UpstreamIds  # noqa: E402
from peer.refusals import RefusalLog  # noqa: E402
from peer.transport import EVICT_AFTER_S, TripServicer, slowest  # noqa: E402
from peer.trip import Stats  # noqa: E402
from peer.trip_server import TripServer  # noqa: E402
from swarm.wire import ErrorCode, WireError  # noqa: E402

MAX_BYTES = 28_000


def test_upstream_ids_merge_and_expire():
    ids = UpstreamIds()
    ids.merge([("a", 130.0), ("b", 110.0)], now=100.0)
    assert ids.known("a", 100.0) and ids.known("b", 100.0)
    ids.merge([], now=101.0)  # a failed or empty read forgets nobody
    assert ids.known("a", 101.0) and ids.known("b", 101.0)
    ids.merge([("b", 105.0)], now=101.0)  # an older record does not shorten a newer one
    assert ids.known("b", 109.0)
    assert not ids.known("b", 110.5) and ids.known("a", 110.5)  # forgotten when its own record expires
    ids.merge([("c", 99.0)], now=100.0)  # an expired record is not added
    assert not ids.known("c", 100.0)
    ids.clear()
    assert not ids.known("a", 101.0)


def test_refresh_gate_rate_limits():
    gate = RefreshGate(interval=2.0)
    assert gate.due(10.0)
    assert not gate.due(11.9)
    assert gate.due(12.0)


def test_slowest_cuts_stalled_first_and_never_a_young_stream():
    now = 100.0
    streams = [(90.0, 50_000), (95.0, 10), (99.0, 0), (99.9, 0)]
    assert slowest(streams, now) == 2  # 0 B/s beats 2 B/s; the one 0.1 s old is not eligible
    assert slowest([(now - EVICT_AFTER_S / 2, 0)], now) is None
    assert slowest([], now) is None


def _server(upstream: list[tuple[str, float]], fetched: list[tuple[str, float]]) -> TripServer:
    """A real TripServer in front of a stage-1 hop; the hop's router holds `upstream` (stage 0 entries),
    and its DHT re-read (`hop.fetch`) returns `fetched`."""

    def entries(pairs):
        return [SimpleNamespace(record=SimpleNamespace(peer_id=p), expiration=t) for p, t in pairs]

    async def fetch():
        return {0: entries(fetched)}

    server = TripServer(Stats(), lambda: "online", 16, RefusalLog(), lambda: "[test]")
    server.hop = SimpleNamespace(
        index=1,
        router=SimpleNamespace(stages={0: entries(upstream)}),
        fetch=fetch,
        upstream=lambda: 0,
    )
    return server


def test_unknown_sender_is_refused_at_once_and_known_on_retry_after_the_background_read():
    async def run():
        soon = get_dht_time() + 30
        server = _server([("known", soon)], fetched=[("joined", soon)])
        known = SimpleNamespace(to_base58=lambda: "known")
        joined = SimpleNamespace(to_base58=lambda: "joined")
        assert server.admit_stream(known) is None
        assert server.admit_stream(joined) == ErrorCode.UNKNOWN_SENDER  # at once, no slot, no waiting
        await asyncio.sleep(0.05)  # the kicked background read completes
        assert server.admit_stream(joined) is None
        server.hop.router.stages = {0: []}  # a later empty read forgets nobody
        assert server.admit_stream(known) is None and server.admit_stream(joined) is None

    asyncio.run(run())


@pytest.mark.slow
def test_stalled_streams_of_16_fresh_identities_do_not_delay_a_known_sender():
    async def run():
        receiver = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
        maddrs = [str(m) for m in await receiver.get_visible_maddrs()]
        honest = await ac.attacker_p2p(maddrs)
        sybils = [await ac.attacker_p2p(maddrs) for _ in range(16)]
        refused: list[ErrorCode] = []
        server = _server([(honest.peer_id.to_base58(), get_dht_time() + 60)], fetched=[])
        servicer = TripServicer(
            lambda blob, remote: server.handle_trip(blob, remote),
            max_bytes=MAX_BYTES,
            on_refused=refused.append,
            admit=server.admit_stream,
        )

        async def serve(blob, remote):
            return b"ok:%d" % len(blob)

        server.hop.serve = lambda blob, refuse, sender="": serve(blob, None)
        await servicer.add_p2p_handlers(receiver, namespace=ac.NAMESPACE)
        try:
            latencies, replies = await ac.stalled_vs_honest(
                sybils, honest, receiver.peer_id, 1, 5, 20_000, read_timeout=10
            )
            return latencies, replies, refused
        finally:
            for p2p in [honest, *sybils, receiver]:
                await p2p.shutdown()

    latencies, replies, refused = asyncio.run(run())
    assert max(latencies) < 0.5, latencies
    assert all("unknown_sender" in r for r in replies), replies
    assert refused.count(ErrorCode.UNKNOWN_SENDER) == 16, refused


@pytest.mark.slow
def test_one_stalled_stream_each_from_16_identities_is_cut_for_an_honest_one():
    """Without an admission hook (the transport alone): every slot held by a different identity with a
    single stalled stream; the honest sender's trips cut the slowest and are served at once."""
    with ac.Receiver(MAX_BYTES) as receiver:

        async def run():
            honest = await ac.attacker_p2p(receiver.maddrs)
            sybils = [await ac.attacker_p2p(receiver.maddrs) for _ in range(16)]
            try:
                return await ac.stalled_vs_honest(sybils, honest, receiver.peer_id, 1, 3, 1000)
            finally:
                for p2p in [honest, *sybils]:
                    await p2p.shutdown()

        latencies, replies = asyncio.run(run())
    assert max(latencies) < 0.5, latencies
    codes = []
    for r in replies:
        try:
            from swarm.wire import raise_if_error

            raise_if_error(r.encode())
            codes.append(None)
        except WireError as exc:
            codes.append(exc.code.value)
    assert codes.count("overloaded") == 1 and codes.count("timeout") == 15, replies


def test_fair_share_limits_a_sender_only_when_half_full_and_above_its_share():
    from peer.refusals import fair_share

    assert fair_share(48, load=23, active=5) == 48  # under half the cap: nobody is limited
    assert fair_share(48, load=24, active=4) == 12
    assert fair_share(48, load=40, active=100) == 1  # never below one trip


def test_sender_limits_fair_share_lets_a_lone_relay_use_the_cap_and_shares_it_under_contention():
    from peer.refusals import SenderLimits

    cap = 48  # 4 × --max-inflight 4 × 3 stages
    limits = SenderLimits(rate=1e9, burst=1e9, max_inflight=cap, total_cap=cap)
    # one stage-1 relay carrying 4 drivers × 8 trips (more than any receiver-sized per-sender cap of old)
    assert all(limits.admit("relay", now=0.0) is None for _ in range(32))
    # a second sender arrives: the peer is over half full, its share is 24 of 48 and it holds none
    assert all(limits.admit("other", now=0.0) is None for _ in range(16))
    assert "in flight" in limits.admit("relay", now=0.0)  # 32 > 48 / 2: above its share now
    assert limits.admit("other", now=0.0) is None  # 16 < 24
    for _ in range(16):
        limits.release("relay")
    assert limits.admit("relay", now=0.0) is None  # 16 in flight < its share of 24
