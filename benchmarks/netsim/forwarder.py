"""One host's access link with delay: two TAP devices and a loop that carries frames between them.

    ip netns exec HOST python -m benchmarks.netsim.forwarder --inner eth0 --outer psn1234b1 --delay-ms 10

This kernel has no `netem`, so delay cannot be a qdisc. Instead the host's interface is a TAP device
(`--inner`, stays in the host's namespace) and its bridge port is another (`--outer`, which the caller
moves into the bridge's namespace once this prints `ready`; the open descriptor follows the device).
Every frame read from one is written to the other after the link's one-way delay, optionally with
jitter (never reordering: a frame leaves no earlier than the one before it) and random loss. Rate
limits stay with `tc tbf` on the TAP devices themselves (the kernel queues before the frame reaches
this loop), so the order is the real link's: serialise at the rate, then propagate.

The process runs inside the host's namespace, so the topology's cleanup (`ip netns pids`) finds it;
its devices vanish when it exits. Its stdin takes new settings, one line each,
`UP_MS DOWN_MS JITTER_MS LOSS`, and it exits on EOF, so it never outlives its harness. It imports
only the standard library: it starts in milliseconds and costs no more memory than it must.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import fcntl
import os
import random
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
MAX_FRAME = 65536
PR_SET_TIMERSLACK = 29


def tighten_timers() -> None:
    """Ask the kernel to wake this process on time: the default 50 µs timer slack, paid on each of the
    four links a round trip crosses, shows up in a measured RTT."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the slack stays


class Sleeper:
    """How long to block in `select` before the next frame is due, learning how late this process wakes.

    A timed sleep wakes late (~0.1–0.2 ms here, more under load), and a round trip pays it on each of the
    four links it crosses. Each sleep ends early by the lateness seen so far (a running mean over sleeps that
    ran out), so a frame leaves on time without polling away a core; it never leaves early (`send_due`)."""

    def __init__(self, late: float = 0.0002, weight: float = 0.1):
        self.late, self.weight = late, weight

    def timeout(self, wait: float | None) -> float | None:
        """The select timeout when the next frame is due in `wait` seconds (None: none queued)."""
        return None if wait is None else max(wait - self.late, 0.0)

    def woke(self, timeout: float, slept: float) -> None:
        """A sleep of `timeout` ran out after `slept` seconds."""
        if timeout > 0.0:
            self.late += self.weight * (max(slept - timeout, 0.0) - self.late)


def open_tap(name: str) -> int:
    """A non-blocking descriptor for a new TAP device `name` in this process's namespace."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


class Direction:
    """Frames read from `src`, each due at `src`'s read time + delay (+ jitter), written to `dst` in order."""

    def __init__(self, src: int, dst: int, rng: random.Random):
        self.src, self.dst, self.rng = src, dst, rng
        self.delay = self.jitter = self.loss = 0.0
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.frames = self.dropped = 0

    def receive(self, now: float) -> None:
        """Drain everything the kernel has for us now (a read per frame)."""
        while True:
            try:
                frame = os.read(self.src, MAX_FRAME)
            except BlockingIOError:
                return
            if self.loss and self.rng.random() < self.loss:
                self.dropped += 1
                continue
            due = now + self.delay + (self.rng.uniform(-self.jitter, self.jitter) if self.jitter else 0.0)
            if self.queue:
                due = max(due, self.queue[-1][0])  # jitter never reorders
            self.queue.append((due, frame))

    def send_due(self, now: float) -> float | None:
        """Write every frame whose time has come; the time the next one is due, if any."""
        while self.queue and self.queue[0][0] <= now:
            _, frame = self.queue.popleft()
            try:
                os.write(self.dst, frame)
                self.frames += 1
            except (BlockingIOError, OSError):
                self.dropped += 1  # device down or its queue full: the link loses the frame
        return self.queue[0][0] if self.queue else None


def configure(up: Direction, down: Direction, line: str) -> None:
    up_ms, down_ms, jitter_ms, loss = (float(x) for x in line.split())
    up.delay, down.delay = max(up_ms, 0.0) / 1e3, max(down_ms, 0.0) / 1e3
    up.jitter = down.jitter = max(jitter_ms, 0.0) / 1e3
    up.loss = down.loss = min(max(loss, 0.0), 1.0)


def run(inner: str, outer: str, settings: str, seed: int) -> None:
    tighten_timers()
    rng = random.Random(seed)
    fd_in, fd_out = open_tap(inner), open_tap(outer)
    up, down = Direction(fd_in, fd_out, rng), Direction(fd_out, fd_in, rng)
    configure(up, down, settings)
    control = sys.stdin.fileno()
    print("ready", flush=True)
    by_fd = {fd_in: up, fd_out: down}
    watched = [fd_in, fd_out, control]
    pending = b""
    sleeper = Sleeper()
    while True:
        now = time.monotonic()
        dues = [d for d in (up.send_due(now), down.send_due(now)) if d is not None]
        now = time.monotonic()
        timeout = sleeper.timeout(min(dues) - now if dues else None)
        # select, not epoll: epoll rounds its timeout up to the next millisecond, select keeps microseconds
        ready = select.select(watched, [], [], timeout)[0]
        if not ready and timeout is not None:
            sleeper.woke(timeout, time.monotonic() - now)
        for fd in ready:
            if fd == control:
                chunk = os.read(control, 4096)
                if not chunk:
                    return  # the harness is gone
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        configure(up, down, line.decode())
            else:
                by_fd[fd].receive(time.monotonic())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inner", required=True, help="the host's TAP device (its interface)")
    parser.add_argument("--outer", required=True, help="the bridge-side TAP device")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay, each direction")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="uniform ± jitter on each frame's delay")
    parser.add_argument("--loss", type=float, default=0.0, help="probability a frame is dropped, each direction")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        run(args.inner, args.outer, f"{args.delay_ms} {args.delay_ms} {args.jitter_ms} {args.loss}", args.seed)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
