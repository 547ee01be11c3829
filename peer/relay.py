"""An application-level relay for trips: how a peer behind a home router serves its stage (issue 15).

Why not libp2p's circuit relay: hivemind 1.1.12's bundled p2pd (the only one available) reserves an
auto-relay slot only ~3 minutes after start, never reports a `/p2p-circuit` address, and hivemind's Python
multiaddr encodes `/p2p/<id>` in a form the daemon's connect refuses; two peers each behind a symmetric NAT
never reached each other through it (benchmarks/RESULTS.md, "Reaching a peer behind a home router"). A trip
is one request/reply of bytes over one stream, so a peer can carry it for another without libp2p's help:

- **The NATed peer** (`RelayClient`) registers with a directly reachable peer that offers `--relay-service`
  (`REGISTER`), over a connection it opened itself, and re-registers every `REGISTER_INTERVAL` so that
  connection stays up (moving to another relay when its own refuses or stops being listed as a candidate).
  Its signed record names the relay (`StagePeerRecord.relay`).
- **A sender** (`TripSender`) sends straight to the peer when it holds a connection to it or the peer names
  no relay; otherwise, or when the direct attempt finds no way through (`unreachable`), it opens `FORWARD`
  on the named relay: the target's peer id, then the trip's frames, unchanged.
- **The relay** (`p2pio.relay_service.RelayService`) opens `DELIVER` on the target over the target's own
  connection, writes the sender's peer id (as libp2p authenticated it) and pipes the bytes both ways,
  `READ_PIECE` at a time: it buffers no more than one piece per direction, never a whole message. Budget,
  all refused with a coded error reply the sender's trip logic already handles: `--relay-max-circuits`
  circuits per sender at once and `MAX_CIRCUITS` in all (`overloaded`), `--relay-data-limit-mib` and the
  transport's own bound on a message (`wire_bound`) per circuit each way (`too_large`), `--relay-time-limit`
  per circuit (`timeout`); only registered targets (at most `MAX_REGISTERED`) are reached (`unreachable`),
  so a relay cannot be pointed at third parties.
- **The target** accepts `DELIVER` only from the relay it registered with and hands the stream to the same
  bounded reader as a direct trip (`TripServicer.serve_stream`), admitting the named sender as usual.

Security. A relay sees a trip's bytes and can drop, delay or cut them; it cannot read anything a direct
trip's sender could not, and what it forges is held to the checks every reply passes: a forged reply must
decode as the expected backward message (shape, version, finite values, hop versions), and the sender's
audit trips compare an unverified peer's replies with a verified peer's (`peer/audit.py`). A relay can name
a false sender to the target; the target admits only known upstream peers, so that buys the relay no more
than a misbehaving upstream peer has. Refusals by a relay are counted against the target it was asked to
reach (the sender cannot tell them apart), so a hostile relay can get its targets banned by their senders.
Registration is open to any peer id (a NATed peer has no record yet when it registers): fresh identities can
fill the `MAX_REGISTERED` slots for `REGISTRATION_TTL`, turning honest newcomers away from that relay (they
try the next candidate); they gain no circuits by it, since circuits are budgeted per sender.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import closing

from hivemind.p2p import P2P, PeerID

from p2pio.relay_service import (
    ACCEPTED,
    CHANNELS,
    CONNECT_TIMEOUT,
    DELIVER,
    FORWARD,
    HEADER_TIMEOUT,
    REGISTER,
    TRIPS,
    RelayService,
    handler,
    read_id,
)
from peer.options import PeerOptions
from peer.transport import send_trip
from swarm.records import PeerEntry
from swarm.wire import ErrorCode, WireError

REGISTER_INTERVAL = 20.0
RETRY_INTERVAL = 5.0
CONNECTED_CACHE_S = 2.0

Serve = Callable[[PeerID, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def relay_candidates(stages: dict[int, list[PeerEntry]], own_id: str, bootstrap: Sequence[str] = ()) -> list[str]:
    """Peers that may relay for us, best first: online peers found directly reachable, then the bootstrap nodes
    (the tracker's node relays too, `tracker/relay.py`; it has no stage record), then online peers not yet
    checked; never one that is itself relayed or unreachable (a relay must be dialable by every sender)."""
    direct, unchecked = set(), set()
    for entries in stages.values():
        for entry in entries:
            record = entry.record
            if record.state != "online" or record.peer_id == own_id or record.relay:
                continue
            if record.reachability == "direct":
                direct.add(record.peer_id)
            elif record.reachability == "":
                unchecked.add(record.peer_id)
    nodes = [peer for peer in dict.fromkeys(bootstrap) if peer != own_id and peer not in direct]
    others = sorted(unchecked - direct - set(nodes))
    return random.sample(sorted(direct), len(direct)) + nodes + random.sample(others, len(others))


def bootstrap_ids(maddrs: Sequence[str]) -> list[str]:
    """The peer ids named by `/p2p/<id>` at the end of bootstrap multiaddrs (the others are skipped)."""
    found = []
    for maddr in maddrs:
        _, _, peer = str(maddr).rpartition("/p2p/")
        try:
            found.append(PeerID.from_base58(peer).to_base58())
        except Exception:  # noqa: BLE001 - no id in this address, or not base58
            continue
    return found


class RelayClient:
    """A peer not directly reachable: holds a registration with a relay (`relay`, "" while none) and serves the
    trips it delivers. `candidates()` lists possible relays (`relay_candidates` over fresh records)."""

    def __init__(self, p2p: P2P, namespace: str, serve: Serve, candidates: Callable[[], Awaitable[list[str]]]):
        self.p2p, self.namespace, self.serve, self.candidates = p2p, namespace, serve, candidates
        self.relay = ""
        self.changed = asyncio.Event()  # set at the first change of `relay`
        self.delivered = 0
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.deliver(TRIPS, self.serve)

    async def deliver(self, channel: str, serve: Serve) -> None:
        """Hand what our relay delivers on `channel` (`p2pio.relay_service.CHANNELS`) to `serve`."""

        async def delivered(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._deliver(info, reader, writer, serve)

        await self.p2p.add_binary_stream_handler(handler(self.namespace + channel, DELIVER), delivered)

    def hold(self, on_change: Callable[[str], None]) -> None:
        """Keep a relay from now on (in the background); `on_change(relay)` when it changes."""
        if self.task is None:
            self.task = asyncio.create_task(self._hold(on_change))

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    async def _deliver(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, serve: Serve) -> None:
        if not self.relay or info.peer_id.to_base58() != self.relay:
            writer.close()  # only the relay we chose delivers: nobody else can name senders to us
            return
        try:
            sender = await read_id(reader)
        except WireError:
            writer.close()
            return
        self.delivered += 1
        await serve(sender, reader, writer)

    async def register(self, relay: str) -> bool:
        try:
            opened = self.p2p.call_binary_stream_handler(PeerID.from_base58(relay), handler(self.namespace, REGISTER))
            _, reader, writer = await asyncio.wait_for(opened, CONNECT_TIMEOUT)
            with closing(writer):
                return await asyncio.wait_for(reader.read(1), HEADER_TIMEOUT) == ACCEPTED
        except Exception:  # noqa: BLE001 - not a relay (no such handler), gone, or full
            return False

    async def _hold(self, on_change: Callable[[str], None]) -> None:
        """Re-register every REGISTER_INTERVAL; change relays when ours refuses, or when the records no longer
        list it as a candidate while they list others (it turned out to be relayed or unreachable itself)."""
        while True:
            try:
                found = await self.candidates()
            except Exception:  # noqa: BLE001 - no records this round: keep what we have, try again
                found = []
            unfit = bool(found) and self.relay not in found
            if self.relay and (unfit or not await self.register(self.relay)):
                self.relay = ""
                self.changed.set()
                on_change("")
            if not self.relay:
                for candidate in found[:8]:
                    if await self.register(candidate):
                        self.relay = candidate
                        self.changed.set()
                        on_change(candidate)
                        break
            await asyncio.sleep(REGISTER_INTERVAL if self.relay else RETRY_INTERVAL)


class TripSender:
    """Sends a trip straight to a peer, or through the relay its record names (module docstring)."""

    def __init__(self, p2p: P2P, namespace: str):
        self.p2p, self.namespace = p2p, namespace
        self.connected: set[str] = set()
        self.listed = -float("inf")
        self.direct = self.relayed = 0

    async def is_connected(self, peer_id: str) -> bool:
        """Whether p2pd holds a plain (not circuit) connection to `peer_id` (cached CONNECTED_CACHE_S)."""
        if time.monotonic() - self.listed > CONNECTED_CACHE_S:
            infos = await self.p2p.list_peers()
            self.connected = {
                info.peer_id.to_base58() for info in infos if any("p2p-circuit" not in str(a) for a in info.addrs)
            }
            self.listed = time.monotonic()
        return peer_id in self.connected

    async def send(self, peer_id: str, relay: str, blob: bytes, timeout: float, max_reply: int) -> bytes:
        peer = PeerID.from_base58(peer_id)
        # no relay named, we are its relay (it registered over a connection to us), or a connection is up: direct
        if not relay or relay == self.p2p.peer_id.to_base58() or await self.is_connected(peer_id):
            try:
                reply = await send_trip(self.p2p, peer, self.namespace, blob, timeout, max_reply)
                self.direct += 1
                return reply
            except WireError as exc:
                if not relay or exc.code is not ErrorCode.UNREACHABLE:
                    raise
                self.connected.discard(peer_id)
        return await self.via_relay(peer_id, relay, blob, timeout, max_reply)

    async def via_relay(self, peer_id: str, relay: str, blob: bytes, timeout: float, max_reply: int) -> bytes:
        raw = PeerID.from_base58(peer_id).to_bytes()
        reply = await send_trip(
            self.p2p, PeerID.from_base58(relay), self.namespace, blob, timeout, max_reply,
            handle=handler(self.namespace, FORWARD), prefix=bytes([len(raw)]) + raw,
        )
        self.relayed += 1
        return reply


class Relaying:
    """A peer's part in relaying, started once per process: its `senders` (one per channel: every message it
    sends, `peer/link.py`), its `client` (when `--relay` is not off; `peer/reachability.py` decides whether it
    holds a relay; `deliver` adds a channel to what it serves) and its `service` (with `--relay-service on`: it
    carries trips for others, its counters logged every LOG_INTERVAL)."""

    def __init__(
        self,
        p2p: P2P,
        namespace: str,
        options: PeerOptions,
        serve: Serve,
        fetch: Callable[[], Awaitable[dict[int, list[PeerEntry]]]],
        own_id: str,
        max_message: int,
        label: Callable[[], str],
    ):
        bootstrap = bootstrap_ids(options.initial_peers)

        async def candidates() -> list[str]:
            return relay_candidates(await fetch(), own_id, bootstrap)

        o = self.options = options
        self.senders = {channel: TripSender(p2p, namespace + channel) for channel in CHANNELS}
        self.client = RelayClient(p2p, namespace, serve, candidates) if o.relay != "off" else None
        self.service = RelayService(p2p, namespace, o.relay_budget, max_message) if o.relay_service else None
        self.label = label
        self.log_task: asyncio.Task | None = None

    async def start(self) -> None:
        if self.client is not None:
            await self.client.start()
        if self.service is not None:
            await self.service.add_handlers()
            self.log_task = asyncio.create_task(self.service.log_loop(self.label))

    async def deliver(self, channel: str, serve: Serve) -> None:
        """What a relay delivers to us on `channel` goes to `serve` (trips go to the trip handler already)."""
        if self.client is not None:
            await self.client.deliver(channel, serve)

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.stop()
        if self.log_task is not None:
            self.log_task.cancel()
            await asyncio.gather(self.log_task, return_exceptions=True)
