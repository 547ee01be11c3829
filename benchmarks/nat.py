"""How a peer behind a home router is reached through hivemind 1.1.12's bundled p2pd (issue 15's first question).

An emulated internet on one machine: a bridge namespace joins public hosts (a relay/bootstrap peer `A`
and a dialling peer `C`) and home routers; a router namespace masquerades its LAN behind its public
address with iptables (no port forward unless asked). Peer `B` sits behind such a router and serves an
echo stream handler; `C` dials `B` by peer id only, as a trip sender does. Cases:

- `public`: B on the bridge itself (the baseline: a direct dial).
- `forwarded`: B behind a NAT whose router forwards B's port (DNAT) and B announces the public address.
- `cone`: a port-preserving NAT (plain MASQUERADE), no forward.
- `symmetric`: MASQUERADE --random-fully (a new public port per connection), no forward.
- `both-symmetric`: B and C each behind their own symmetric NAT.

B runs with `use_auto_relay` and, unless `--no-force-private`, `force_reachability="private"` (so it
reserves a slot on the bootstrap peer at once instead of waiting for AutoNAT). Per case: whether C
reached B, seconds from C's start to the first echo, what kind of connection carried it (a direct
TCP connection, through the router's public address or not, or a `/p2p-circuit` relay), and the echo
throughput of 16 MiB.

    sudo python -m benchmarks.nat [--cases public cone ...] [--app-relay] [--json OUT]

`--app-relay` measures the application-level trip relay (peer/relay.py) instead: A relays, B registers with it,
and C sends trips to B straight and through A (median ms of a 28 KB trip, Mbit/s of 4 MiB trips both ways).

Every namespace is named `pnat<hex>-…` and deleted on exit, also on failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = ("public", "forwarded", "cone", "symmetric", "both-symmetric")
RELAY_PORT, B_PORT = 40000, 41000
ECHO_BYTES = 16 << 20
NAMESPACE = "natbench"
TRIP_SMALL, TRIP_LARGE = 28 << 10, 4 << 20  # a compressed boundary message; a dense one


def sh(*args: str, check: bool = True) -> str:
    done = subprocess.run(args, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


class Internet:
    """Namespaces `<tag>-net` (the bridge), public hosts on 10.89.0.0/24, home routers with a LAN each."""

    def __init__(self) -> None:
        self.tag = "pnat" + secrets.token_hex(2)
        self.names: list[str] = []
        self.next_public = 2
        try:
            self.ns("net")
            sh("ip", "-n", self.name("net"), "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", self.name("net"), "link", "set", "br0", "up")
        except Exception:
            self.close()  # the caller gets no object to close
            raise

    def name(self, short: str) -> str:
        return f"{self.tag}-{short}"

    def ns(self, short: str) -> str:
        name = self.name(short)
        sh("ip", "netns", "add", name)
        self.names.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")
        return name

    def public_host(self, short: str) -> str:
        """A namespace with one address on the bridge; returns that address."""
        name, address = self.ns(short), f"10.89.0.{self.next_public}"
        self.next_public += 1
        outside, inside = f"{self.tag}{short}b", f"{self.tag}{short}e"
        bridge = self.name("net")
        sh("ip", "link", "add", inside, "netns", name, "type", "veth", "peer", "name", outside, "netns", bridge)
        sh("ip", "-n", self.name("net"), "link", "set", outside, "master", "br0")
        sh("ip", "-n", self.name("net"), "link", "set", outside, "up")
        sh("ip", "-n", name, "addr", "add", f"{address}/24", "dev", inside)
        sh("ip", "-n", name, "link", "set", inside, "up")
        return address

    def home(self, short: str, lan: int, nat: str, forward_port: int | None = None) -> tuple[str, str]:
        """A router `<short>r` (public address, NAT kind `cone` or `symmetric`) and a host `<short>` behind it
        on 192.168.<lan>.2; returns (host's LAN address, router's public address)."""
        router = self.name(short + "r")
        public = self.public_host(short + "r")
        host = self.ns(short)
        wan, lan_side, host_side = f"{self.tag}{short}re", f"{self.tag}{short}l", f"{self.tag}{short}h"
        sh("ip", "link", "add", host_side, "netns", host, "type", "veth", "peer", "name", lan_side, "netns", router)
        private = f"192.168.{lan}.2"
        sh("ip", "-n", host, "addr", "add", f"{private}/24", "dev", host_side)
        sh("ip", "-n", host, "link", "set", host_side, "up")
        sh("ip", "-n", router, "addr", "add", f"192.168.{lan}.1/24", "dev", lan_side)
        sh("ip", "-n", router, "link", "set", lan_side, "up")
        sh("ip", "-n", host, "route", "add", "default", "via", f"192.168.{lan}.1")
        sh("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        masquerade = ["-j", "MASQUERADE"] + (["--random-fully"] if nat == "symmetric" else [])
        sh("ip", "netns", "exec", router, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", wan, *masquerade)
        if forward_port is not None:
            sh("ip", "netns", "exec", router, "iptables", "-t", "nat", "-A", "PREROUTING", "-i", wan, "-p", "tcp",
               "--dport", str(forward_port), "-j", "DNAT", "--to-destination", f"{private}:{forward_port}")
        return private, public

    def close(self) -> None:
        for name in reversed(self.names):
            for pid in sh("ip", "netns", "pids", name, check=False).split():
                subprocess.run(["kill", "-9", pid], capture_output=True)
            sh("ip", "netns", "del", name, check=False)


# --- the nodes (run inside the namespaces) ----------------------------------------------------------------


async def _echo(_info, reader, writer) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


async def _echo_trip(blob: bytes, _remote) -> bytes:
    return blob


async def _trips(p2p, target: str, relay: str) -> dict:
    """Trips of the application-level relay (peer/relay.py): per path (straight to B, through A's relay), the
    median seconds of TRIP_SMALL-byte trips (latency) and Mbit/s of TRIP_LARGE-byte trips (both ways counted)."""
    from peer.relay import TripSender

    sender, found = TripSender(p2p, NAMESPACE), {}
    for path in ("direct", "relay"):
        send = sender.via_relay if path == "relay" else (lambda peer, _relay, *rest: sender.send(peer, "", *rest))
        try:
            seconds = []
            for _ in range(20):
                started = time.monotonic()
                assert await send(target, relay, b"s" * TRIP_SMALL, 30.0, TRIP_LARGE) == b"s" * TRIP_SMALL
                seconds.append(time.monotonic() - started)
            started = time.monotonic()
            for _ in range(4):
                assert len(await send(target, relay, b"L" * TRIP_LARGE, 120.0, TRIP_LARGE)) == TRIP_LARGE
            mbit = 8 * 2 * 4 * TRIP_LARGE / (time.monotonic() - started) / 1e6
            median = sorted(seconds)[len(seconds) // 2]
            found[path] = {"trip_ms": round(1000 * median, 1), "trip_mbit_s": round(mbit, 1)}
        except Exception as exc:  # noqa: BLE001 - a path that does not work is a result
            found[path] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}
    return found


async def node(role: str, workdir: Path, options: dict) -> None:
    """A: relay and bootstrap. B: the peer behind the router, echoing. C: dials B by id and measures.
    With `app_relay`, A also runs peer/relay.py's RelayService, B registers with it and echoes trips, and C
    measures trips straight to B and through A (`_trips`)."""
    from hivemind.p2p import P2P, PeerID

    from p2pio.relay_service import Budget, RelayService
    from peer.relay import RelayClient
    from peer.transport import TripServicer

    app = options.get("app_relay", False)
    if role == "a":
        p2p = await P2P.create(host_maddrs=[f"/ip4/{options['address']}/tcp/{RELAY_PORT}"])
        if app:
            await RelayService(p2p, NAMESPACE, Budget(16, 1 << 30, 600.0), TRIP_LARGE).add_handlers()
        (workdir / "a.json").write_text(json.dumps({"id": p2p.peer_id.to_base58()}))
        await asyncio.sleep(3600)
    relay = json.loads((workdir / "a.json").read_text())["id"]
    boot = [f"/ip4/{options['relay_address']}/tcp/{RELAY_PORT}/p2p/{relay}"]
    if role == "b":
        p2p = await P2P.create(initial_peers=boot, host_maddrs=[f"/ip4/0.0.0.0/tcp/{B_PORT}"], **options["p2p"])
        await p2p.add_binary_stream_handler("echo", _echo)
        if app:
            servicer = TripServicer(_echo_trip, max_bytes=TRIP_LARGE)
            await servicer.add_p2p_handlers(p2p, namespace=NAMESPACE)

            async def candidates() -> list[str]:
                return [relay]

            client = RelayClient(p2p, NAMESPACE, servicer.serve_stream, candidates)
            await client.start()
            client.hold(lambda _: None)
            await asyncio.wait_for(client.changed.wait(), 60)
        (workdir / "b.json").write_text(json.dumps({"id": p2p.peer_id.to_base58()}))
        await asyncio.sleep(3600)
    started = time.monotonic()
    target = PeerID.from_base58(json.loads((workdir / "b.json").read_text())["id"])
    if app:
        p2p = await P2P.create(initial_peers=boot, host_maddrs=["/ip4/0.0.0.0/tcp/0"])
        result = await _trips(p2p, target.to_base58(), relay)
        (workdir / "c.json").write_text(json.dumps({"reached": "error" not in result["relay"], "trips": result}))
        return
    if options.get("via_relay"):  # B's circuit address on the relay as a bootstrap peer: p2pd dials it at start
        boot.append(f"{boot[0]}/p2p-circuit/p2p/{target.to_base58()}")
    p2p = await P2P.create(initial_peers=boot, host_maddrs=["/ip4/0.0.0.0/tcp/0"])
    result: dict = {"reached": False}
    while time.monotonic() - started < options["timeout"]:
        try:
            _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(target, "echo"), 10)
            writer.write(b"ping")
            await writer.drain()
            await asyncio.wait_for(reader.readexactly(4), 10)
            result.update(reached=True, first_echo_s=round(time.monotonic() - started, 2))
            result.pop("last_error", None)
            sent = time.monotonic()
            reading = asyncio.create_task(reader.readexactly(ECHO_BYTES))
            for _ in range(ECHO_BYTES >> 20):
                writer.write(b"x" * (1 << 20))
                await writer.drain()
            await asyncio.wait_for(reading, 120)
            result["echo_mbit_s"] = round(8 * ECHO_BYTES / (time.monotonic() - sent) / 1e6, 1)
            break
        except Exception as exc:  # noqa: BLE001 - keep trying until the timeout; report the last reason
            result["last_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            await asyncio.sleep(2)
    for info in await p2p.list_peers():
        if info.peer_id == target:
            result["connection"] = [str(a) for a in info.addrs]
    (workdir / "c.json").write_text(json.dumps(result))


# --- the cases ----------------------------------------------------------------------------------------------


def _wait_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not appear within {timeout:.0f}s")
        time.sleep(0.2)


def run_case(case: str, force_private: bool, timeout: float, via_relay: bool, app_relay: bool = False) -> dict:
    net, workdir = Internet(), Path(tempfile.mkdtemp(prefix="nat-"))
    children: list[subprocess.Popen] = []

    def spawn(namespace: str, role: str, options: dict) -> subprocess.Popen:
        command = ["ip", "netns", "exec", namespace, sys.executable, "-m", "benchmarks.nat", "--node", role,
                   str(workdir), json.dumps(options)]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        with open(workdir / f"{role}.log", "w") as log:  # the child holds its own copy of the descriptor
            child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        children.append(child)
        return child

    try:
        relay_address = net.public_host("a")
        spawn(net.name("a"), "a", {"address": relay_address, "app_relay": app_relay})
        _wait_file(workdir / "a.json", 60)
        b_options: dict = {"use_auto_relay": True}
        if case == "public":
            net.public_host("b")
            b_options = {}
        elif case == "forwarded":
            _, public = net.home("b", 10, "cone", forward_port=B_PORT)
            b_options = {"announce_maddrs": [f"/ip4/{public}/tcp/{B_PORT}"]}
        else:
            net.home("b", 10, "symmetric" if "symmetric" in case else "cone")
            if force_private:
                b_options["force_reachability"] = "private"
        spawn(net.name("b"), "b", {"relay_address": relay_address, "p2p": b_options, "app_relay": app_relay})
        _wait_file(workdir / "b.json", 60)
        if case == "both-symmetric":
            net.home("c", 20, "symmetric")
        else:
            net.public_host("c")
        time.sleep(5)  # B's reservation on the relay, as a peer that joined a little earlier would have
        c_options = {"relay_address": relay_address, "timeout": timeout, "via_relay": via_relay, "app_relay": app_relay}
        c = spawn(net.name("c"), "c", c_options)
        c.wait(timeout=timeout + 180)
        if (workdir / "c.json").exists():
            result = json.loads((workdir / "c.json").read_text())
        else:  # C's daemon did not start (e.g. it could not reach a bootstrap address)
            lines = [line for line in (workdir / "c.log").read_text().splitlines() if line.strip()]
            result = {"reached": False, "last_error": lines[-1][-200:] if lines else "C exited"}
    finally:
        for child in children:
            child.kill()
            child.wait()
        net.close()
        shutil.rmtree(workdir, ignore_errors=True)  # the row holds what the run found
    connection = result.get("connection", [])
    result["kind"] = ("relay" if any("p2p-circuit" in a for a in connection) else "direct") if connection else "-"
    suffix = " (trips, peer/relay.py)" if app_relay else " (dialled via the relay)" if via_relay else ""
    return {"case": case + suffix, **result}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds C keeps trying to reach B")
    parser.add_argument("--no-force-private", action="store_true", help="let AutoNAT find out B is private")
    parser.add_argument("--via-relay", action="store_true", help="C dials B's circuit address on the relay first")
    parser.add_argument("--app-relay", action="store_true", help="trips straight to B vs through peer/relay.py on A")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--node", nargs=3, metavar=("ROLE", "WORKDIR", "OPTIONS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.node:
        role, workdir, options = args.node
        asyncio.run(node(role, Path(workdir), json.loads(options)))
        return 0
    if os.geteuid() != 0:
        parser.error("needs root: it creates network namespaces and iptables rules")
    rows = []
    for case in args.cases:
        row = run_case(case, not args.no_force_private, args.timeout, args.via_relay, args.app_relay)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.app_relay:
        print("\n| case | straight to B | through A's trip relay |\n|---|---|---|")
        for r in rows:
            trips = r.get("trips", {})
            print(f"| {r['case']} | {trips.get('direct', r.get('last_error'))} | {trips.get('relay', '-')} |")
        return 0
    print("\n| case | reached | first echo s | connection | echo Mbit/s |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['reached']} | {r.get('first_echo_s', '-')} | {r['kind']} "
              f"{' '.join(r.get('connection', []))} | {r.get('echo_mbit_s', '-')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
