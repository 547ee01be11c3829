"""The two per-part pieces of a stage's robust all-reduce (`peer/robust_averaging.py` builds them into hivemind's).

hivemind 1.1.12 reduces a part with a running weighted sum (`TensorPartReducer`) and applies whatever a
reducer returns (`TensorPartContainer.register_processed_part`). Here:

- `RobustPartReducer` collects the parts of the current part index (the running sum becomes a list, through
  the `add_` hivemind calls on its accumulator) and, once every sender is in, returns `robust_average` instead
  of the mean; each sender's part is judged, and an accused sender's later parts of the round are ignored; after
  the last part, the direction of each sender's parts of the round (`SenderDirection`, `direction_findings`);
  with lanes each sender is judged among its own lane's senders only (`camps`, `peer/averaging_lanes.py`), for
  its parts and for its round's direction alike (a sender of no lane is a camp of its own: clipped, not judged);
- `CheckedPartContainer` holds the parts other reducers return until this peer's own reduction is done (that
  gives the honest relative change), then applies `check_reduced` to each, with the change this peer's own
  reductions made to that same part in earlier rounds (`PartChanges`) as a second reference: a refused part is
  replaced by zeros (this peer keeps its own values for that slice, as hivemind does for a reducer that fails),
  and an accused reducer's every later part of the round too; once a reducer's last part is in, how far its
  used averages pointed along this peer's parts (`Alignment`) is judged too, once for the round, against a floor
  scaled by this peer's weight share in the last part it reduced (`RobustPartReducer.weight_share`); not judged at
  all where that share is 0 (this peer's own part was not averaged there), so such a peer does not catch a reducer
  that negates the average.

Each judged part goes to a `PartJudge`, the runner's, with its number of values: it weighs it as evidence
(`swarm/evidence.py`: by its values) and says whether its peer is now accused; a round's direction goes to a
`Judge`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Hashable, Mapping, Sequence

import torch
from hivemind.averaging.allreduce import AllreduceException
from hivemind.averaging.partition import TensorPartContainer, TensorPartReducer

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

Judge = Callable[[int, Finding | None], bool]  # one judgement of the peer at this index; True: it is accused
# the same for one judged part, of this many values (None: a judgement weighing 1, for what no honest peer sends)
PartJudge = Callable[[int, Finding | None, int | None], bool]


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
        judge: PartJudge,
        ignored: set[int],
        judge_direction: Judge,
        own_sender: int | None,
        camps: Mapping[int, Hashable] | None = None,
    ):
        self.rule, self.judge, self.ignored, self.judge_direction = rule, judge, ignored, judge_direction
        self.own_sender = own_sender
        self.camps = camps  # sender index -> its lane: each sender is judged among its own lane's (`robust_average`)
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
        camps = None if self.camps is None else [self._camp(senders[n]) for n in keep]
        aggregate = robust_average([collector.parts[n] for n in keep], [collector.weights[n] for n in keep], shape,
                                   self.rule, camps)
        future = self.current_part_future
        if aggregate is None:
            future.set_exception(AllreduceException("no usable contribution to this part"))
        else:
            findings = {n: Finding(why, math.inf) for n, why in aggregate.refused.items()} | aggregate.judged
            values = math.prod(shape)
            for n, finding in findings.items():
                if self.judge(senders[keep[n]], finding, values):
                    self.ignored.add(senders[keep[n]])
            for n, direction in aggregate.directions.items():
                self.directions.setdefault(senders[keep[n]], SenderDirection()).merge(direction)
            own = [n for n in aggregate.weights if senders[keep[n]] == self.own_sender]
            total = sum(aggregate.weights.values())
            if total > 0:  # 0 when this peer's own part was not averaged
                self.weight_share = len(aggregate.weights) * aggregate.weights[own[0]] / total if own else 0.0
            future.set_result(aggregate.average)
        if self.current_part_index == self.num_parts - 1:  # the round's directions; an accused sender is left out
            for directions in self._directions_by_camp().values():
                for sender, finding in direction_findings(directions, self.rule).items():
                    self.judge_direction(sender, finding)
        self.reset_accumulators()

    def _camp(self, sender: int) -> Hashable:
        """The camp `sender` is judged in: its lane, a camp of its own if it has none, one camp for all without
        lanes."""
        return None if self.camps is None else self.camps.get(sender, ("alone", sender))

    def _directions_by_camp(self) -> dict[Hashable, dict[int, SenderDirection]]:
        """The round's directions of the senders not accused, by camp: each round's lowest is picked in its lane."""
        by_camp: dict[Hashable, dict[int, SenderDirection]] = {}
        for sender, direction in self.directions.items():
            if sender not in self.ignored:
                by_camp.setdefault(self._camp(sender), {})[sender] = direction
        return by_camp


class CheckedPartContainer(TensorPartContainer):
    """Checks the parts other reducers return against this peer's own reduction (module docstring)."""

    def adopt(
        self,
        own_index: int,
        rule: RobustRule,
        judge: PartJudge,
        banned: set[int],
        changes: PartChanges,
        judge_alignment: Judge,
        weight_share: Callable[[], float] = lambda: 1.0,
        log_name: str = "averaging",
    ):
        """Turn hivemind's container into this one after `AllReduceRunner.__init__` built it (it builds it inline,
        with no hook for another class). `judge_alignment` weighs each reducer's `Alignment` once its last part of
        the round is in; `log_name` (the averager's prefix: its run and stage) starts each log line."""
        self.__class__ = CheckedPartContainer
        self.own_index, self.rule, self.judge, self.changes = own_index, rule, judge, changes
        self.log_name = log_name
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
            if self.judge(peer_index, Finding(why, math.inf), None):  # not its size: the reducer chose that
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
        elif self.judge(peer_index, finding, own.numel()):
            self.register_failed_reducer(peer_index)
        elif finding is not None:  # refused: this peer keeps its own values for that slice
            logger.info("%s refused reduced part %d of reducer %d, %d values (not accused yet): %s", self.log_name,
                        part_index, peer_index, own.numel(), finding.why)
            super().register_processed_part(peer_index, part_index, torch.zeros_like(own))
            self.failed_size += own.numel()
        else:
            self._use(peer_index, part_index, own, part)

    def _use(self, peer_index: int, part_index: int, own: torch.Tensor, delta: torch.Tensor) -> None:
        """Apply a part that passed its check; after the reducer's last part, judge the round's `Alignment`, unless
        this peer's own part was not averaged where it reduced (weight share 0): an honest average then need not
        hold this peer's parts at all."""
        alignment = self.alignments.setdefault(peer_index, Alignment())
        alignment.add(own, own + delta)
        super().register_processed_part(peer_index, part_index, delta)
        last = self._outputs_registered_by_peer[peer_index] == self.num_parts_by_peer[peer_index]
        if last and alignment.judged and (share := self.weight_share()) > 0:
            self.judge_alignment(peer_index, alignment.finding(self.rule, share))

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
