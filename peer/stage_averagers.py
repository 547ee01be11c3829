"""The averagers of a stage's optimizer (`peer/stage_optimizer.py`): its gradients' and its state's, both robust to a
hostile peer of the group (`peer/robust_averaging.py`); the state's also serves joiners a consistent copy and takes
another peer's state only when the stage vouches for it (`peer/state_load.py`)."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable

import torch
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES
from hivemind.compression import NoCompression, ScaledFloat16Compression
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.state_averager import TrainingStateAverager

from peer.robust_averaging import RobustAveraging
from peer.state_load import VerifiedStateLoad

DECLARE_INTERVAL = 10.0  # seconds between two state-donor declarations of one peer, at most one in between


class GradientWire(enum.Enum):
    """What a stage's replicas send each other for their gradients at every epoch (`--grad-averaging`).

    fp16 (hivemind's ScaledFloat16Compression: each part is scaled by its own mean and spread, so gradients of any
    magnitude keep ~3 significant digits relative to the part's spread) halves the averaging rounds' bytes, at
    home-link rates the largest traffic of a stage's replicas (benchmarks/RESULTS.md). Each part names its own
    compression, and hivemind cuts the gradient into parts by bytes after compression: fp16 parts of half the
    default size hold as many values as fp32 parts of the default, so peers of either setting cut it alike and
    average together (a reducer refuses a part of another shape). What the robust rule checks is the decoded
    part: a NaN sent stays NaN.
    The state rounds stay fp32: they average the weights and Adam's moments, whose small second moments fp16
    would round away."""

    FP16 = "fp16"
    FP32 = "fp32"

    def averager_options(self) -> dict:
        """What a gradient averager sending this takes (hivemind's `compression` and `part_size_bytes`)."""
        if self is GradientWire.FP16:
            return dict(compression=ScaledFloat16Compression(), part_size_bytes=DEFAULT_PART_SIZE_BYTES // 2)
        return dict(compression=NoCompression(), part_size_bytes=DEFAULT_PART_SIZE_BYTES)


class RobustGradientAverager(RobustAveraging, GradientAverager):
    """The stage's gradient averaging, robust to a hostile peer of the group (peer/robust_averaging.py); its rounds
    gather each peer's lane (`StageOptimizer.lane`), and in a run of several lanes (`judges_by_lane`, the trip
    flavour's) a sender is judged among its own lane's senders (`peer/averaging_lanes.py`)."""


class SnapshotStateAverager(RobustAveraging, TrainingStateAverager, VerifiedStateLoad):
    """Averages the stage's state robustly (peer/robust_averaging.py), serves a joining peer a consistent copy, and
    takes another peer's state only when the stage's records vouch for it (peer/state_load.py).

    hivemind hands out views of the live tensors and serialises them later, while this peer goes
    on stepping: a joiner could receive parameters half-way through an update, out of step with
    the optimizer moments. Copying under the optimizer lock gives it one state that existed.

    hivemind also re-declares the peer as a state donor in the DHT whenever its priority (the epoch) changes,
    which with short epochs is a signed DHT store a second or more. Here at most one starts per
    `DECLARE_INTERVAL`; one asked for sooner is made at the interval's end, with the epoch then. The cost: a
    joiner ranks the donors by epochs up to that much older (each still sends its current state).
    """

    def __init__(self, *args, **kwargs):
        # before hivemind starts the averager's process, which runs the declarations
        self._declared_at, self._declare_pending = -float("inf"), False
        self.applied_rounds = 0  # state rounds whose tensors reached ours (failed ones copy back our own)
        self.after_averaging: Callable[[], None] | None = None
        self.after_serving: Callable[[int, list[torch.Tensor]], None] | None = None
        super().__init__(*args, **kwargs)

    def _apply_averaging_results_(self):
        # under the optimizer lock, with the owner's fix-up: a joiner downloads the state before both or after both
        with self.lock_optimizer:
            super()._apply_averaging_results_()
            self.applied_rounds += 1
            if self.after_averaging is not None:
                self.after_averaging()

    async def _trigger_declare_load_state(self):
        if self._declare_pending:
            return
        wait = self._declared_at + DECLARE_INTERVAL - time.monotonic()
        if wait > 0:
            self._declare_pending = True
            await asyncio.sleep(wait)
            self._declare_pending = False
        self._declared_at = time.monotonic()
        await super()._trigger_declare_load_state()

    def get_current_state(self):
        # hivemind's own locking first (it may wait out an averaging round), and only then the
        # optimizer lock, held just for the copy: the stage thread never waits on a download
        metadata, tensors, infos = super().get_current_state()
        with self.lock_optimizer:
            tensors = self.copies_to_serve(tensors)
        if self.after_serving is not None:  # the parameters lead the list, in main_parameters' order
            self.after_serving(metadata["epoch"], tensors[: len(self.main_parameters)])
        return metadata, tensors, infos


    def copies_to_serve(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [tensor.clone() for tensor in tensors]


class PoisonedStateDonor(SnapshotStateAverager):
    """Fault injection (`--fault-poison-served-state`): a hostile donor. It declares an epoch far ahead of the
    stage's, so joiners ask it first, and serves its parameters shifted by POISON (finite: a finiteness check
    passes them), noting that hash as served, as a liar's record would. It trains honestly otherwise."""

    POISON, CLAIMED_LEAD = 0.5, 1_000_000

    @property
    def state_sharing_priority(self) -> float:
        return TrainingStateAverager.state_sharing_priority.fget(self)

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        TrainingStateAverager.state_sharing_priority.fset(self, value + self.CLAIMED_LEAD)

    def copies_to_serve(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        copies = super().copies_to_serve(tensors)
        for copy in copies[: len(self.main_parameters)]:
            copy.add_(self.POISON)
        return copies


# hivemind names a servicer's RPC handlers after its class: the hostile donor answers under the honest name
PoisonedStateDonor.__name__ = SnapshotStateAverager.__name__
