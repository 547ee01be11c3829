"""Container health checks for the protocol-peer and protocol-tracker images (stdlib only).

    python healthcheck.py peer     the peer's P2P port (first /tcp/N of PROTOCOL_PEER_HOST_MADDRS)
                                   accepts a TCP connection on the loopback
    python healthcheck.py tracker  GET http://127.0.0.1:$PROTOCOL_TRACKER_PORT/healthz answers 200

The peer has no HTTP endpoint, so its check is what can be verified cheaply from outside the
process: the libp2p daemon the peer started is still listening. It does not prove the peer's event
loop is making progress. Exit 0 when healthy, 1 otherwise, with one line saying why.
"""

from __future__ import annotations

import os
import re
import socket
import sys
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


def check_peer() -> str:
    host, port = p2p_target(os.environ.get("PROTOCOL_PEER_HOST_MADDRS", ""))
    with socket.create_connection((host, port), timeout=TIMEOUT):
        pass
    return f"P2P port {port} is listening"


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
    except (OSError, ValueError, urllib.error.URLError) as exc:
        print(f"unhealthy: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
