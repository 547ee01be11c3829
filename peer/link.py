"""A link: bytes to a peer id, on one channel of the run, straight or through the relay its record names.

Everything a peer sends another peer goes through one: a trip's boundary message to the next hop
(`peer/trip.py`) and a K/V message to another lane of a trip (`peer/kv_exchange.py`). So a peer behind a
home router, whose signed record names the relay that holds it (`peer/relay.py`), gets both through that
relay, and a sender needs no other path to it. The relay is looked up in the served stage's records
(`peer/routing.py` `Router.relay_of`) at each send: a peer that moved relays is reached through its new one
as soon as its record is read. Below a link: `peer/relay.py` `TripSender` (straight or through a relay) and
`peer/transport.py` `send_trip` (the bounded stream of frames, `p2pio/framing.py`).
"""

from __future__ import annotations

from typing import Protocol

from hivemind.p2p import PeerID

from peer.relay import TripSender


class Relays(Protocol):
    def relay_of(self, peer_id: str) -> str:
        """The relay `peer_id`'s record names, "" for none (or no record)."""


class NoRelays:
    """Every peer straight: where no records are read (a lane's own tests, a direct lab)."""

    def relay_of(self, peer_id: str) -> str:
        return ""


class Link:
    """Sends one message and returns its reply's bytes; failures are WireErrors (`send_trip`)."""

    def __init__(self, sender: TripSender, relays: Relays):
        self.sender, self.relays = sender, relays

    async def send(self, peer: str | PeerID, blob: bytes, timeout: float, max_reply: int) -> bytes:
        peer_id = peer if isinstance(peer, str) else peer.to_base58()
        return await self.sender.send(peer_id, self.relays.relay_of(peer_id), blob, timeout, max_reply)
