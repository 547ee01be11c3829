"""Which lane each sender of a stage's gradient round is judged in (`swarm/robust.py` `robust_average`'s camps).

With context parallelism a stage's lanes see other chunks of every sequence, so their gradients differ and a sender
is judged only among its own lane's senders. Two sources name a sender's lane, and neither is a fact:

- the round's gathered data (`gathered_lanes`): the sender's word as the group's leader passes it on, unchecked by
  hivemind, so a hostile sender names what it likes and a hostile leader may relabel anyone, this peer included
  (which is why this peer's own lane is the one it sent itself, `RobustAveraging`);
- the sender's signed stage record (`LaneCheck.merge`, handed to the averager's process by its `StageService` at
  every refresh): signed by the sender's own key, so nobody relabels it, but late by up to a refresh and an
  announcement after an honest lane switch or join. A record stays known until it expires in the DHT, whether or
  not the last read found it (a read may miss a record until its peer announces again, `dhtio/records.py`).

`LaneCheck.camps` judges a sender *in order* (a record whose lane its gathered lane names) in that lane. A sender out
of order (the two differ, or it has no record) is not judged for `grace` seconds from the start of its episode out
of order (an honest switch or join lands in its record within that; judged in its old lane, its new lane's gradient
would look far out and accuse it), then in its record's lane, or with no record in the round's lane of most senders
in order (the lowest of those tied): a sender with no record known after the grace has not announced (or its record
expired), and gains nothing by naming a lane of its own. An episode ends only once the sender has not been seen out
of order for `episode_gap` seconds: a sender that flips out of order to dodge goes unjudged for at most `grace`
seconds in every `grace + episode_gap`, and a hostile leader that relabels an honest peer costs it one grace
unjudged (and its own lane switch within `episode_gap` after that, a round or two judged in its old lane).
"""

from __future__ import annotations

from collections import Counter

from hivemind.p2p import PeerID
from hivemind.utils.serializer import MSGPackSerializer

from peer.routing import REFRESH_INTERVAL
from swarm.records import ANNOUNCE_INTERVAL

# how long a sender out of order goes unjudged: its switch (or join) announced and read twice
LANE_GRACE = 2 * (ANNOUNCE_INTERVAL + REFRESH_INTERVAL)
EPISODE_GAP = 10 * LANE_GRACE  # in order this long, a sender's next episode out of order gets a new grace


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
    """The camps of a stage's gradient rounds (module docstring); lives in the averager's process."""

    def __init__(self, grace: float = LANE_GRACE, episode_gap: float = EPISODE_GAP):
        self.grace, self.episode_gap = grace, episode_gap
        self._records: dict[str, tuple[int, float]] = {}  # peer id (base58) -> its record's lane, and its expiry
        self._episodes: dict[str, tuple[float, float]] = {}  # sender -> (began, last seen) of its episode out of order

    def merge(self, records: dict[str, tuple[int, float]], clock: float) -> None:
        """The records of a read, each peer's lane and its record's expiry (DHT time): a later expiry replaces what
        is known of that peer; then `forget_expired(clock)`."""
        for peer, (lane, expiry) in records.items():
            if expiry > self._records.get(peer, (0, -float("inf")))[1]:
                self._records[peer] = (lane, expiry)
        self.forget_expired(clock)

    def forget_expired(self, clock: float) -> None:
        """Forget the records expired by `clock` (DHT time), and only those."""
        self._records = {peer: known for peer, known in self._records.items() if known[1] > clock}

    def camps(self, gathered: dict[PeerID, int], peer_ids: list[PeerID], own: PeerID, own_lane: int | None,
              now: float) -> dict[PeerID, int]:
        """The lane each of `peer_ids` is judged in this round, at `now` (monotonic seconds); a peer left out is not
        judged (clipped only). `own`, this peer, is in `own_lane`, the lane it sent itself (it has no record of its
        own, and the leader's copy of its gathered data may be relabelled)."""
        self._episodes = {peer: (began, seen) for peer, (began, seen) in self._episodes.items()
                          if now - seen <= self.episode_gap}
        names = {peer: peer.to_base58() for peer in peer_ids}
        recorded = {peer: self._records[names[peer]][0] for peer in peer_ids if names[peer] in self._records}
        in_order = {peer: recorded[peer] for peer in peer_ids
                    if peer != own and peer in recorded and gathered.get(peer) == recorded[peer]}
        if own in peer_ids and own_lane is not None:
            in_order[own] = own_lane
        voters = Counter(in_order.values())
        largest = min(voters, key=lambda lane: (-voters[lane], lane)) if voters else 0
        camps = dict(in_order)
        for peer in peer_ids:
            if peer in in_order or peer == own:
                continue
            began, _ = self._episodes.get(names[peer], (now, now))
            self._episodes[names[peer]] = (began, now)
            if now - began >= self.grace:
                camps[peer] = recorded.get(peer, largest)
        return camps
