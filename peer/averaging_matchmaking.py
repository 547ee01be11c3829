"""Matchmaking for a stage's robust averagers: without the banned peers, and reading the DHT at a pace.

hivemind 1.1.12's `Matchmaking` knows no bans and, while a peer looks for a group that nobody else has declared,
reads the group key from the DHT in a tight loop. `peer/robust_averaging.py` `RobustAveraging` adopts the
averager's matchmaking into `ExcludingMatchmaking` and paces its key manager's reads with `pace_lookups`.
"""

from __future__ import annotations

import asyncio
import time

from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2

from swarm.evidence import AveragingBans


class ExcludingMatchmaking(Matchmaking):
    """hivemind's matchmaking without the peers in `banned` (module docstring), adopted after the averager built
    it (`RobustAveraging._matchmaking`)."""

    banned: AveragingBans

    def _check_reasons_to_reject(self, request: averaging_pb2.JoinRequest, context: P2PContext):
        if context.remote_id in self.banned:
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        return super()._check_reasons_to_reject(request, context)

    async def _request_join_group(self, leader: PeerID):
        if leader in self.banned:  # also a leader another one redirects us to
            return None
        return await super()._request_join_group(leader)


def pace_lookups(keys: GroupKeyManager, interval: float) -> None:
    """Let `keys` read the group's averagers from the DHT at most once per `interval` seconds.

    While this peer looks for a group and no one else is declared, hivemind's matchmaking reads the group key
    again as soon as the last read returned (`PotentialLeaders.pop_next_leader` finds the queue empty and
    triggers `_update_queue_periodically` at once): a loop of DHT reads for as long as the search lasts, on a
    machine whose cores the stages' trips need. A read asked for sooner waits out the interval; the cost is
    that a peer declared meanwhile is seen up to `interval` later."""
    read = keys.get_averagers
    last = -float("inf")

    async def paced(group_key, only_active):
        nonlocal last
        wait = last + interval - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        last = time.monotonic()
        keys.reads = getattr(keys, "reads", 0) + 1
        return await read(group_key, only_active)

    keys.get_averagers = paced
