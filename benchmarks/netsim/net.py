"""An emulated home internet on one machine: hosts are network namespaces, each joined by a veth
pair to a bridge that lives in a namespace of its own, and each host's link is rate-shaped with
`tc tbf` in both directions (upload on the host's end, download on the bridge's end).

Only addresses inside our own namespaces are used (10.77.0.0/24 by default). Every object carries
a per-run prefix (`psn` + 4 hex digits) so `cleanup_leftovers()` can find what a crashed run left.
This kernel has no `netem`: given a `LinkDelay`, each host's link is instead a pair of TAP devices
joined by a forwarder process that holds every frame for the link's delay (`delay.py`); without one it
is a veth pair with no delay.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.netsim.delay import DelayLink, LinkDelay

PREFIX = "psn"  # every namespace and link we create starts with this
OWNERS = Path(tempfile.gettempdir()) / "netsim-owners"  # one file per live topology: its owner's pid


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _owner_alive(tag: str) -> bool:
    try:
        pid = int((OWNERS / tag).read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    return pid != os.getpid()


def cleanup_leftovers(prefix: str = PREFIX) -> list[str]:
    """Delete namespaces named `prefix`… whose owning harness is gone (a run killed with SIGKILL);
    their processes are killed and their veths go with them. Live runs of other harnesses are kept."""
    removed = []
    for name in namespaces():
        tag = name.split("-", 1)[0]
        if name.startswith(prefix) and not _owner_alive(tag):
            _kill_namespace_processes(name)
            _ip("netns", "del", name, check=False)
            removed.append(name)
            (OWNERS / tag).unlink(missing_ok=True)
    return removed


def _kill_namespace_processes(name: str) -> None:
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), 9)
        except (ProcessLookupError, ValueError, PermissionError):
            pass


@dataclass(frozen=True)
class Host:
    index: int
    netns: str
    address: str
    veth_bridge_side: str  # the link's end in the bridge namespace: its egress is this host's download


class Topology:
    """`hosts` namespaces on one bridge. Use as a context manager; `close()` is idempotent.

    With `delay` every host's link is a `DelayLink` (its delay can change later, `set_delay`)."""

    def __init__(self, hosts: int, subnet: str = "10.77.0", tag: str | None = None, delay: LinkDelay | None = None):
        if not 1 <= hosts <= 200:
            raise ValueError("hosts must be between 1 and 200")
        self.tag = f"{PREFIX}{tag or secrets.token_hex(2)}"
        self.bridge_ns = f"{self.tag}-br"
        self.hosts = [Host(i, f"{self.tag}-h{i}", f"{subnet}.{i + 1}", f"{self.tag}b{i}") for i in range(hosts)]
        self._created: list[str] = []
        self.delay = delay
        self.links: dict[int, DelayLink] = {}  # per host index, when delayed
        self.rate_mbit: float | None = None
        self.shaped: list[tuple[str, str]] = []  # (namespace, device) with a tbf qdisc
        self._sent: dict[tuple[str, str], int] = {}
        self._checked = 0.0
        self.unwedged = 0  # times a stalled shaped queue had to be restarted (see unwedge)

    def __enter__(self) -> Topology:
        self.create()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def create(self) -> None:
        OWNERS.mkdir(exist_ok=True)
        (OWNERS / self.tag).write_text(str(os.getpid()))
        try:
            self._add_ns(self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            _ip("-n", self.bridge_ns, "link", "set", "lo", "up")
            for host in self.hosts:
                self._add_ns(host.netns)
                if self.delay is None:
                    inner = f"{self.tag}a{host.index}"
                    _ip("link", "add", inner, "type", "veth", "peer", "name", host.veth_bridge_side)
                    _ip("link", "set", inner, "netns", host.netns)
                    _ip("link", "set", host.veth_bridge_side, "netns", self.bridge_ns)
                    _ip("-n", host.netns, "link", "set", inner, "name", "eth0")
                else:
                    self.links[host.index] = DelayLink(host.netns, self.bridge_ns, host.veth_bridge_side, self.delay)
                _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
                _ip("-n", host.netns, "link", "set", "eth0", "up")
                _ip("-n", host.netns, "link", "set", "lo", "up")
                _ip("-n", self.bridge_ns, "link", "set", host.veth_bridge_side, "master", "br0")
                _ip("-n", self.bridge_ns, "link", "set", host.veth_bridge_side, "up")
        except BaseException:
            self.close()
            raise

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.links.clear()
        for name in reversed(self._created):
            _kill_namespace_processes(name)
            _ip("netns", "del", name, check=False)
        self._created.clear()
        (OWNERS / self.tag).unlink(missing_ok=True)

    def exec_prefix(self, host: Host) -> list[str]:
        return ["ip", "netns", "exec", host.netns]

    def set_delay(self, delay: LinkDelay, hosts: list[Host] | None = None) -> None:
        """Change the delay of each host's link (of every host by default); the topology must have been
        created with a delay."""
        for host in hosts if hosts is not None else self.hosts:
            self.links[host.index].set(delay)

    def forwarder_cpu_seconds(self) -> dict[int, float]:
        """CPU seconds each host's forwarder has used so far (empty without delay)."""
        return {index: link.cpu_seconds() for index, link in self.links.items()}

    def shape(self, rate_mbit: float | None, hosts: list[Host] | None = None) -> None:
        """Rate-limit each host's upload and download to `rate_mbit` (None removes shaping)."""
        self.shaped = []
        for host in hosts if hosts is not None else self.hosts:
            for netns, dev in ((host.netns, "eth0"), (self.bridge_ns, host.veth_bridge_side)):
                if rate_mbit is not None:
                    self.shaped.append((netns, dev))
                if rate_mbit is None:
                    subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", dev, "root"],
                                   capture_output=True)
                    continue
                bytes_per_s = rate_mbit * 1e6 / 8
                burst = max(16 * 1024, int(bytes_per_s * 0.005))  # 5 ms of line rate, at least a few packets
                subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                                "rate", f"{int(rate_mbit * 1000)}kbit", "burst", str(burst), "latency", "200ms"],
                               check=True, capture_output=True, text=True)
        self.rate_mbit = rate_mbit

    def unwedge(self, every: float = 5.0) -> int:
        """Restart shaped queues that hold packets but sent nothing since the last check.

        On this kernel a tbf queue on a veth sometimes stops dequeuing for good after its rate
        changes under load (backlog stays, sent bytes stop; seen once in ~20 changes). Setting the
        link down and up restarts the queue; IPv4 addresses and TCP connections survive it.
        Returns how many queues were restarted in this call.
        """
        now = time.monotonic()
        if now - self._checked < every:
            return 0
        self._checked = now
        restarted = 0
        for netns, dev in self.shaped:
            out = subprocess.run(["ip", "netns", "exec", netns, "tc", "-s", "-j", "qdisc", "show", "dev", dev],
                                 capture_output=True, text=True).stdout
            try:
                stats = json.loads(out)[0]
            except (ValueError, IndexError):
                continue
            sent, backlog = int(stats.get("bytes", 0)), int(stats.get("backlog", 0))
            if backlog > 0 and self._sent.get((netns, dev)) == sent:
                _ip("-n", netns, "link", "set", dev, "down", check=False)
                _ip("-n", netns, "link", "set", dev, "up", check=False)
                restarted += 1
            self._sent[(netns, dev)] = sent
        self.unwedged += restarted
        return restarted

    def counters(self) -> dict[int, tuple[int, int]]:
        """Per host (upload bytes, download bytes) so far, read on the bridge side of each veth."""
        out = _ip("-n", self.bridge_ns, "-j", "-s", "link", "show").stdout
        by_name = {link["ifname"]: link["stats64"] for link in json.loads(out)}
        result = {}
        for host in self.hosts:
            stats = by_name.get(host.veth_bridge_side)
            if stats:
                result[host.index] = (int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"]))
        return result
