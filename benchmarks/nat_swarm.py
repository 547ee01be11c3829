"""A real swarm on the emulated internet with its middle stage behind a home router (issue 15).

The tracker (whose DHT node is the bootstrap; its trip relay off here) and a stage-2 peer sit on public addresses of
`benchmarks/nat.py`'s `Internet`; the stage-0 driver sits behind a symmetric NAT of its own (`driver_nat`, None:
public), so it can never dial a NATed peer and no trip to one arrives over a connection that peer opened; each
stage-1 peer sits behind its own router, in one of three ways (`HOME_MODES`):

- `relay`: MASQUERADE, no port forward, `--relay auto` (the default): the swarm should report "via relay", and
  every trip to it goes through the stage-2 peer's trip relay (peer/relay.py; its counters: `relay_counters`).
- `forward`: the router forwards TCP `B_PORT` (DNAT) and the peer announces the router's address: "direct".
- `off`: MASQUERADE, no port forward, `--relay off`: "unreachable".

This machine's own namespace joins the emulated bridge (10.89.0.254) to read the tracker's JSON.
`tests/test_nat.py` runs it; `python -m benchmarks.nat_swarm` (root) measures tokens/s per mode for RESULTS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from benchmarks.nat import B_PORT, Internet, sh
from launcher.supervisor import stop_process_groups
from swarm.manifest import Manifest, save_manifest
from swarm.presets import preset

HOME_MODES = ("relay", "forward", "off")
RELAY_LINE = re.compile(r"relay: carried (\d+) trips for \d+ registered peer\(s\), (\d+) B forward, (\d+) B back")
TRACKER_PORT = 8800
REPO = Path(__file__).resolve().parent.parent


class NatSwarm:
    """Tracker, stage 0 and stage 2 public; stage-1 peers behind routers (`add_home_peer`). `close()` stops
    every process and deletes every namespace (and with them every iptables rule and veth)."""

    def __init__(self, manifest: Manifest, workdir: Path, driver_nat: str | None = "symmetric"):
        self.manifest, self.workdir, self.driver_nat = manifest, workdir, driver_nat
        self.processes: dict[str, subprocess.Popen] = {}
        self.net = Internet()
        self.lan = 10
        try:
            self._attach_this_host()
            self.tracker_address = self.net.public_host("t")
            self.tracker_url = f"http://{self.tracker_address}:{TRACKER_PORT}"
        except Exception:
            self.net.close()
            raise

    def _attach_this_host(self) -> None:
        outside, inside = f"{self.net.tag}hb", f"{self.net.tag}he"
        sh("ip", "link", "add", inside, "type", "veth", "peer", "name", outside, "netns", self.net.name("net"))
        sh("ip", "-n", self.net.name("net"), "link", "set", outside, "master", "br0")
        sh("ip", "-n", self.net.name("net"), "link", "set", outside, "up")
        sh("ip", "addr", "add", "10.89.0.254/24", "dev", inside)
        sh("ip", "link", "set", inside, "up")

    def _spawn(self, name: str, namespace: str, argv: list[str]) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
        with open(self.workdir / f"{name}.log", "wb") as log:  # the child holds its own copy
            self.processes[name] = subprocess.Popen(
                ["ip", "netns", "exec", namespace, *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )

    def start(self, timeout: float = 120.0) -> None:
        """The tracker, then the public peers of stages 0 and 2; returns when the tracker answers."""
        save_manifest(self.manifest, self.workdir / "manifest.json")
        self._spawn(
            "tracker",
            self.net.name("t"),
            [
                sys.executable,
                "-m",
                "tracker",
                "--manifest",
                str(self.workdir / "manifest.json"),
                "--host",
                self.tracker_address,
                "--port",
                str(TRACKER_PORT),
                "--db",
                str(self.workdir / "t.sqlite"),
                "--host-maddrs",
                f"/ip4/{self.tracker_address}/tcp/31337",
                "--poll-interval",
                "2",
                "--relay-service",  # the stage-2 peer is the relay measured here (tests/test_tracker_relay.py: the
                "off",  # tracker's own); with both on, a NATed peer may pick either, and only one is counted
            ],
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                httpx.get(f"{self.tracker_url}/api/v1/bootstrap", timeout=5).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise TimeoutError("the tracker did not answer") from None
                time.sleep(1)
        for stage in (0, 2):
            if stage == 0 and self.driver_nat is not None:
                self.net.home("s0", 9, self.driver_nat)
            else:
                self.net.public_host(f"s{stage}")
            self._spawn(f"stage{stage}", self.net.name(f"s{stage}"), self._peer_argv(f"stage{stage}", stage))

    def _peer_argv(self, name: str, stage: int, *extra: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "peer.cli",
            "--tracker",
            self.tracker_url,
            "--stage",
            str(stage),
            "--device",
            "cpu",
            "--public-name",
            name,
            "--max-inflight",
            "2",
            "--log-interval",
            "2",
            *extra,
        ]

    def add_home_peer(self, name: str, mode: str) -> None:
        """A stage-1 peer behind a fresh router of its own (`mode` in `HOME_MODES`)."""
        self.lan += 1
        short = f"h{self.lan}"
        if mode == "forward":
            _, public = self.net.home(short, self.lan, "cone", forward_port=B_PORT)
            extra = ["--host-maddrs", f"/ip4/0.0.0.0/tcp/{B_PORT}", "--announce-maddrs", f"/ip4/{public}/tcp/{B_PORT}"]
        else:
            self.net.home(short, self.lan, "cone")
            extra = ["--relay", "off"] if mode == "off" else []
        self._spawn(name, self.net.name(short), self._peer_argv(name, 1, *extra))

    def stop_peer(self, name: str, timeout: float = 120.0) -> None:
        """Stop it and wait until the tracker no longer lists it (its record expired)."""
        stop_process_groups([self.processes.pop(name)], grace=20.0)
        deadline = time.monotonic() + timeout
        while self.peer(name) is not None:
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}'s record still listed after {timeout:.0f}s")
            time.sleep(2)

    def wait_peer(self, name: str, ready: Callable[[dict], object], timeout: float, what: str) -> dict:
        """`name`'s row on the tracker once `ready(row)` holds; AssertionError after `timeout` seconds."""
        deadline, row = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            row = self.peer(name)
            if row is not None and ready(row):
                return row
            time.sleep(2)
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last row of {name}: {row!r}")

    def swarm(self) -> dict:
        return httpx.get(f"{self.tracker_url}/api/v1/swarm", params={"history": 0}, timeout=10).json()

    def peer(self, name: str) -> dict | None:
        try:
            rows = self.swarm()["stages"]
        except (httpx.HTTPError, ValueError, KeyError):
            return None
        return next((p for row in rows for p in row["peers"] if p["public_name"] == name), None)

    async def connection(self, name: str, peer_id: str) -> list[str]:
        """The addresses of `name`'s libp2p connection to `peer_id`, from its p2pd (found by process tree):
        a `/p2p-circuit` address is a relayed connection, anything else a direct one."""
        from hivemind.p2p import P2P
        from hivemind.utils.multiaddr import Multiaddr

        table = [line.split(None, 2) for line in sh("ps", "-eo", "pid=,ppid=,args=").splitlines()]
        family, listen = {self.processes[name].pid}, None
        for _ in range(4):  # peer -> DHT process -> p2pd
            family |= {int(pid) for pid, ppid, _ in table if int(ppid) in family}
        for pid, _, args in table:
            if int(pid) in family and "p2pd" in args:
                listen = next(a.split("=", 1)[1] for a in args.split() if a.startswith("-listen="))
        if listen is None:
            return []
        p2p = await P2P.replicate(Multiaddr(listen))
        found = [str(a) for info in await p2p.list_peers() if info.peer_id.to_base58() == peer_id for a in info.addrs]
        await p2p.shutdown()
        return found

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def relay_counters(self, name: str) -> dict[str, int]:
        """What `name`'s trip relay carried so far, from its last `RelayService.summary` line (zeros if none)."""
        found = RELAY_LINE.findall(self.log(name))
        trips, forward, back = map(int, found[-1]) if found else (0, 0, 0)
        return {"trips": trips, "forward": forward, "back": back}

    def close(self) -> None:
        stop_process_groups(list(self.processes.values()), grace=20.0)
        self.processes.clear()
        self.net.close()


def tokens_per_second(swarm: NatSwarm, seconds: float) -> float:
    """The driver's tokens over `seconds`, from its records as the tracker reads them."""
    first = swarm.peer("stage0")["tokens"], time.monotonic()
    time.sleep(seconds)
    last = swarm.peer("stage0")["tokens"], time.monotonic()
    return (last[0] - first[0]) / (last[1] - first[1])


def measure(modes: list[str], window: float, driver_nat: str | None) -> list[dict]:
    """Per mode: a fresh stage-1 peer behind its router, its reachability, then tokens/s over `window` and what
    the stage-2 peer's trip relay carried meanwhile."""
    workdir = Path(tempfile.mkdtemp(prefix="nat-swarm-"))
    swarm = NatSwarm(preset("tiny", stages=3), workdir, driver_nat)
    rows = []
    try:
        swarm.start()
        for public in ("stage0", "stage2"):
            swarm.wait_peer(public, lambda p: p["state"] == "online", 300, f"{public} online")
        for mode in modes:
            name = f"home-{mode}"
            swarm.add_home_peer(name, mode)
            found = swarm.wait_peer(name, lambda p: p["reachability"], 300, f"{name}'s reachability")
            row = {"mode": mode, "reachability": found["reachability"], "trained": True}
            try:
                swarm.wait_peer(name, lambda p: p["tokens"] > 2000, 240, f"training through {name}")
                before = swarm.relay_counters("stage2")
                row["tokens_per_s"] = round(tokens_per_second(swarm, window), 1)
                time.sleep(12)  # the relay logs its counters every 10 s
                after = swarm.relay_counters("stage2")
                row["relayed_trips"] = after["trips"] - before["trips"]  # in the window, plus up to 12 s
                row["relayed_bytes"] = after["forward"] + after["back"] - before["forward"] - before["back"]
                try:
                    row["driver_connection"] = asyncio.run(swarm.connection("stage0", found["peer_id"]))
                except Exception as exc:  # noqa: BLE001 - the tokens/s still count; say why this is missing
                    row["driver_connection"] = f"{type(exc).__name__}: {exc}"[:200]
            except AssertionError:
                row["trained"] = False
            print(json.dumps(row), flush=True)
            rows.append(row)
            swarm.stop_peer(name)  # until its record expired: the next peer is stage 1's only one
    finally:
        swarm.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", choices=HOME_MODES, default=["forward", "relay"])
    parser.add_argument("--window", type=float, default=90.0, help="seconds of training measured per mode")
    parser.add_argument("--driver-nat", choices=["symmetric", "cone", "public"], default="symmetric")
    args = parser.parse_args()
    measure(args.modes, args.window, None if args.driver_nat == "public" else args.driver_nat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
