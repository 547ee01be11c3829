"""A host's link with delay: starts `benchmarks.netsim.forwarder` in the host's namespace, moves its
bridge-side TAP device into the bridge's namespace, and changes its settings while it runs.

`Topology` uses one `DelayLink` per host instead of a veth pair when it is given a delay (0 included),
so that the same rate shaping (`tc tbf` on both devices) and the same counters work either way.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class LinkDelay:
    """One-way delay of a host's link in each direction, ± uniform jitter, and the chance a frame is lost.
    Between hosts A and B a frame crosses A's link and B's: ping RTT = 2 × (delay_A + delay_B)."""

    up_ms: float = 0.0
    down_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0

    @classmethod
    def symmetric(cls, delay_ms: float, jitter_ms: float = 0.0, loss: float = 0.0) -> LinkDelay:
        return cls(delay_ms, delay_ms, jitter_ms, loss)

    def line(self) -> str:
        return f"{self.up_ms} {self.down_ms} {self.jitter_ms} {self.loss}\n"


class DelayLink:
    """The forwarder process of one host; `inner` ends up as the host's eth0, `outer` in the bridge namespace."""

    def __init__(self, host_ns: str, bridge_ns: str, outer: str, delay: LinkDelay, timeout: float = 10.0):
        self.host_ns, self.bridge_ns, self.outer, self.delay = host_ns, bridge_ns, outer, delay
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self.process = subprocess.Popen(
            ["ip", "netns", "exec", host_ns, sys.executable, "-m", "benchmarks.netsim.forwarder", "--inner", "eth0",
             "--outer", outer],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            cwd=str(REPO), start_new_session=True)
        try:
            ready = self.process.stdout.readline().strip()  # the forwarder prints it once both devices exist
            if ready != "ready":
                self.process.wait(timeout)
                raise RuntimeError(f"the forwarder of {host_ns} did not start: {self.process.stderr.read()[-2000:]}")
            self.set(delay)
            # the descriptor stays attached when the device changes namespace
            subprocess.run(["ip", "-n", host_ns, "link", "set", outer, "netns", bridge_ns], check=True,
                           capture_output=True)
        except BaseException:
            self.close()
            raise

    def set(self, delay: LinkDelay) -> None:
        self.process.stdin.write(delay.line())
        self.process.stdin.flush()
        self.delay = delay

    def cpu_seconds(self) -> float:
        """User + system CPU the forwarder has used so far (`ip netns exec` execs it: same pid)."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        """EOF on its stdin ends it; kill it if it does not go. Its devices go with it."""
        if self.process.poll() is None:
            try:
                self.process.stdin.close()
                self.process.wait(5.0)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            stream.close()


def add_delay_arguments(parser) -> None:
    """`--delay-ms`, `--jitter-ms`, `--loss` for a benchmark that builds a `Topology`."""
    parser.add_argument("--delay-ms", type=float,
                        help="one-way delay of every host's link, each direction (RTT between two hosts: 4×); "
                             "without it the links are veths with no delay and no forwarder")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="with --delay-ms: uniform ± jitter per frame")
    parser.add_argument("--loss", type=float, default=0.0, help="with --delay-ms: chance a frame is lost, each way")


def link_delay(args) -> LinkDelay | None:
    """The `LinkDelay` the arguments of `add_delay_arguments` ask for (None: no forwarders)."""
    if args.delay_ms is None:
        return None
    return LinkDelay.symmetric(args.delay_ms, args.jitter_ms, args.loss)
