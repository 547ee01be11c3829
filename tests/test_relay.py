"""The application-level trip relay (peer/relay.py) on three real libp2p daemons: a sender that knows only the
relay reaches a target registered there, the bytes go through the relay's counters, the target sees the
sender's id, and the budget refuses with codes (unregistered target, too many bytes, too many circuits)."""

from __future__ import annotations

import asyncio
import sys

import pytest
from builders import stage_record
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from p2pio.relay_service import Budget, RelayService, admit_circuit, wire_bound
from peer.relay import RelayClient, TripSender, bootstrap_ids, relay_candidates
from peer.transport import TripServicer
from swarm.records import PeerEntry
from swarm.wire import ErrorCode, WireError, raise_if_error


def test_admit_circuit_budget():
    budget = Budget(circuits_per_peer=2, bytes_per_circuit=1 << 20, seconds_per_circuit=60.0)
    assert admit_circuit(budget, 0, 0, True) is None
    assert admit_circuit(budget, 0, 0, False)[0] is ErrorCode.UNREACHABLE
    assert admit_circuit(budget, 2, 2, True)[0] is ErrorCode.OVERLOADED
    assert admit_circuit(budget, 1, 64, True)[0] is ErrorCode.OVERLOADED
    assert wire_bound(100) > 100 and wire_bound(3 << 20) < (3 << 20) + 1024


def test_relay_candidates_are_direct_first_and_never_relayed():
    relay = "QmZ5dV2ukSB2jHZ2dfu9JmVqYLgz3UBGWvRzzTumj6HUjx"

    def entry(peer: str, reachability: str, state: str = "online", via: str = "") -> PeerEntry:
        record = stage_record(1).copy(update={"peer_id": peer, "reachability": reachability, "state": state,
                                              "relay": via})
        return PeerEntry(record=record, expiration=0.0, owner=b"")

    stages = {
        0: [entry("d1", "direct"), entry("u1", ""), entry("me", "direct")],
        1: [entry("r1", "via relay", via=relay), entry("x1", "unreachable"), entry("d2", "direct", "leaving")],
    }
    found = relay_candidates(stages, "me")
    assert found == ["d1", "u1"]
    tracker = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    bootstrap = bootstrap_ids([f"/ip4/10.0.0.1/tcp/31337/p2p/{tracker}", "/ip4/10.0.0.2/tcp/1", "/p2p/not-base58!"])
    assert bootstrap == [tracker]
    # the tracker's node (no stage record) after the peers found direct, before the unchecked ones
    assert relay_candidates(stages, "me", bootstrap + ["d1", "me"]) == ["d1", tracker, "u1"]


async def _p2p(*peers: P2P) -> P2P:
    initial = [Multiaddr(str(m)) for p in peers for m in await p.get_visible_maddrs()]
    return await P2P.create(initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)


def test_a_trip_through_the_relay():
    async def run():
        relay = await _p2p()
        target = await _p2p(relay)
        sender = await _p2p(relay)
        try:
            seen: list[PeerID] = []
            hung_up = asyncio.Event()

            async def echo(blob: bytes, remote: PeerID) -> bytes:
                seen.append(remote)
                if blob == b"slow":
                    await asyncio.sleep(1.0)
                if blob == b"hang":  # a trip whose sender gives up long before it could end
                    try:
                        await asyncio.sleep(60.0)
                    except asyncio.CancelledError:
                        hung_up.set()
                        raise
                return b"echo:" + blob

            servicer = TripServicer(echo, max_bytes=2 << 20)
            await servicer.add_p2p_handlers(target, namespace="ns")
            service = RelayService(relay, "ns", Budget(1, 64 << 20, 30.0), max_message=2 << 20)
            await service.add_handlers()
            trip = TripSender(sender, "ns")
            relay_id, target_id = relay.peer_id.to_base58(), target.peer_id.to_base58()

            # not registered yet: the relay refuses to reach it
            with pytest.raises(WireError) as caught:
                raise_if_error(await trip.via_relay(target_id, relay_id, b"hello", 20.0, 1 << 20))
            assert caught.value.code is ErrorCode.UNREACHABLE

            async def candidates() -> list[str]:
                return [relay_id]

            client = RelayClient(target, "ns", servicer.serve_stream, candidates)
            await client.start()
            client.hold(lambda _: None)
            await asyncio.wait_for(client.changed.wait(), 20)
            assert client.relay == relay_id

            blob = bytes(range(256)) * 6000  # 1.5 MB: two chunks
            assert await trip.via_relay(target_id, relay_id, blob, 20.0, 2 << 20) == b"echo:" + blob
            assert seen[-1] == sender.peer_id  # the target admits the sender the relay names, not the relay
            # the relay counts a circuit when the target closes it, a moment after the sender has its reply
            for _ in range(50):
                if service.circuits:
                    break
                await asyncio.sleep(0.1)
            # the refusal came back through the relay too
            assert service.circuits == 1 and trip.relayed == 2 and client.delivered == 1
            assert service.bytes_forward > len(blob) and service.bytes_back > len(blob)

            # one circuit per sender at once: the second concurrent one is refused with `overloaded`
            slow = asyncio.create_task(trip.via_relay(target_id, relay_id, b"slow", 20.0, 1 << 20))
            await asyncio.sleep(0.3)
            with pytest.raises(WireError) as caught:
                raise_if_error(await trip.via_relay(target_id, relay_id, b"second", 20.0, 1 << 20))
            assert caught.value.code is ErrorCode.OVERLOADED
            assert await slow == b"echo:slow"

            # a sender that hangs up: the relay closes the circuit, so the target stops the trip at once, and the
            # sender's one circuit is free again
            with pytest.raises(WireError) as caught:
                await trip.via_relay(target_id, relay_id, b"hang", 1.0, 1 << 20)
            assert caught.value.code is ErrorCode.TIMEOUT
            await asyncio.wait_for(hung_up.wait(), 5.0)
            assert servicer.abandoned == 1

            # past the transport's bound on a message: cut with `too_large`, the relay buffering one piece at most
            with pytest.raises(WireError) as caught:
                raise_if_error(await trip.via_relay(target_id, relay_id, b"y" * (3 << 20), 20.0, 1 << 20))
            assert caught.value.code is ErrorCode.TOO_LARGE
            assert service.refused["too_large"] == 1 and service.refused["overloaded"] == 1

            # only the chosen relay delivers: the sender itself cannot name senders to the target
            stranger = await _p2p(target)
            try:
                _, reader, writer = await stranger.call_binary_stream_handler(target.peer_id, "ns::relay.deliver")
                writer.write(b"\x05hello")
                await writer.drain()
                assert await asyncio.wait_for(reader.read(), 10) == b""
                assert client.delivered == 4  # the slow, hung-up and cut trips; the stranger's is not counted
            finally:
                await stranger.shutdown()
            # `send` goes straight to a peer it holds a connection to (p2pd's own discovery connects these on
            # loopback), and through the relay otherwise
            trip.connected, trip.listed = set(), float("inf")
            assert await trip.send(target_id, relay_id, b"via", 20.0, 1 << 20) == b"echo:via"
            assert trip.relayed == 6 and trip.direct == 0
            trip.connected = {target_id}
            assert await trip.send(target_id, relay_id, b"direct", 20.0, 1 << 20) == b"echo:direct"
            assert trip.direct == 1 and trip.relayed == 6
        finally:
            for p2p in (sender, target, relay):
                await p2p.shutdown()

    asyncio.run(run())


def test_kv_through_the_relay_to_the_lane_peer_the_record_names():
    """A lane's K/V goes through the `Link` of its trip: with no connection to the lane peer and a record naming
    its relay, the relay's K/V channel carries it to that peer's `KVService` (the NAT lab, tests/test_nat.py,
    shows the same where no direct path exists)."""
    from nat_kv_node import SPEC, codec, on_wire, payload

    from p2pio.relay_service import KV
    from peer.kv_exchange import KVService, message_limit
    from peer.link import Link

    class Named:
        def __init__(self, relay: str):
            self.relay = relay

        def relay_of(self, peer_id: str) -> str:
            return self.relay

    async def run():
        relay = await _p2p()
        sender, target = await _p2p(relay), await _p2p(relay)
        services = []
        try:
            await RelayService(relay, "ns", Budget(4, 64 << 20, 30.0), max_message=1 << 20).add_handlers()
            for lane, p2p in enumerate((sender, target)):
                service = KVService(p2p, "ns", message_limit(codec(), lane, SPEC.mode))
                service.serve(codec(), lane)
                await service.start()
                services.append(service)
            relay_id = relay.peer_id.to_base58()

            async def candidates() -> list[str]:
                return [relay_id]

            async def no_trips(_sender, _reader, writer) -> None:
                writer.close()

            client = RelayClient(target, "ns", no_trips, candidates)
            await client.start()
            await client.deliver(KV, services[1].servicer.serve_stream)
            client.hold(lambda _: None)
            await asyncio.wait_for(client.changed.wait(), 20)
            link = Link(TripSender(sender, "ns" + KV), Named(relay_id))
            link.sender.connected, link.sender.listed = set(), float("inf")  # as if no connection to the target
            group = [sender.peer_id, target.peer_id]
            lane0 = await services[0].open("trip", group, link=link)
            lane1 = await services[1].open("trip", group)
            await lane0.send_forward(0, *payload(0))
            received = await lane1.receive_forward(0, timeout=20.0)
            assert on_wire(received[0]) == on_wire(payload(0))
            assert link.sender.relayed == 1 and link.sender.direct == 0 and client.delivered == 1
            for exchange in (lane0, lane1):
                exchange.close()
        finally:
            for service in services:
                await service.stop()
            for p2p in (sender, target, relay):
                await p2p.shutdown()

    asyncio.run(run())


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
