"""Which lane each sender of a stage's gradient round is judged in (`swarm/robust.py` `robust_average`'s camps).

With context parallelism a stage's lanes see other chunks of every sequence, so their gradients differ and a sender
is judged only among its own lane's senders. Two sources name a sender's lane, and neither is a fact:

- the round's gathered data (`gathered_lanes`): the sender's word as the group's leader passes it on, unchecked by
  hivemind, so a hostile sender names what it likes and a hostile leader may relabel anyone;
- the sender's signed stage record (`LaneCheck.records`, pushed into the averager's process by its `StageService`
  every refresh): signed by the sender's own key, read with the records routing reads, so nobody relabels it, but
  up to a refresh and an announcement late after an honest lane switch.

`LaneCheck.camps` takes the record's lane where one is known. A sender whose gathered lane differs from its record
is not judged for `grace` seconds (an honest switch lands in its record within that: judged in its old lane, the
other lane's gradient would look far out and accuse it), then in its record's lane; the grace comes back only after
`grace` seconds of agreement, so a sender that flips its gathered lane to dodge judging is judged at least half of
the time. A sender with no record (just joined, or one that never announces) is judged in the lane it gathered, or
in lane 0 if that is no lane of the run: every sender is in some lane's camp, none picks a camp of its own.
"""

from __future__ import annotations

from hivemind.p2p import PeerID
from hivemind.utils.serializer import MSGPackSerializer

from peer.routing import REFRESH_INTERVAL
from swarm.records import ANNOUNCE_INTERVAL

# how long a sender whose gathered lane differs from its record goes unjudged: its switch announced and read twice
LANE_GRACE = 2 * (ANNOUNCE_INTERVAL + REFRESH_INTERVAL)


def gathered_lanes(peer_ids: list[PeerID], gathered: list[bytes]) -> dict[PeerID, int]:
    """The lane each peer of a group named in its gathered data (hivemind's `[bandwidth, mode, user data]`, the user
    data an int: `StageOptimizer` gathers its lane in gradient rounds). A peer whose data names no int is left out:
    malformed bytes are a peer's word like a lane is, and cost nothing else here."""
    lanes = {}
    for peer, data in zip(peer_ids, gathered, strict=False):
        try:
            lane = MSGPackSerializer.loads(MSGPackSerializer.loads(data)[2])
        except Exception:  # noqa: BLE001 - anything a peer sent
            continue
        if isinstance(lane, int) and not isinstance(lane, bool):
            lanes[peer] = lane
    return lanes


class LaneCheck:
    """The camps of a run of `lanes` lanes (module docstring); lives in the averager's process."""

    def __init__(self, lanes: int, grace: float = LANE_GRACE):
        self.lanes, self.grace = lanes, grace
        self.records: dict[str, int] = {}  # peer id (base58) -> the lane its signed record names
        self._apart_since: dict[str, float] = {}  # sender -> when its gathered lane first differed from its record
        self._agreed_since: dict[str, float] = {}  # ...and, for those, since when they agree again

    def camps(self, gathered: dict[PeerID, int], peer_ids: list[PeerID], now: float) -> dict[PeerID, int]:
        """The lane each of `peer_ids` is judged in this round; a peer left out is not judged (clipped only)."""
        camps = {}
        for peer in peer_ids:
            lane = self._camp(peer.to_base58(), gathered.get(peer), now)
            if lane is not None:
                camps[peer] = lane
        return camps

    def _camp(self, peer: str, gathered: int | None, now: float) -> int | None:
        named = gathered if gathered is not None and 0 <= gathered < self.lanes else None
        record = self.records.get(peer)
        if record is None:
            return 0 if named is None else named
        if named == record:
            if peer in self._apart_since and now - self._agreed_since.setdefault(peer, now) >= self.grace:
                del self._apart_since[peer], self._agreed_since[peer]
            return record
        self._agreed_since.pop(peer, None)
        return None if now - self._apart_since.setdefault(peer, now) < self.grace else record
