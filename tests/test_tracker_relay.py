"""The tracker's DHT node relays trips (tracker/relay.py): a peer that can only be reached through a relay
registers with the tracker's node, found from its bootstrap address, and a trip reaches it through there.
Real hivemind DHT (its own process and p2pd), real libp2p daemons on loopback."""

from __future__ import annotations

import asyncio
import time

from builders import tiny_manifest
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from p2pio.relay_service import Budget
from peer.relay import RelayClient, TripSender, bootstrap_ids, relay_candidates
from peer.transport import TripServicer
from tracker.relay import TrackerRelay
from tracker.service import start_dht

MANIFEST = tiny_manifest()


def test_a_trip_through_the_trackers_node():
    dht = start_dht(MANIFEST, identity=None, initial_peers=[], host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                    announce_maddrs=None, remembered=[])
    relay = TrackerRelay(dht, MANIFEST, Budget(4, 64 << 20, 30.0))
    try:
        relay.start()
        bootstrap = [str(m) for m in dht.get_visible_maddrs()]
        tracker_id = str(dht.peer_id)
        assert bootstrap_ids(bootstrap) == [tracker_id]

        async def run() -> None:
            initial = [Multiaddr(m) for m in bootstrap]
            target = await P2P.create(initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
            sender = await P2P.create(initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
            try:
                async def echo(blob: bytes, remote: PeerID) -> bytes:
                    return b"echo:" + blob

                servicer = TripServicer(echo, max_bytes=1 << 20)
                await servicer.add_p2p_handlers(target, namespace=MANIFEST.run_id)

                async def candidates() -> list[str]:  # no stage records: only the bootstrap node
                    return relay_candidates({}, target.peer_id.to_base58(), bootstrap_ids(bootstrap))

                client = RelayClient(target, MANIFEST.run_id, servicer.serve_stream, candidates)
                await client.start()
                client.hold(lambda _: None)
                await asyncio.wait_for(client.changed.wait(), 30)
                assert client.relay == tracker_id
                trip = TripSender(sender, MANIFEST.run_id)
                reply = await trip.via_relay(target.peer_id.to_base58(), tracker_id, b"hello", 20.0, 1 << 20)
                assert reply == b"echo:hello" and client.delivered == 1
                await client.stop()
            finally:
                await sender.shutdown()
                await target.shutdown()

        asyncio.run(run())
        for _ in range(50):  # the relay counts a circuit when the target closes it
            if relay.service.circuits:
                break
            time.sleep(0.1)
        assert relay.service.circuits == 1 and relay.service.bytes_forward > 5
    finally:
        relay.stop()
        dht.shutdown()
