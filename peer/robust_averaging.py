"""hivemind's all-reduce with `swarm/robust.py`'s two rules, for a stage's gradient and state averagers.

hivemind 1.1.12 reduces a part with a running weighted sum (`TensorPartReducer`) and applies whatever a
reducer returns (`TensorPartContainer.register_processed_part`), inside `AllReduceRunner`, which the
averager builds in `_run_allreduce_inplace_`. Here:

- `RobustPartReducer` collects the parts of the current part index (the running sum becomes a list, through
  the `add_` hivemind calls on its accumulator) and, once every sender is in, returns `robust_average` instead
  of the mean; each sender's part is judged, and an accused sender's later parts of the round are ignored; after
  the last part, the direction of each sender's parts of the round (`SenderDirection`, `direction_findings`);
- `CheckedPartContainer` holds the parts other reducers return until this peer's own reduction is done (that
  gives the honest relative change), then applies `check_reduced` to each, with the change this peer's own
  reductions made to that same part in earlier rounds (`PartChanges`) as a second reference: a refused part is
  replaced by zeros (this peer keeps its own values for that slice, as hivemind does for a reducer that fails),
  and an accused reducer's every later part of the round too; once a reducer's last part is in, how far its
  used averages pointed along this peer's parts (`Alignment`) is judged too, once for the round;
- `RobustAveraging`, mixed into an averager, weighs every judged part with `swarm/evidence.py` (`Evidence`: one
  part past its bound accuses nobody unless flagrant, findings on a share of a peer's parts over its recent rounds
  do; the reducers' alignments and the senders' directions each by their own `Evidence(ALIGNMENT)`) and bans the
  accused peers (`AveragingBans`): their contributions and reduced parts are ignored until the ban ends;
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

import logging
import math
from collections.abc import Callable, Sequence

import torch
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner, AveragingMode
from hivemind.averaging.partition import TensorPartContainer, TensorPartReducer
from hivemind.p2p import PeerID
from hivemind.utils.asyncio import as_aiter, azip
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.timed_storage import get_dht_time

from peer.averaging_matchmaking import ExcludingMatchmaking, pace_lookups
from swarm.evidence import ALIGNMENT, AveragingBans, Evidence
from swarm.robust import (
    Alignment,
    Finding,
    PartChanges,
    RobustRule,
    SenderDirection,
    check_reduced,
    direction_findings,
    robust_average,
)

logger = logging.getLogger(__name__)

Accuse = Callable[[PeerID, str], None]
Judge = Callable[[int, Finding | None], bool]  # one judged part of the peer at this index; True: it is accused


def located(finding: Finding | None, key: tuple) -> Finding | None:
    """`finding` naming the slice it is about, (tensor key, part index), so that a log line says where it lay."""
    return None if finding is None else Finding(f"{finding.why} (tensor {key[0]}, part {key[1]})", finding.excess)


class _PartCollector:
    """Stands in for hivemind's running-sum accumulator: `add_` keeps each part and its weight."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []
        self.weights: list[float] = []

    def add_(self, part: torch.Tensor, alpha: float = 1.0) -> None:
        self.parts.append(part)
        self.weights.append(alpha)


class RobustPartReducer(TensorPartReducer):
    """Reduces each part with `robust_average` once every sender's part is in (module docstring)."""

    def __init__(
        self,
        part_shapes: Sequence[torch.Size],
        num_senders: int,
        rule: RobustRule,
        judge: Judge,
        ignored: set[int],
        judge_direction: Judge,
        own_sender: int | None,
    ):
        self.rule, self.judge, self.ignored, self.judge_direction = rule, judge, ignored, judge_direction
        self.own_sender = own_sender
        self.weight_share = 1.0  # this peer's capped weight against an equal share, in the last part it reduced
        self._sender_of: dict[int, int] = {}  # id(part) -> sender index, for the part being collected
        self._collected_senders: list[int] = []
        self.directions: dict[int, SenderDirection] = {}  # sender index -> its parts of the round so far
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self):
        super().reset_accumulators()
        if not self.finished.is_set():
            self.accumulator = _PartCollector()
            self._collected_senders = []

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight=1.0):
        # hivemind's bookkeeping (ordering, failed senders) is kept; only what `add_` receives is ours
        self._sender_of[id(tensor_part)] = sender_index
        try:
            return await super().accumulate_part(sender_index, part_index, tensor_part, weight=weight)
        finally:
            self._sender_of.pop(id(tensor_part), None)

    def check_current_part_finished(self):
        collector = self.accumulator
        if isinstance(collector, _PartCollector) and len(self._collected_senders) < len(collector.parts):
            for part in collector.parts[len(self._collected_senders) :]:
                self._collected_senders.append(self._sender_of.get(id(part), -1))
        if self.current_part_accumulated_from < self.num_current_senders:
            return
        senders = self._collected_senders
        keep = [n for n, sender in enumerate(senders) if sender not in self.ignored]
        shape = self.part_shapes[self.current_part_index]
        aggregate = robust_average([collector.parts[n] for n in keep], [collector.weights[n] for n in keep], shape,
                                   self.rule)
        future = self.current_part_future
        if aggregate is None:
            future.set_exception(AllreduceException("no usable contribution to this part"))
        else:
            findings = {n: Finding(why, math.inf) for n, why in aggregate.refused.items()} | aggregate.judged
            for n, finding in findings.items():
                if self.judge(senders[keep[n]], finding):
                    self.ignored.add(senders[keep[n]])
            for n, direction in aggregate.directions.items():
                self.directions.setdefault(senders[keep[n]], SenderDirection()).merge(direction)
            own = [n for n in aggregate.weights if senders[keep[n]] == self.own_sender]
            if own and sum(aggregate.weights.values()) > 0:
                self.weight_share = len(aggregate.weights) * aggregate.weights[own[0]] / sum(aggregate.weights.values())
            future.set_result(aggregate.average)
        if self.current_part_index == self.num_parts - 1:  # the round's directions; an accused sender is left out
            directions = {n: d for n, d in self.directions.items() if n not in self.ignored}
            for sender, finding in direction_findings(directions, self.rule).items():
                self.judge_direction(sender, finding)
        self.reset_accumulators()


class CheckedPartContainer(TensorPartContainer):
    """Checks the parts other reducers return against this peer's own reduction (module docstring)."""

    def adopt(
        self,
        own_index: int,
        rule: RobustRule,
        judge: Judge,
        banned: set[int],
        changes: PartChanges,
        judge_alignment: Judge,
        weight_share: Callable[[], float] = lambda: 1.0,
    ):
        """Turn hivemind's container into this one after `AllReduceRunner.__init__` built it (it builds it inline,
        with no hook for another class). `judge_alignment` weighs each reducer's `Alignment` once its last part of
        the round is in."""
        self.__class__ = CheckedPartContainer
        self.own_index, self.rule, self.judge, self.changes = own_index, rule, judge, changes
        self.judge_alignment, self.weight_share = judge_alignment, weight_share
        self.alignments: dict[int, Alignment] = {}
        self.refused: set[int] = set()
        self._pending: list[tuple[int, int, torch.Tensor]] = []
        self._own_change_sq, self._own_norm_sq, self._own_done, self._own_size = 0.0, 0.0, 0, 0
        # None until this peer's own reduction is done; a peer that reduces nothing has no reference
        self.reduces_nothing = self.num_parts_by_peer[own_index] == 0
        self.honest_change: float | None = None
        for peer_index in banned:
            self.register_failed_reducer(peer_index)

    def _own_input(self, peer_index: int, part_index: int) -> torch.Tensor:
        return self._input_parts_by_peer[peer_index][part_index][0]

    def part_key(self, peer_index: int, part_index: int) -> tuple:
        """The same slice in every round: its tensor's key and its index in that tensor."""
        info = self._input_parts_by_peer[peer_index][part_index][1]
        return info.key, info.part_index

    def register_processed_part(self, peer_index: int, part_index: int, part: torch.Tensor):
        if peer_index in self.refused:
            return
        if part_index >= self.num_parts_by_peer[peer_index]:  # more parts than it reduces: no honest peer sends that
            why = f"a reduced part {part_index} from a reducer of {self.num_parts_by_peer[peer_index]}"
            if self.judge(peer_index, Finding(why, math.inf)):
                self.register_failed_reducer(peer_index)
            return
        if peer_index == self.own_index:
            change_sq = float(part.float().norm()) ** 2
            norm_sq = float(self._own_input(peer_index, part_index).float().norm()) ** 2
            if norm_sq > 0 and not self._shape_checks_only():  # a plain mean of two is no honest reference
                self.changes.record(self.part_key(peer_index, part_index), (change_sq / norm_sq) ** 0.5)
            self._own_change_sq += change_sq
            self._own_norm_sq += norm_sq
            self._own_size += part.numel()
            self._own_done += 1
            super().register_processed_part(peer_index, part_index, part)
            if self._own_done == self.num_parts_by_peer[self.own_index]:
                self.honest_change = (self._own_change_sq / max(self._own_norm_sq, 1e-30)) ** 0.5
                pending, self._pending = self._pending, []
                for args in pending:
                    self.register_processed_part(*args)
            return
        if self.honest_change is None and not self.reduces_nothing:
            self._pending.append((peer_index, part_index, part))
            return
        own = self._own_input(peer_index, part_index)
        finding = self._check(own, part, self.part_key(peer_index, part_index))
        if finding is None and self._shape_checks_only():  # nothing was judged: no evidence either way
            super().register_processed_part(peer_index, part_index, part)
        elif self.judge(peer_index, finding):
            self.register_failed_reducer(peer_index)
        elif finding is not None:  # refused: this peer keeps its own values for that slice
            logger.info("refused reduced part %d of reducer %d (not accused yet): %s", part_index, peer_index,
                        finding.why)
            super().register_processed_part(peer_index, part_index, torch.zeros_like(own))
            self.failed_size += own.numel()
        else:
            self._use(peer_index, part_index, own, part)

    def _use(self, peer_index: int, part_index: int, own: torch.Tensor, delta: torch.Tensor) -> None:
        """Apply a part that passed its check; after the reducer's last part, judge the round's `Alignment`."""
        alignment = self.alignments.setdefault(peer_index, Alignment())
        alignment.add(own, own + delta)
        super().register_processed_part(peer_index, part_index, delta)
        if self._outputs_registered_by_peer[peer_index] == self.num_parts_by_peer[peer_index] and alignment.judged:
            self.judge_alignment(peer_index, alignment.finding(self.rule, self.weight_share()))

    def _shape_checks_only(self) -> bool:
        """No honest change to compare with, or (a group of two) nothing that can judge the other: returned parts
        are checked for shape and finiteness only."""
        return self.reduces_nothing or len(self.num_parts_by_peer) <= 2

    def _check(self, own: torch.Tensor, delta: torch.Tensor, key: tuple) -> Finding | None:
        if self._shape_checks_only():
            if delta.shape != own.shape or not torch.isfinite(delta).all():
                return Finding("a reduced part of the wrong shape or with NaN or inf", math.inf)
            return None
        typical_rms = (self._own_norm_sq / max(self._own_size, 1)) ** 0.5
        return located(check_reduced(own, delta, self.honest_change, self.rule, self.changes.reference(key),
                                     typical_rms), key)

    def register_failed_reducer(self, peer_index: int):
        """This peer keeps its own values for every part of `peer_index` not yet applied (hivemind does the same
        for a reducer that failed); whatever else comes from it this round is ignored."""
        self._pending = [args for args in self._pending if args[0] != peer_index]
        for part_index in range(self._outputs_registered_by_peer[peer_index], self.num_parts_by_peer[peer_index]):
            zeros = torch.zeros_like(self._own_input(peer_index, part_index))
            TensorPartContainer.register_processed_part(self, peer_index, part_index, zeros)
            self.failed_size += zeros.numel()
        self.refused.add(peer_index)


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
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.rule, self._accuse, self._evidence, self._round = rule, accuse, evidence, round_number
        self._alignment_evidence, self._direction_evidence = alignment_evidence, direction_evidence
        ignored = {i for i, peer in enumerate(self.sender_peer_ids) if peer in banned}
        hivemind_reducer = self.tensor_part_reducer
        hivemind_reducer.finished.set()  # never used: quiet its "received 0%" warning when it is collected
        self.tensor_part_reducer = RobustPartReducer(
            hivemind_reducer.part_shapes, hivemind_reducer.num_senders, rule, self._judge_sender, ignored,
            self._judge_direction, self.sender_peer_ids.index(self.peer_id) if self.peer_id in self.sender_peer_ids
            else None,
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
        )

    def _judge(self, peer_id: PeerID, role: str, finding: Finding | None, evidence: Evidence | None = None) -> bool:
        """Weigh one judged part of `peer_id` (`swarm/evidence.py`; the per-part `Evidence` unless another is given)
        in this averager's round (counted here: a leader's group id could repeat); True if it now stands accused.
        This peer does not judge itself."""
        if peer_id == self.peer_id:
            return False
        why = (evidence or self._evidence).judge(peer_id, self._round, finding)
        if why is not None:
            self._accuse(peer_id, f"as a {role}: {why}")
        return why is not None

    def _judge_sender(self, sender_index: int, finding: Finding | None) -> bool:
        if finding is not None:  # which slice, so that a log line says where an accused sender's part lay
            container, reducer = self.tensor_part_container, self.tensor_part_reducer
            finding = located(finding, container.part_key(container.own_index, reducer.current_part_index))
        return self._judge(self.sender_peer_ids[sender_index], "sender", finding)

    def _judge_direction(self, sender_index: int, finding: Finding | None) -> bool:
        return self._judge(self.sender_peer_ids[sender_index], "sender", finding, self._direction_evidence)

    def _judge_reducer(self, peer_index: int, finding: Finding | None) -> bool:
        return self._judge(self.ordered_peer_ids[peer_index], "reducer", finding)

    def _judge_alignment(self, peer_index: int, finding: Finding | None) -> bool:
        return self._judge(self.ordered_peer_ids[peer_index], "reducer", finding, self._alignment_evidence)


class RobustAveraging:
    """Mixin for a hivemind averager (before it in the bases): every all-reduce runs `runner_class`, and peers
    accused in any round are banned from this averager's later rounds and groups while their ban lasts
    (`AveragingBans`). Its matchmaking reads the DHT at most once per `LOOKUP_INTERVAL` (`pace_lookups`)."""

    runner_class: type[AllReduceRunner] = RobustAllReduceRunner
    robust_rule = RobustRule()
    LOOKUP_INTERVAL = 0.2  # seconds between two DHT reads of a matchmaking (`pace_lookups`)

    def __init__(self, *args, **kwargs):
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

    def get_banned_peers(self) -> dict[str, str]:
        """The peers this averager banned and why (asked of the averager's process, which holds the list)."""
        future = MPFuture()
        self._outer_pipe.send(("_banned_peers_for", [], dict(future=future)))
        return future.result()

    async def _banned_peers_for(self, future: MPFuture) -> None:
        future.set_result({peer.to_base58(): why for peer, why in self.banned_peers.current().items()})

    def _accuse(self, peer_id: PeerID, why: str) -> None:
        if peer_id == self.peer_id:
            return
        seconds = self.banned_peers.ban(peer_id, why)
        if seconds is not None:
            logger.warning("%s banned peer %s from averaging for %.0f s: %s", self.prefix, peer_id, seconds, why)

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
