"""K/V messages of trips a lane has not registered yet, held within bounds (pure: the caller passes the clock).

A lane may hear from a trip before it registered the trip itself: its own boundary message can be slower than an
earlier lane's K/V (`peer/kv_exchange.py`). Such messages wait here as bytes, bounded per sender, per trip id and
in all (bytes and count) and for a TTL; a message that would break a bound is refused `overloaded`. Peer ids cost
nothing, so the per-sender bounds alone do not protect the total: the service admits only known lane peers of
its stage before a stream is read, and the per-trip bound keeps one trip id from taking the room of others.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hivemind.p2p import PeerID

from swarm.cp_wire import KVHeader
from swarm.wire import ErrorCode, WireError


@dataclass(frozen=True)
class BufferLimits:
    """Bounds of the messages held for trips not registered yet. An honest early lane sends at most one
    message per layer of the stage per trip before the slow lane registers it; the defaults leave room
    for several trips of a stage of dozens of layers with compressed K/V, and a few dense ones."""

    total_bytes: int = 64 << 20
    total_count: int = 1024
    sender_bytes: int = 16 << 20
    sender_count: int = 256
    ttl: float = 20.0
    # per trip id: an honest trip sends a lane at most one message per layer from each other lane before the lane
    # registers it (`KVService.serve` sets it from the stage's layers and lanes), so a flood under one trip id, or
    # a made-up trip, cannot take what the other trips' early messages need
    trip_count: int = 256


@dataclass
class EarlyMessage:
    sender: PeerID
    header: KVHeader
    blob: bytes
    expires: float = 0.0


class EarlyBuffer:
    """Messages of trips not registered yet, within `BufferLimits`. Pure: the caller passes the clock.
    The TTL is the same for all, so messages expire in arrival order."""

    def __init__(self, limits: BufferLimits):
        self.limits = limits
        self.messages: dict[int, EarlyMessage] = {}  # arrival order
        self.by_trip: dict[str, list[int]] = {}
        self.sender_bytes: Counter[PeerID] = Counter()
        self.sender_count: Counter[PeerID] = Counter()
        self.bytes = 0
        self._next = 0

    def check_room(self, sender: PeerID, trip_id: str, size: int, now: float) -> None:
        """Refuse (`overloaded`) a message of `size` bytes from `sender` that would break a bound."""
        self.expire(now)
        limits = self.limits
        if len(self.by_trip.get(trip_id, ())) >= limits.trip_count:
            raise WireError(ErrorCode.OVERLOADED, "too many K/V messages held for this unregistered trip")
        if self.sender_count[sender] >= limits.sender_count or self.sender_bytes[sender] + size > limits.sender_bytes:
            raise WireError(ErrorCode.OVERLOADED, "too many K/V messages of unregistered trips from this sender")
        if len(self.messages) >= limits.total_count or self.bytes + size > limits.total_bytes:
            raise WireError(ErrorCode.OVERLOADED, "too many K/V messages of unregistered trips held")

    def add(self, message: EarlyMessage, now: float) -> None:
        self.check_room(message.sender, message.header.trip_id, len(message.blob), now)
        head = message.header
        for held in self.held(head.trip_id):
            same = (held.header.kind, held.header.layer, held.header.src) == (head.kind, head.layer, head.src)
            if same and held.sender == message.sender:
                raise WireError(ErrorCode.MALFORMED, f"a second {head.kind} message of layer {head.layer}")
        message.expires = now + self.limits.ttl
        key, self._next = self._next, self._next + 1
        self.messages[key] = message
        self.by_trip.setdefault(head.trip_id, []).append(key)
        self._account(message, 1)

    def held(self, trip_id: str) -> list[EarlyMessage]:
        return [self.messages[key] for key in self.by_trip.get(trip_id, [])]

    def take(self, trip_id: str, now: float) -> list[EarlyMessage]:
        """Remove and return the live messages of `trip_id`."""
        self.expire(now)
        taken = [self.messages.pop(key) for key in self.by_trip.pop(trip_id, [])]
        for message in taken:
            self._account(message, -1)
        return taken

    def expire(self, now: float) -> None:
        while self.messages:
            key = next(iter(self.messages))
            message = self.messages[key]
            if message.expires > now:
                return
            del self.messages[key]
            keys = self.by_trip[message.header.trip_id]
            keys.remove(key)
            if not keys:
                del self.by_trip[message.header.trip_id]
            self._account(message, -1)

    def _account(self, message: EarlyMessage, sign: int) -> None:
        size = len(message.blob)
        self.bytes += sign * size
        self.sender_bytes[message.sender] += sign * size
        self.sender_count[message.sender] += sign
        if not self.sender_count[message.sender]:
            del self.sender_bytes[message.sender], self.sender_count[message.sender]
