"""hivemind's Optimizer as a stage uses it: robust averaging, consistent state for joiners, quiet when alone, paced
progress."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import torch
from hivemind.averaging.control import StepControl
from hivemind.dht import DHT
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.optimizer import Optimizer
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.utils.crypto import RSAPrivateKey

from peer.progress import PROGRESS_INTERVAL, PacedProgressTracker
from peer.robust_averaging import RobustAveraging
from peer.state_load import VerifiedStateLoad
from swarm.manifest import Manifest
from swarm.model import PipelineStage
from swarm.optim import lr_at, make_optimizer, parameter_groups

DECLARE_INTERVAL = 10.0  # seconds between two state-donor declarations of one peer, at most one in between
MATCHMAKING_TIME = 1.0  # seconds a group's leader waits for the stage's other peers at an epoch's end
# A state round starts where each replica's update lands (up to a microbatch or two apart) and runs in the
# background. With groups of one allowed, the first replica to start formed a group alone at once (hivemind's
# matchmaking assembles a group as soon as its first declaration times out the leader queue, measured: every
# state round a group of one, 0.3-0.9 s): a state round takes two peers, waits up to STATE_MATCHMAKING_TIME for
# the other and gives up after STATE_ROUND_TIMEOUT. The cost: an update landing before the round's result is
# applied waits for the round and is then overwritten by it (hivemind's delayed state averaging), which epochs
# longer than the timeout (4 s or more in the probe) leave no time for
STATE_MATCHMAKING_TIME, STATE_ROUND_TIMEOUT = 3.0, 5.0
AVERAGING_TIMEOUT = 30.0  # seconds an averaging round may take, matchmaking and all-reduce, before it is given up
REQUEST_TIMEOUT = 0.5  # seconds to wait for a would-be leader's answer (a dead peer's declaration costs this)
# seconds a peer's progress record lives: it is renewed every half of it even when idle; a dead peer counts in
# the stage's progress (its samples extrapolated at its last rate) until its record expires
PROGRESS_EXPIRATION = 30.0
MAX_STALE = 5  # epochs a peer may fall behind its stage and move on without downloading the stage's state

logger = logging.getLogger(__name__)


class RobustGradientAverager(RobustAveraging, GradientAverager):
    """The stage's gradient averaging, robust to a hostile peer of the group (peer/robust_averaging.py)."""


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
        self.after_averaging: Callable[[], None] | None = None
        self.after_serving: Callable[[int, list[torch.Tensor]], None] | None = None
        super().__init__(*args, **kwargs)

    def _apply_averaging_results_(self):
        # under the optimizer lock, with the owner's fix-up: a joiner downloads the state before both or after both
        with self.lock_optimizer:
            super()._apply_averaging_results_()
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


class StageOptimizer(Optimizer):
    """hivemind's Optimizer with robust gradient and state averaging, serving consistent state to joiners, and
    averaging rounds that start only at a step that ends the epoch.

    hivemind books each averaging round (gradients, then state) ahead of the epoch's end, at the time it
    estimates the epoch will end, and commits the peer to a group then. A volunteer running its own data
    loop always reaches that end; a stage peer reaches it only when a trip reaches it. In a pipeline the
    booked partner may get no trip for long: the peer that did reach the end waits for it, holding the
    drivers' trips that would have let it step. Measured in the failover test (tests/test_peer_swarm.py):
    a joiner booked into a round with the stage's other peer, every trip in flight held by that peer, both
    idle for the 30 s averaging timeout, epoch after epoch. Here a round starts at the step that ends the
    epoch: its leader waits `MATCHMAKING_TIME` for whoever else of the stage also ended it, then averages
    with them (alone, when none came: `min_group_size` 1). Booking nothing ahead also keeps the DHT quiet
    (booking polls it many times a second: ~100 lookups a second on a 3-stage local swarm).

    The round runs behind the stage's back. hivemind's step waits, on the stage's one thread, for the whole
    round: matchmaking (at least `MATCHMAKING_TIME`, longer while the other replica reaches the epoch's end)
    and the all-reduce. Measured on the probe (benchmarks/stage_averaging_probe.py, 128 sequences per epoch):
    1.0 to 3.5 s a round (once 12 s), of which the all-reduce took 0.15 to 0.5 s; every trip in flight
    through the stage waited that long, each stage at its own time. Here the step that ends the epoch only
    hands the accumulated gradients to the averager (its own process) and moves to the next epoch; the
    stage's trips go on accumulating the next epoch's gradients. The update lands at the first step after
    the round ended: averaged gradients (or, if the round failed, what the buffers hold: our own gradients,
    or some parts averaged) into `.grad`, then the optimizer step and, every `average_state_every` epochs,
    a state round (in the background, as hivemind does it). Everything touching the stage's tensors stays
    on the stage thread, so the optimizer keeps stepping the stage's own tensors (no offloaded copy for U
    switches, re-projections and checkpoints to miss). The cost: the first trips of an epoch are computed
    with the weights before the last epoch's update (at most one update behind, as hivemind's
    `delay_optimizer_step`); an epoch that ends before the last round did goes on accumulating until it has.

    A peer that moves its epoch on without the stage's weights (`_move_epoch`) says so: `weights_epoch`, which
    every reply carries for the drivers' audits (`peer/next_hop.py`), lags its epoch by the epochs it skipped,
    until its weights come from the stage again (a download taken, or a state round with another peer).
    """

    def __init__(self, *args, state_donor: type[SnapshotStateAverager] = SnapshotStateAverager, label: str = "",
                 **kwargs):
        self.state_donor = state_donor  # the state averager's class: PoisonedStateDonor only to inject a fault
        self.label = label
        # the running gradient round whose update has not landed yet, and when its epoch ended
        self._round: StepControl | None = None
        self._round_began = 0.0
        self._state_round: StepControl | None = None  # the last state round started, until it ends
        self.unsynced_epochs = 0  # epochs moved on since the weights last came from the stage (`weights_epoch`)
        # every download, a join's or a catch-up inside `step`, goes through the owner's checks (peer/runtime.py)
        self.checked_download: Callable[[Callable[[], None]], bool] = _unchecked
        super().__init__(*args, **kwargs)

    @property
    def update_pending(self) -> bool:
        """An epoch ended and its update has not reached the weights yet (its round is running)."""
        return self._round is not None

    @property
    def weights_epoch(self) -> int:
        """The epoch whose weights this peer holds, as far as it knows (class docstring)."""
        return max(self.local_epoch - self.unsynced_epochs, 0)

    def step(self, *args, **kwargs):
        loss = super().step(*args, **kwargs)  # this microbatch's gradients are accumulated by now
        if self._round is not None and self._round.done():
            self._land()
        if self._state_round is not None and self._state_round.done():
            self._state_round_ended()
        return loss

    def _state_round_ended(self) -> None:
        """A state round with another peer gives both the same weights: ours are the stage's again."""
        round_, self._state_round = self._state_round, None
        try:
            gathered = round_.result()  # None, or an exception, where it failed: then it changed nothing
        except BaseException:  # noqa: BLE001
            gathered = None
        if gathered is not None and len(gathered) > 1:
            self.unsynced_epochs = 0

    def _update_global_epoch(self, grad_scaler) -> None:
        """The epoch's end: start its gradient round in the background and move to the next epoch."""
        assert grad_scaler is None, "a stage steps without a gradient scaler"
        if self._round is not None:
            if not self._round.done():
                # the last epoch's round still runs (matchmaking waits up to `averaging_timeout` for a group that
                # may never form): its update comes first, and the stage thread does not wait for it. This epoch
                # goes on accumulating; the step after the round ended lands it and ends this one
                return
            self._land()
        with self.tracker.pause_updates():
            round_ = None
            if self.tracker.global_progress.num_peers > 1:
                try:
                    round_ = self.grad_averager.step(wait=False, timeout=self.averaging_timeout)
                except Exception as exc:  # noqa: BLE001 - then the update is made of our own gradients
                    logger.warning("%s could not start a gradient round: %r", self.label, exc)
            if round_ is None:
                self.grad_averager.load_accumulators_into_averager_()
                self.grad_averager.reset_accumulated_grads_()
            self.state_averager.local_epoch += 1
            self.tracker.update_epoch(new_epoch=self.local_epoch)
            self._should_check_synchronization_on_update = True
            if not self.client_mode:
                self.state_averager.state_sharing_priority = self.local_epoch
        self._round, self._round_began = round_, time.perf_counter()
        if round_ is None:  # alone: nothing to wait for
            self._land()

    def _land(self) -> None:
        """The ended epoch's update reaches the weights: the round's gradients, the optimizer step, and every
        `average_state_every` epochs a state round (stage thread). Called only once the round is over (or there
        was none): the stage thread never waits for one."""
        round_, self._round = self._round, None
        waited, group = time.perf_counter() - self._round_began, "alone"
        if round_ is not None:
            try:
                group = f"{len(round_.result())} peers"
            except BaseException as exc:  # noqa: BLE001 - a failed round still leaves usable gradients
                group = f"failed ({exc!r:.60})"
        began = time.perf_counter()
        self._load_averaged_gradients_into_optimizer_()
        average_state = (
            self.tracker.global_progress.num_peers > 1
            and self.local_epoch % self.average_state_every == 0
            and not self.state_averager.averaging_in_progress
        )
        if average_state:  # started here, as hivemind would in its step, to learn whether it found a peer
            self._state_round = super(TrainingStateAverager, self.state_averager).step(
                gather=self.local_epoch, require_trigger=True, timeout=STATE_ROUND_TIMEOUT, wait=False
            )
        self.state_averager.step(
            optimizer_step=True,
            averaging_round=average_state,
            delay_averaging=True,
            averaging_control=self._state_round if average_state else None,
            averaging_opts=dict(timeout=STATE_ROUND_TIMEOUT) if average_state else None,
        )
        # one line an epoch: INFO when the stage's peers averaged (or failed to), DEBUG for a peer alone
        logger.log(logging.DEBUG if round_ is None else logging.INFO,
                   "%s epoch %d update landed: gradients %s, %.2f s after the epoch ended; step %.3f s%s", self.label,
                   self.local_epoch, group, waited, time.perf_counter() - began,
                   "; state round started" if average_state else "")

    def _drop_round(self) -> None:
        """Before a download or a shutdown: the running round is hivemind's to finish (it tags along with it)."""
        if self._round is not None:
            self.scheduled_grads, self._round = self._round, None
            self.grad_averager.notify_used_averaged_gradients()

    def load_state_from_peers(self, **kwargs) -> bool:
        """Whether a state was taken. hivemind calls this from `step` too, when the peer fell more than MAX_STALE
        epochs behind: that download is checked and noted as a join's is, or the peer would hash the state it took
        as its own and vouch for it to the next joiner (`swarm/live_state.py confirmations`)."""
        self._drop_round()
        began = time.perf_counter()
        try:
            taken = self.checked_download(lambda: super(StageOptimizer, self).load_state_from_peers(**kwargs))
            if taken:
                self.unsynced_epochs = 0
            return taken
        finally:
            logger.info("%s loading the stage's state took %.2f s (epoch now %d)", self.label,
                        time.perf_counter() - began, self.local_epoch)

    def shutdown(self):
        self._drop_round()
        # the owner's check is bound to its runtime, and something outside keeps a stopped optimizer referenced
        # (as it does the averagers: peer/runtime.py `shutdown`): dropped here, or every stage a peer leaves stays
        # in memory (tests/test_stage_moves.py)
        self.checked_download = _unchecked
        super().shutdown()

    def _should_load_state_from_peers(self) -> bool:
        behind = self.tracker.global_epoch - self.local_epoch
        may_download = time.monotonic() >= self.state_averager.retry_at
        if self.local_epoch > 0 and self.unsynced_epochs + max(behind, 0) > MAX_STALE and may_download:
            # weights more than MAX_STALE epochs old, whatever the epoch says: the first chance to refresh them
            return True
        if behind == 1:
            # another peer of the stage just ended the epoch and is looking for a group: this step ends ours too
            # (hivemind's `ready_to_update_epoch`), with what we accumulated (nothing, for an idle peer: then it
            # tags along and takes the others' update), so that its round has us. Moving the epoch instead left
            # the other peer's round without a partner (measured: it waited 9.6 s, and this peer's epoch had no
            # update at all)
            return False
        if 0 < behind <= MAX_STALE:  # a few epochs behind: move on with the stage instead of downloading its state
            self._move_epoch("caught up without a download")
            return False
        if behind > MAX_STALE and self.local_epoch > 0 and not may_download:
            # a download was made less than RETRY_S ago, taken or not (`VerifiedStateLoad`): a peer holding a state
            # (trained or downloaded) keeps it and moves on, rather than drop every microbatch until the next
            # download (hivemind: "out of sync"). Measured in the failover test: a joiner's state was 9 epochs old
            # when it landed (a stage of short epochs), its first trips each waited for another download, and the
            # drivers, timing them, sent it none after. A joiner at epoch 0 holds only the seed and keeps waiting
            self._move_epoch("kept its state: the last download was less than a minute ago")
            return False
        return behind > MAX_STALE

    def _move_epoch(self, why: str) -> None:
        logger.info("%s epoch %d -> %d: the stage moved on (%s)", self.label, self.local_epoch,
                    self.tracker.global_epoch, why)
        self.unsynced_epochs += self.tracker.global_epoch - self.local_epoch
        with self.tracker.pause_updates():
            self.state_averager.local_epoch = self.tracker.global_epoch
            self.tracker.update_epoch(self.tracker.global_epoch)

    def _maybe_schedule_gradient_averaging(self) -> None:
        """Books nothing ahead (the class docstring)."""

    def _maybe_schedule_state_averaging(self) -> None:
        """Books nothing ahead (the class docstring)."""

    def _make_gradient_averager(self, factory, **kwargs):
        # always the robust averager (hivemind passes its default). Joiners download state from the state
        # averager only; hivemind would also declare the gradient averager as a state donor in the DHT, once more
        # at every epoch, for nobody to read
        return super()._make_gradient_averager(RobustGradientAverager, allow_state_sharing=False, **kwargs)

    def _make_progress_tracker(self, target_batch_size: int, **kwargs) -> PacedProgressTracker:
        # one progress record per PROGRESS_INTERVAL instead of one per microbatch (peer/progress.py)
        return PacedProgressTracker(
            dht=self.dht,
            prefix=self.run_id,
            target_batch_size=target_batch_size,
            client_mode=self.client_mode,
            status_loglevel=self.status_loglevel,
            start=True,
            **kwargs,
        )

    def _make_state_averager(self, **kwargs) -> TrainingStateAverager:
        kwargs["min_group_size"] = 2  # STATE_MATCHMAKING_TIME
        return self.state_donor(
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=STATE_MATCHMAKING_TIME,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **kwargs,
        )


def _unchecked(download: Callable[[], None]) -> bool:
    download()
    return True


def stage_optimizer(stage: PipelineStage, manifest: Manifest, index: int, dht: DHT, signing_key: RSAPrivateKey | None,
                    poison_served_state: bool = False, label: str = "") -> StageOptimizer:
    """The optimizer of stage `index` of the run, on `stage`'s own tensors.

    Its progress records are signed with `signing_key`, the key the DHT's signature validator signs with
    (`peer/join.py`): under hivemind's default key every node refused them, each peer saw no other and
    stepped alone, and replicas of a stage never averaged. A group may be one peer (`min_group_size` 1):
    a peer whose partner died waits out one matchmaking, not the whole averaging timeout, at each epoch
    until the dead peer's progress record expires."""
    spec = manifest.optimizer
    return StageOptimizer(
        dht=dht,
        run_id=f"{manifest.optimizer_prefix}_stage{index}",
        # with context parallelism each of a stage's P lanes counts a trip's B sequences (of its chunk): an
        # epoch of `target_batch_size` sequences is P times as many lane samples
        target_batch_size=manifest.batch.target_batch_size * manifest.lanes,
        batch_size_per_step=manifest.batch.microbatch_size,
        optimizer=lambda params: make_optimizer(stage, params),
        params=parameter_groups(stage),
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, lambda epoch: lr_at(epoch, spec.lr, spec.warmup_steps) / spec.lr
        ),
        matchmaking_time=MATCHMAKING_TIME,
        averaging_timeout=AVERAGING_TIMEOUT,
        average_state_every=5,
        averager_opts=dict(request_timeout=REQUEST_TIMEOUT, min_group_size=1),
        # read no more often than peers report (PROGRESS_INTERVAL)
        tracker_opts=dict(min_refresh_period=PROGRESS_INTERVAL, private_key=signing_key,
                          metadata_expiration=PROGRESS_EXPIRATION),
        # the optimizer steps the stage's own tensors: checkpoints, U switches and re-projections
        # then act on the one copy that exists (an offloaded copy would silently undo them)
        offload_optimizer=False,
        verbose=False,
        state_donor=PoisonedStateDonor if poison_served_state else SnapshotStateAverager,
        label=label,
    )
