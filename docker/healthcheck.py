"""Container health checks for the protocol-peer and protocol-tracker images (stdlib only).

    python healthcheck.py peer     the peer's heartbeat file (PROTOCOL_PEER_HEARTBEAT_FILE) was
                                   rewritten recently, and its P2P port (first /tcp/N of
                                   PROTOCOL_PEER_HOST_MADDRS) accepts a TCP connection on the loopback
    python healthcheck.py tracker  GET http://127.0.0.1:$PROTOCOL_TRACKER_PORT/healthz answers 200

The peer has no HTTP endpoint: its event loop rewrites the heartbeat file every few seconds (so a
fresh file proves the loop is making progress), and the libp2p daemon it started must still be
listening. Exit 0 when healthy, 1 otherwise, with one line saying why.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
import urllib.error
import urllib.request

TIMEOUT = 4.0


def p2p_target(maddrs: str) -> tuple[str, int]:
    """Loopback host and port of the first listen multiaddr with a pinned TCP port."""
    for maddr in maddrs.replace(",", " ").split():
        match = re.match(r"^/(ip4|ip6)/([^/]+)/tcp/(\d+)", maddr)
        if match and int(match.group(3)) != 0:
            return ("::1" if match.group(1) == "ip6" else "127.0.0.1"), int(match.group(3))
    raise ValueError(f"no pinned TCP port in PROTOCOL_PEER_HOST_MADDRS={maddrs!r}")


HEARTBEAT_MAX_AGE = 120.0


def check_heartbeat(path: str, now: float | None = None) -> str:
    with open(path) as handle:
        beat = json.load(handle)
    age = (time.time() if now is None else now) - float(beat["time"])
    if age > HEARTBEAT_MAX_AGE:
        raise ValueError(f"heartbeat {path} is {age:.0f}s old (state {beat.get('state')})")
    return f"heartbeat {age:.0f}s old, state {beat.get('state')}, stage {beat.get('stage')}"


def check_peer() -> str:
    heartbeat = os.environ.get("PROTOCOL_PEER_HEARTBEAT_FILE")
    beat = check_heartbeat(heartbeat) if heartbeat else "no heartbeat file configured"
    host, port = p2p_target(os.environ.get("PROTOCOL_PEER_HOST_MADDRS", ""))
    with socket.create_connection((host, port), timeout=TIMEOUT):
        pass
    return f"{beat}; P2P port {port} is listening"


def check_tracker() -> str:
    port = int(os.environ.get("PROTOCOL_TRACKER_PORT", "8000"))
    url = f"http://127.0.0.1:{port}/healthz"
    with urllib.request.urlopen(url, timeout=TIMEOUT) as response:  # noqa: S310 - fixed loopback URL
        return f"{url}: {response.status}"


def main(argv: list[str]) -> int:
    checks = {"peer": check_peer, "tracker": check_tracker}
    if len(argv) != 1 or argv[0] not in checks:
        print(f"usage: healthcheck.py {{{','.join(checks)}}}", file=sys.stderr)
        return 1  # Docker reserves exit code 2
    try:
        print(checks[argv[0]]())
    except (OSError, ValueError, KeyError, urllib.error.URLError) as exc:
        print(f"unhealthy: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
