"""Can the swarm reach this peer, and how (issue 15): "direct", "via relay" or "unreachable".

A peer behind a home router without a port forward cannot be dialled on the addresses it announces.
hivemind 1.1.12's p2pd circuit relay does not help (it reserves a slot about 3 minutes after start and never
reports a circuit address: benchmarks/RESULTS.md "Reaching a peer behind a home router"), so such a peer
registers with an application-level relay for trips (`peer/relay.py`) and names it in its record. This
module finds out which case a peer is in: "direct" (a helper dialled it back), "via relay" (it was not
dialled back and a relay holds its registration now) or "unreachable" (neither: relays off, or none found).

The check (`ask_dial_back`): a joining peer asks a peer already in the swarm to open a fresh TCP
connection to each TCP address it announces and to complete libp2p's multistream-select greeting
there. A fresh connection is the point: the helper's libp2p connection to us is the one we opened, so
dialling us by peer id would prove nothing. A greeting proves a libp2p listener answers at that
address (not which peer: the address is ours by our own claim, and only reachability is asked).

The helper's side (`DialBackService`) is input from a remote peer: a request is at most
`MAX_REQUEST_BYTES`, names at most `MAX_ADDRS` TCP addresses, each dial ends after `DIAL_TIMEOUT`,
at most `MAX_CONCURRENT` requests are served at once, one per peer per `PER_PEER_INTERVAL`, and a
global token bucket bounds how often anyone can make the helper dial at all. The helper dials only
addresses on the IP the request came from (the remote address of the requester's connection, as
libp2p's AutoNAT does), so nobody can point a helper at a third party or at the helper's own
network: a NATed peer's private addresses are then not dialled at all (nobody outside reaches them), and a
forwarded port is announced on the router's public IP, the IP the request comes from. Excess requests get
"busy" and cost nothing: all requesters together get a helper to make at most `MAX_ADDRS` connection attempts
per `GLOBAL_REFILL_S` seconds, after a first burst of `GLOBAL_BURST` requests.

The classification (`classify`) and the relay policy (`relay_options`) are pure functions.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import random
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence

from hivemind.p2p import P2P, PeerID

from p2pio.budget import Budget

logger = logging.getLogger("peer")

DIRECT, VIA_RELAY, UNREACHABLE, UNKNOWN = "direct", "via relay", "unreachable", ""
RELAY_MODES = ("auto", "on", "off")

HANDLER = "reachability.dial_back"
MAX_REQUEST_BYTES = 2048
MAX_ADDRS = 4
DIAL_TIMEOUT = 4.0
REQUEST_TIMEOUT = 5.0  # the helper reads the request within this
MAX_CONCURRENT = 2
PER_PEER_INTERVAL = 30.0
GLOBAL_BURST, GLOBAL_REFILL_S = 4, 5.0
GREETING = b"/multistream/1.0.0\n"


# --- policy and classification (pure) ------------------------------------------------------------------


def is_public_ip(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_global
    except ValueError:
        return False


def _host_of(maddr: str) -> str | None:
    parts = maddr.split("/")
    return parts[2] if len(parts) > 2 and parts[1] in ("ip4", "ip6") else None


def relay_options(
    relay: str, announce_maddrs: Sequence[str], host_maddrs: Sequence[str], route_source: str | None
) -> dict:
    """hivemind DHT/P2P keyword arguments for `--relay` (`auto`, `on`, `off`).

    `on` (or `auto` on a machine whose route to the internet leaves from a private address and that announces
    nothing): hold a relay reservation from the start (`force_reachability="private"`; left to AutoNAT, a NATed
    peer was unreachable for a minute in one of two measured runs). It stays a DHT server: hivemind's optimizer
    refuses to step on a DHT client. `auto` on a public machine, on one that announces its (forwarded) address,
    or on one listening on loopback only (a local swarm): auto-relay, which reserves a slot only if AutoNAT
    finds us private. `off`: no reservation; behind NAT that means unreachable."""
    if relay not in RELAY_MODES:
        raise ValueError(f"relay must be one of {RELAY_MODES}, got {relay!r}")
    options: dict = {"use_auto_relay": relay != "off"}
    hosts = [h for h in map(_host_of, host_maddrs) if h is not None]
    loopback_only = bool(hosts) and all(ipaddress.ip_address(h).is_loopback for h in hosts if _is_ip(h))
    behind_nat = not announce_maddrs and not loopback_only and route_source is not None
    behind_nat = behind_nat and not is_public_ip(route_source)
    if relay == "on" or (relay == "auto" and behind_nat):
        options["force_reachability"] = "private"
    return options


def relay_service_flags(enabled: bool, budget: Budget) -> dict:
    """p2pd's flags for carrying circuits for others, which hivemind 1.1.12's `P2P.create` does not forward.
    The budget p2pd supports is per relayed connection (bytes each way, duration) and per peer (open
    circuits); it has no total bandwidth cap. Reservations per peer stay at p2pd's default (128)."""
    if not enabled:
        return {"relayService": 0}
    return {
        "relayService": 1,
        "relayMaxCircuits": budget.circuits_per_peer,
        "relayDataLimit": budget.bytes_per_circuit,
        "relayTimeLimit": f"{budget.seconds_per_circuit:.0f}s",
    }


@contextlib.contextmanager
def daemon_flags(flags: dict) -> Iterator[None]:
    """Append `flags` to the p2pd command line of any P2P started inside (hivemind's DHT forks its child,
    which starts p2pd, while this is in effect: the child keeps the patched class, this process does not)."""
    original = P2P._make_process_args

    def with_flags(*args, **kwargs) -> list[str]:
        return original(*args, **kwargs) + [f"-{k}={v}" for k, v in flags.items()]

    P2P._make_process_args = staticmethod(with_flags)
    try:
        yield
    finally:
        P2P._make_process_args = staticmethod(original)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def tcp_targets(maddrs: Sequence[str], observed: str | None, limit: int = MAX_ADDRS) -> list[tuple[str, int]]:
    """(host, port) of each plain TCP address (no relay circuit, no wildcard) on the IP `observed` (the
    requester's, as the helper sees its connection; None: nothing), deduplicated, at most `limit`."""
    found: list[tuple[str, int]] = []
    for maddr in maddrs:
        parts = str(maddr).split("/")
        if "p2p-circuit" in parts or len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
            continue
        host, port = parts[2], parts[4]
        if not _is_ip(host) or ipaddress.ip_address(host).is_unspecified or not port.isdigit():
            continue
        if observed is None or not _is_ip(observed) or ipaddress.ip_address(host) != ipaddress.ip_address(observed):
            continue
        if not 0 < int(port) < 65536 or (host, int(port)) in found:
            continue
        found.append((host, int(port)))
        if len(found) == limit:
            break
    return found


def classify(dialled_back: bool | None, relay: bool) -> str:
    """`dialled_back`: a helper reached one of our announced addresses (None: no helper answered); `relay`: a relay
    holds our registration now (`peer/relay.py` `RelayClient.relay`), so our record names it and senders use it."""
    if dialled_back:
        return DIRECT
    if dialled_back is None:
        return UNKNOWN
    return VIA_RELAY if relay else UNREACHABLE


def advice(result: str, port_hint: str, relay: str = "") -> str:
    """The one line a volunteer reads at start-up (and again whenever the answer changes)."""
    if result == DIRECT:
        return "reachability: direct (other peers dial this peer on its announced address)"
    if result == VIA_RELAY:
        return (
            f"reachability: via relay {relay[-6:]} (no announced address answers from outside; trips reach this peer "
            "through that relay, over a connection this peer opened). Optional, for a direct path: forward TCP "
            f"{port_hint} on your router and pass --announce-maddrs /ip4/<public-ip>/tcp/{port_hint}"
        )
    if result == UNREACHABLE:
        return (
            "reachability: UNREACHABLE: no announced address answers from outside and no relay holds this peer "
            "(relaying is off, or no directly reachable peer with --relay-service on accepted it yet), so peers "
            "this one has not connected to cannot send it trips. Run with --relay auto (the default), or forward "
            f"TCP {port_hint} on your router and pass --host-maddrs /ip4/0.0.0.0/tcp/{port_hint} "
            f"--announce-maddrs /ip4/<public-ip>/tcp/{port_hint}"
        )
    return "reachability: unknown (no other peer answered a dial-back request yet)"


def route_source() -> str | None:
    """The local address this machine's route to the internet leaves from (no packet is sent), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(("192.0.2.1", 9))  # TEST-NET-1: only the routing table is consulted
            return sock.getsockname()[0]
    except OSError:
        return None


# --- the helper's side -----------------------------------------------------------------------------


async def greets(host: str, port: int, timeout: float = DIAL_TIMEOUT) -> bool:
    """Whether a libp2p listener answers multistream-select at host:port within `timeout`."""
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        writer.write(bytes([len(GREETING)]) + GREETING)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(64), timeout)
        return GREETING in data
    except (OSError, asyncio.TimeoutError):
        return False
    finally:
        if writer is not None:
            writer.close()


class RateLimit:
    """A global token bucket plus one request per peer per interval; memory bounded by `max_peers`."""

    def __init__(
        self,
        burst: int = GLOBAL_BURST,
        refill_s: float = GLOBAL_REFILL_S,
        per_peer: float = PER_PEER_INTERVAL,
        max_peers: int = 1024,
    ):
        self.burst, self.refill_s, self.per_peer, self.max_peers = burst, refill_s, per_peer, max_peers
        self.tokens = float(burst)
        self.stamp: float | None = None
        self.last: dict[str, float] = {}

    def allow(self, peer: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        elapsed = 0.0 if self.stamp is None else now - self.stamp
        self.tokens = min(self.burst, self.tokens + elapsed / self.refill_s)
        self.stamp = now
        if now - self.last.get(peer, -1e18) < self.per_peer or self.tokens < 1:
            return False
        if len(self.last) >= self.max_peers:  # forget peers whose interval is over
            self.last = {p: t for p, t in self.last.items() if now - t < self.per_peer}
            if len(self.last) >= self.max_peers:
                return False
        self.tokens -= 1
        self.last[peer] = now
        return True


class DialBackService:
    """Serves `HANDLER`: dial the requester's TCP addresses, answer which greeted. Never raises."""

    def __init__(self, limit: RateLimit | None = None):
        self.limit = limit or RateLimit()
        self.busy = asyncio.Semaphore(MAX_CONCURRENT)

    async def add_handler(self, p2p) -> None:
        await p2p.add_binary_stream_handler(HANDLER, self.handle)

    async def handle(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            peer = info.peer_id.to_base58()
            if self.busy.locked() or not self.limit.allow(peer):
                await _send(writer, {"busy": True})
                return
            async with self.busy:
                request = await asyncio.wait_for(_receive(reader), REQUEST_TIMEOUT)
                addrs = request.get("addrs") if isinstance(request, dict) else None
                came_from = str(getattr(info, "addr", ""))  # a relayed request has no IP of the requester's
                observed = None if "p2p-circuit" in came_from else _host_of(came_from)
                wanted = [a for a in addrs if isinstance(a, str)] if isinstance(addrs, list) else []
                targets = tcp_targets(wanted, observed)
                answers = await asyncio.gather(*(greets(h, p) for h, p in targets))
                await _send(
                    writer, {"reached": [f"{h}:{p}" for (h, p), ok in zip(targets, answers, strict=True) if ok]}
                )
        except Exception as exc:  # noqa: BLE001 - a remote peer's bad request must not reach the caller
            logger.debug("dial-back request refused: %s", exc)
        finally:
            writer.close()


async def _send(writer: asyncio.StreamWriter, message: dict) -> None:
    data = json.dumps(message).encode()
    writer.write(struct.pack(">I", len(data)) + data)
    await writer.drain()


async def _receive(reader: asyncio.StreamReader) -> object:
    (size,) = struct.unpack(">I", await reader.readexactly(4))
    if size > MAX_REQUEST_BYTES:
        raise ValueError(f"request of {size} bytes")
    return json.loads(await reader.readexactly(size))


# --- the joining peer's side ------------------------------------------------------------------------


async def ask_dial_back(p2p, helper, addrs: Sequence[str], timeout: float = 3 * DIAL_TIMEOUT) -> bool | None:
    """Ask `helper` (a PeerID) to dial `addrs`; True/False, or None if it did not answer (busy, gone, old)."""
    try:
        _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(helper, HANDLER), timeout)
        try:
            await _send(writer, {"addrs": [str(a) for a in addrs][: MAX_ADDRS * 2]})
            answer = await asyncio.wait_for(_receive(reader), timeout)
        finally:
            writer.close()
    except Exception:  # noqa: BLE001 - any failure means this helper gave no answer
        return None
    if not isinstance(answer, dict) or answer.get("busy") or not isinstance(answer.get("reached"), list):
        return None
    return bool(answer["reached"])


class ReachabilityCheck:
    """Serves dial-back requests of others and checks this peer once helpers exist (the first peer of a swarm
    has none yet): logs one line and keeps the answer (`result`, `relay`) for the peer's record. Helpers are a
    few online peers at random from the stage records (`fetch`). A peer not dialled back holds a relay through
    `relay_client` (None: `--relay off`); the line is logged again when the answer changes."""

    def __init__(
        self,
        p2p,
        fetch: Callable[[], Awaitable[dict]],
        own_id: str,
        host_maddrs: Sequence[str],
        label: Callable[[], str],
        relay_client=None,
    ):
        self.p2p, self.fetch, self.own_id, self.label = p2p, fetch, own_id, label
        self.relay_client = relay_client
        ports = [parts[4] for parts in (str(a).split("/") for a in host_maddrs) if parts[3:4] == ["tcp"]]
        self.port_hint = next((port for port in ports if port.isdigit() and port != "0"), "31337")
        self.dialled: bool | None = None
        self.logged = UNKNOWN
        self.task: asyncio.Task | None = None

    @property
    def relay(self) -> str:
        """The relay this peer's record names: only while it is not directly reachable and one holds it."""
        return self.relay_client.relay if self.relay_client is not None and self.dialled is False else ""

    @property
    def result(self) -> str:
        return classify(self.dialled, bool(self.relay))

    async def start(self) -> None:
        await DialBackService().add_handler(self.p2p)
        self.task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    async def helpers(self) -> list[str]:
        try:
            stages = await self.fetch()
        except Exception:  # noqa: BLE001 - no helpers this round; the next attempt reads again
            return []
        found = {e.record.peer_id for entries in stages.values() for e in entries if e.record.state == "online"}
        found.discard(self.own_id)
        return random.sample(sorted(found), min(3, len(found)))

    async def own_addrs(self) -> list[str]:
        return [str(a) for a in await self.p2p.get_visible_maddrs(latest=True)]  # as the daemon lists them now

    def report(self, *_: object) -> None:
        """Log the answer if it changed since the last line."""
        if self.result != self.logged:
            self.logged = self.result
            (logger.warning if self.result == UNREACHABLE else logger.info)(
                "%s %s", self.label(), advice(self.result, self.port_hint, self.relay)
            )

    async def settle(self, dialled: bool, relay_wait: float) -> None:
        """Take a helper's answer; not dialled back, with relaying on, look for a relay first (up to `relay_wait`),
        the answer unknown meanwhile: the record never says "unreachable" while a relay is about to accept."""
        if not dialled and self.relay_client is not None:
            self.relay_client.hold(self.report)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.relay_client.changed.wait(), relay_wait)
        self.dialled = dialled
        self.report()

    async def run(self, attempts: int = 12, interval: float = 10.0, relay_wait: float = 30.0) -> None:
        for _ in range(attempts):
            addrs = await self.own_addrs()
            dialled = None
            for helper in await self.helpers():
                dialled = await ask_dial_back(self.p2p, PeerID.from_base58(helper), addrs)
                if dialled is not None:
                    break
            if dialled is None:
                await asyncio.sleep(interval)
                continue
            await self.settle(dialled, relay_wait)
            return
        logger.info("%s %s", self.label(), advice(UNKNOWN, self.port_hint))
