"""Which addresses a restarted tracker may dial to rejoin its run: the plausible libp2p multiaddrs that online peers
published. Pure: records in, strings out (`tracker.service` remembers them in its history and dials them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from swarm.records import PeerEntry
from tracker.summary import PeerView


def dialable_addrs(
    stages: Mapping[int, Sequence[PeerEntry | PeerView]],
    exclude_peer_id: str = "",
    per_peer: int = 2,
    max_peers: int = 64,
) -> list[str]:
    """Multiaddrs that online peers published, filtered to plausible libp2p addresses.

    They are untrusted; the tracker only dials a few of them itself (to rejoin after a restart)
    and never hands them out as bootstrap addresses. A multiaddr with `/p2p/<id>` is
    authenticated by libp2p, so a lie costs one failed dial.
    """
    out: list[str] = []
    for peers in stages.values():
        for entry in peers:
            if len(out) >= per_peer * max_peers:
                return out
            if entry.record.state != "online":
                continue
            good = [a for a in entry.record.addrs if _plausible_maddr(a) and not a.endswith("/p2p/" + exclude_peer_id)]
            out.extend(good[:per_peer])
    return out


def _plausible_maddr(addr: str) -> bool:
    return (
        addr.startswith(("/ip4/", "/ip6/", "/dns4/", "/dns6/", "/dns/"))
        and "/p2p/" in addr
        and len(addr) <= 256
        and addr.isascii()
        and not any(c.isspace() for c in addr)
    )
