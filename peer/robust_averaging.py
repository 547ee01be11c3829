"""hivemind's all-reduce with `swarm/robust.py`'s two rules, for a stage's gradient and state averagers.

hivemind 1.1.12 runs a group's all-reduce in `AllReduceRunner`, which the averager builds in
`_run_allreduce_inplace_`. Here:

- `RobustAllReduceRunner` swaps in `peer/robust_parts.py`'s `RobustPartReducer` (each sender's parts robustly
  averaged and judged, then its direction over the round) and `CheckedPartContainer` (each reducer's returned
  parts checked against this peer's own reduction, then its alignment over the round), and weighs every judged
  part with `swarm/evidence.py` (`Evidence`: one part past its bound accuses nobody unless flagrant, findings on a
  share of a peer's parts over its recent rounds do; the reducers' alignments and the senders' directions each by
  their own `Evidence(ALIGNMENT)`);
- `RobustAveraging`, mixed into an averager, runs that runner and bans the accused peers (`AveragingBans`): their
  contributions and reduced parts are ignored until the ban ends;
- `peer/averaging_matchmaking.py` `ExcludingMatchmaking` keeps them out of later groups: as a leader this peer
  refuses their requests to join, as a follower it does not ask them to lead. Inside a group a banned reducer's
  share of the parts would stay each peer's own values (unaveraged, every round); out of it, the honest peers
  split that share among themselves (measured in benchmarks/robust_stage.py: a banned reducer of four cost up
  to ×1.09 in loss before).

The averager runs in its own process (hivemind's), so the bans, the part changes and the evidence live there;
every accusation is one log line with the peer and the reason. A group led by an honest peer that has not
banned a peer (yet) may still hold it; the runner then ignores it for whoever banned it. A ban ends, doubling
with each accusation of the same peer (`AveragingBans`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p import PeerID
from hivemind.utils.asyncio import as_aiter, azip, enter_asynchronously
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.timed_storage import get_dht_time

from peer.averaging_lanes import LANE_GRACE, LaneCheck, gathered_lanes
from peer.averaging_matchmaking import ExcludingMatchmaking, pace_lookups
from peer.group_members import checked_members
from peer.robust_parts import CheckedPartContainer, RobustPartReducer, located
from swarm.evidence import ALIGNMENT, AveragingBans, Evidence
from swarm.robust import Finding, PartChanges, RobustRule

logger = logging.getLogger(__name__)

Accuse = Callable[[PeerID, str], None]


class RobustAllReduceRunner(AllReduceRunner):
    """hivemind's all-reduce with the robust reducer and the checked container; `banned` peers change nothing."""

    def __init__(
        self,
        *args,
        rule: RobustRule,
        banned: set[PeerID],
        accuse: Accuse,
        changes: PartChanges,
        evidence: Evidence,
        alignment_evidence: Evidence,
        direction_evidence: Evidence,
        round_number: int,
        lanes: Mapping[PeerID, int] | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.rule, self._accuse, self._evidence, self._round = rule, accuse, evidence, round_number
        self._alignment_evidence, self._direction_evidence = alignment_evidence, direction_evidence
        ignored = {i for i, peer in enumerate(self.sender_peer_ids) if peer in banned}
        hivemind_reducer = self.tensor_part_reducer
        hivemind_reducer.finished.set()  # never used: quiet its "received 0%" warning when it is collected
        own_sender = self.sender_peer_ids.index(self.peer_id) if self.peer_id in self.sender_peer_ids else None
        self.tensor_part_reducer = RobustPartReducer(
            hivemind_reducer.part_shapes, hivemind_reducer.num_senders, rule, self._judge_sender, ignored,
            self._judge_direction, own_sender,
            None if lanes is None else {i: lanes[peer] for i, peer in enumerate(self.sender_peer_ids) if peer in lanes},
        )
        banned_reducers = {i for i, peer in enumerate(self.ordered_peer_ids) if peer in banned and peer != self.peer_id}
        CheckedPartContainer.adopt(
            self.tensor_part_container,
            self.ordered_peer_ids.index(self.peer_id),
            rule,
            self._judge_reducer,
            banned_reducers,
            changes,
            self._judge_alignment,
            lambda: self.tensor_part_reducer.weight_share,
            self._prefix,
        )

    async def _communicate_with_peer(self, peer_id: PeerID) -> None:
        """hivemind's exchange with one reducer, with the reason logged when it fails (hivemind logs it at debug
        only): this peer then keeps its own values for another reducer's parts, and hivemind's warning "received N%
        results" alone does not say whether a reducer failed or a reduced part was refused."""
        try:
            await super()._communicate_with_peer(peer_id)
        except Exception as exc:
            if peer_id == self.peer_id:
                logger.warning("%s all-reduce: reducing this peer's own parts failed: %r", self._prefix, exc)
            else:
                logger.warning("%s all-reduce: reducer %s failed, this peer keeps its own values for its parts: %r",
                               self._prefix, peer_id, exc)
            raise

    def _judge(self, peer_id: PeerID, role: str, finding: Finding | None, evidence: Evidence | None = None,
               values: int | None = None) -> bool:
        """Weigh one judged part of `peer_id`, of `values` values (`swarm/evidence.py`; the per-part `Evidence`
        unless another is given: then one round's judgement) in this averager's round (counted here: a leader's group
        id could repeat); True if it now stands accused. This peer does not judge itself."""
        if peer_id == self.peer_id:
            return False
        why = (evidence or self._evidence).judge(peer_id, self._round, finding, values)
        if why is not None:
            self._accuse(peer_id, f"as a {role}: {why}")
        return why is not None

    def _judge_sender(self, sender_index: int, finding: Finding | None, values: int) -> bool:
        if finding is not None:  # which slice, so that a log line says where an accused sender's part lay
            container, reducer = self.tensor_part_container, self.tensor_part_reducer
            finding = located(finding, container.part_key(container.own_index, reducer.current_part_index))
        return self._judge(self.sender_peer_ids[sender_index], "sender", finding, values=values)

    def _judge_direction(self, sender_index: int, finding: Finding | None) -> bool:
        return self._judge(self.sender_peer_ids[sender_index], "sender", finding, self._direction_evidence)

    def _judge_reducer(self, peer_index: int, finding: Finding | None, values: int | None) -> bool:
        return self._judge(self.ordered_peer_ids[peer_index], "reducer", finding, values=values)

    def _judge_alignment(self, peer_index: int, finding: Finding | None) -> bool:
        return self._judge(self.ordered_peer_ids[peer_index], "reducer", finding, self._alignment_evidence)


class RobustAveraging:
    """Mixin for a hivemind averager (before it in the bases): every all-reduce runs `runner_class`, and peers
    accused in any round are banned from this averager's later rounds and groups while their ban lasts
    (`AveragingBans`). Its matchmaking reads the DHT at most once per `LOOKUP_INTERVAL` (`pace_lookups`). Where its
    rounds gather each peer's lane (`judges_by_lane`: gradients of a run of lanes, `StageOptimizer`), a sender is judged
    among its lane's senders only (`peer/averaging_lanes.py`, fed the stage's records by `set_record_lanes`)."""

    runner_class: type[AllReduceRunner] = RobustAllReduceRunner
    robust_rule = RobustRule()
    lane_grace = LANE_GRACE  # seconds a sender out of order (gathered lane not its record's, or none) goes unjudged
    LOOKUP_INTERVAL = 0.2  # seconds between two DHT reads of a matchmaking (`pace_lookups`)

    def __init__(self, *args, judges_by_lane: bool = False, **kwargs):
        # `judges_by_lane`: rounds gather each peer's lane, and a sender is judged among its lane's; else all together
        self.lane_check = LaneCheck(self.lane_grace) if judges_by_lane else None
        self._records_sent: dict[str, tuple[int, float]] | None = None  # the last records sent to the averager
        self._own_lane: int | None = None  # the lane this peer gathered at its last step, as it sent it
        # accused peers, until when and why, and the honest change of each part this peer reduced; set before
        # hivemind forks the averager's process, which owns them
        self.banned_peers = AveragingBans()
        self.part_changes = PartChanges(self.robust_rule.reduced_memory)
        self.evidence = Evidence()
        self.alignment_evidence = Evidence(ALIGNMENT)
        self.direction_evidence = Evidence(ALIGNMENT)  # the senders' directions, one judgement per round
        self.rounds_run = 0
        super().__init__(*args, **kwargs)

    @property
    def _matchmaking(self):
        return self.__dict__.get("_matchmaking")

    @_matchmaking.setter
    def _matchmaking(self, matchmaking) -> None:
        # hivemind builds its Matchmaking in the averager's process, with no hook for its class or key manager
        if matchmaking is not None:
            pace_lookups(matchmaking.group_key_manager, self.LOOKUP_INTERVAL)
            matchmaking.__class__, matchmaking.banned = ExcludingMatchmaking, self.banned_peers
        self.__dict__["_matchmaking"] = matchmaking

    def get_banned_peers(self, timeout: float | None = None) -> dict[str, str]:
        """The peers this averager banned and why (asked of the averager's process, which holds the list); waits
        at most `timeout` seconds for that process's answer (TimeoutError after)."""
        future = MPFuture()
        self._outer_pipe.send(("_banned_peers_for", [], dict(future=future)))
        return future.result(timeout)

    async def _banned_peers_for(self, future: MPFuture) -> None:
        future.set_result({peer.to_base58(): why for peer, why in self.banned_peers.current().items()})

    def set_record_lanes(self, records: dict[str, tuple[int, float]]) -> None:
        """The lane each peer of the stage names in its signed record, and when that record expires (peer id in base58
        -> (lane, DHT time)), for the averager's process to judge senders by (`LaneCheck.merge`); ignored where rounds
        are not judged by lane. Sent only when they changed and while that process lives: the caller's thread blocks
        on a pipe nobody reads once it fills."""
        if records != self._records_sent and self.is_alive():
            self._outer_pipe.send(("_record_lanes_are", [records], {}))
            self._records_sent = records

    async def _record_lanes_are(self, records: dict[str, tuple[int, float]]) -> None:
        if self.lane_check is not None:
            self.lane_check.merge(records, get_dht_time())

    async def _step(self, *, step, **kwargs):
        if self.lane_check is not None:  # the lane this peer gathers, as it sent it: the leader may relabel its copy
            self._own_lane = gathered_lanes([self.peer_id], [step.data_for_gather]).get(self.peer_id)
        return await super()._step(step=step, **kwargs)

    def _camps(self, group_info) -> dict[PeerID, int] | None:
        """The lane each sender of this round is judged in (`LaneCheck.camps`); None: no lanes, all judged together."""
        if self.lane_check is None:
            return None
        self.lane_check.forget_expired(get_dht_time())  # those expired since the last hand-over
        gathered = gathered_lanes(list(group_info.peer_ids), list(group_info.gathered))
        return self.lane_check.camps(gathered, list(group_info.peer_ids), self.peer_id, self._own_lane,
                                     time.monotonic())

    def _accuse(self, peer_id: PeerID, why: str) -> None:
        if peer_id == self.peer_id:
            return
        seconds = self.banned_peers.ban(peer_id, why)
        if seconds is not None:
            logger.warning("%s banned peer %s from averaging for %.0f s: %s", self.prefix, peer_id, seconds, why)

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs) -> dict:
        """hivemind's, on the group's entries as `checked_members` reads them: a member whose entry no honest
        averager sends is left out of the round (no share, no tensors expected, no lane, not in the result) instead
        of failing it for all, and the split ignores claimed bandwidths (`peer/group_members.py`). Where this peer's
        own entry reached it garbled (the leader's doing), the round fails here and hivemind looks for another."""
        try:
            members = checked_members(group_info.gathered, self.serializer.loads)
            own = group_info.peer_ids.index(self.peer_id)
            if own in members.left_out:
                raise ValueError(f"this peer's own entry reached it as {members.left_out[own]}")
            for index, why in members.left_out.items():
                logger.warning("%s left member %s out of this round: %s", self.prefix, group_info.peer_ids[index], why)
            fractions = await asyncio.get_running_loop().run_in_executor(
                None, load_balance_peers, self.total_size, members.split_bandwidths, min_vector_size)
            # a member left out names no lane either (`_camps` reads the lanes from the entries)
            checked = replace(group_info, gathered=tuple(b"" if index in members.left_out else entry
                                                         for index, entry in enumerate(group_info.gathered)))
            async with enter_asynchronously(self.get_tensors()) as local_tensors:
                await self._run_allreduce_inplace_(local_tensors, checked, peer_fractions=fractions,
                                                   modes=members.runner_modes(fractions), **kwargs)
            return members.gathered(group_info.peer_ids)
        except BaseException as exc:
            if isinstance(exc, Exception):
                logger.exception(exc)
            raise MatchmakingException(f"Unable to run All-Reduce: {exc}") from exc

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        """hivemind's step, with `runner_class`: build the runner, hand it to the group, add what it yields."""
        group_id = group_info.group_id if group_id is None else group_id
        began = get_dht_time()
        self.rounds_run += 1
        runner = self.runner_class(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            rule=self.robust_rule,
            banned=set(self.banned_peers.current()),
            accuse=self._accuse,
            changes=self.part_changes,
            evidence=self.evidence,
            alignment_evidence=self.alignment_evidence,
            direction_evidence=self.direction_evidence,
            round_number=self.rounds_run,
            lanes=self._camps(group_info),
            **kwargs,
        )
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            async for _ in runner:
                raise ValueError("an auxiliary peer receives no averaged tensors")
            return
        async for tensor, update in azip(as_aiter(*tensors), runner):
            tensor.add_(update, alpha=self._averaging_alpha)
            self.last_updated = get_dht_time()
            self._state_updated.set()
        keys = self._matchmaking.group_key_manager
        logger.info("%s averaged in a group of %d in %.2f s (DHT reads so far %d)", self.prefix,
                    len(group_info.peer_ids), get_dht_time() - began, getattr(keys, "reads", 0))
