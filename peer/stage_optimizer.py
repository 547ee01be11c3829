"""hivemind's Optimizer as a stage uses it: robust averaging (its averagers: `peer/stage_averagers.py`), consistent
state for joiners, quiet when alone, paced progress, and the epoch of the weights it holds."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from hivemind.averaging.control import StepControl
from hivemind.dht import DHT
from hivemind.optim.optimizer import Optimizer
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.utils.crypto import RSAPrivateKey

from peer.progress import PROGRESS_INTERVAL, PacedProgressTracker
from peer.stage_averagers import GradientWire, PoisonedStateDonor, RobustGradientAverager, SnapshotStateAverager
from swarm.fingerprint import weights_fingerprint
from swarm.manifest import Manifest
from swarm.model import PipelineStage
from swarm.optim import lr_at, make_optimizer, parameter_groups

MATCHMAKING_TIME = 1.0  # seconds a group's leader waits for the stage's other peers at an epoch's end
# A state round starts where each replica's update lands (up to a microbatch or two apart) and runs in the
# background. With groups of one allowed, the first replica to start formed a group alone at once (hivemind's
# matchmaking assembles a group as soon as its first declaration times out the leader queue, measured: every
# state round a group of one, 0.3-0.9 s): a state round takes two peers, waits up to STATE_MATCHMAKING_TIME for
# the other and gives up after STATE_ROUND_TIMEOUT. The cost: an update landing before the round's result is
# applied waits for the round and is then overwritten by it (hivemind's delayed state averaging), which epochs
# longer than the timeout (4 s or more in the probe) leave no time for
STATE_MATCHMAKING_TIME, STATE_ROUND_TIMEOUT = 3.0, 5.0
STATE_ALLREDUCE_TIMEOUT = 30.0  # seconds a state round's all-reduce may run in the background
# seconds an averaging round may take, matchmaking and all-reduce, before it is given up: a gradient round moves
# each peer's whole gradient once up and once down its link (a tiny-preset stage in fp16: 3.2 MB up per peer of
# two, 26 s at 1 Mbit/s with the link to itself). It runs beside the trips; the update waits for it
AVERAGING_TIMEOUT = 90.0
# seconds the next part of an all-reduce may take to arrive before its sender (twice that: its reducer) is
# dropped from the round. hivemind's default is the matchmaking time, 1 s, less than a 256-512 KiB part takes
# at home-link rates: measured on the emulated internet at 1 Mbit/s, every gradient round of two lane replicas
# ended "received 50.0% of input tensors" within 1-2 s, each peer keeping its own gradient (never averaged).
# 10 s passes a 512 KiB part at 0.5 Mbit/s
AVERAGING_PART_TIMEOUT = 10.0
REQUEST_TIMEOUT = 0.5  # seconds to wait for a would-be leader's answer (a dead peer's declaration costs this)
# seconds a peer's progress record lives: it is renewed every half of it even when idle; a dead peer counts in
# the stage's progress (its samples extrapolated at its last rate) until its record expires
PROGRESS_EXPIRATION = 30.0
MAX_STALE = 5  # epochs a peer may fall behind its stage and move on without downloading the stage's state

logger = logging.getLogger(__name__)




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
                 gradient_wire: GradientWire = GradientWire.FP16, judges_by_lane: bool = False, **kwargs):
        self.state_donor = state_donor  # the state averager's class: PoisonedStateDonor only to inject a fault
        self.gradient_wire = gradient_wire
        self.label = label
        self.judges_by_lane = judges_by_lane  # gradient senders judged among their lane's (stage_averagers)
        self.lane = 0  # the lane this peer serves (set by its slot), gathered in gradient rounds (stage_averagers)
        # the running gradient round whose update has not landed yet, and when its epoch ended
        self._round: StepControl | None = None
        self._round_began = 0.0
        self._state_round: StepControl | None = None  # the last state round started, until its tensors landed
        self._applied_before = 0  # the state averager's `applied_rounds` when it started
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
        """A state round with another peer gives both the same weights: ours are the stage's again once its
        tensors reached them (hivemind applies them at a later step)."""
        try:
            gathered = self._state_round.result()  # the group's gathered epochs, or an exception where it failed
        except BaseException:  # noqa: BLE001 - a failed round changed nothing
            gathered = {}
        if len(gathered) < 2:
            self._state_round = None
        elif self.state_averager.applied_rounds > self._applied_before:
            self._state_round, self.unsynced_epochs = None, 0

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
                    round_ = self.grad_averager.step(wait=False, timeout=self.averaging_timeout, gather=self.lane)
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
        round_ = self._start_state_round() if average_state else None
        try:
            self.state_averager.step(
                optimizer_step=True,
                averaging_round=round_ is not None,
                delay_averaging=True,
                averaging_control=round_,
                averaging_opts=dict(timeout=STATE_ROUND_TIMEOUT) if round_ is not None else None,
            )
        except BaseException:
            if round_ is not None:  # never triggered: it would wait for ever in the averager's process
                round_.cancel()
                self._state_round = None
            raise
        # one line an epoch: INFO when the stage's peers averaged (or failed to), DEBUG for a peer alone
        logger.log(logging.DEBUG if round_ is None else logging.INFO,
                   "%s epoch %d update landed: gradients %s, %.2f s after the epoch ended; step %.3f s%s", self.label,
                   self.local_epoch, group, waited, time.perf_counter() - began,
                   "; state round started" if round_ is not None else "")
        if logger.isEnabledFor(logging.DEBUG):  # how far the stage's replicas drift apart (benchmarks/audit_pairs.py)
            fingerprint = weights_fingerprint(self.state_averager.main_parameters)
            logger.debug("%s epoch %d weights fingerprint: %s", self.label, self.local_epoch,
                         " ".join(f"{x:.7g}" for x in fingerprint))

    def _start_state_round(self) -> StepControl | None:
        """A state round started here, as hivemind would in its step, to learn whether it found a peer."""
        try:
            self._state_round = super(TrainingStateAverager, self.state_averager).step(
                gather=self.local_epoch, require_trigger=True, timeout=STATE_ROUND_TIMEOUT, wait=False
            )
        except Exception as exc:  # noqa: BLE001 - the update lands without it
            logger.warning("%s could not start a state round: %r", self.label, exc)
            return None
        self._applied_before = self.state_averager.applied_rounds
        return self._state_round

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
        # hivemind never stops its state averager's step executor: its worker (started at the first state round)
        # would run until the garbage collector happens to take the executor
        self.state_averager.step_executor.shutdown(wait=True)

    def _should_load_state_from_peers(self) -> bool:
        behind = self.tracker.global_epoch - self.local_epoch
        may_download = time.monotonic() >= self.state_averager.retry_at
        stale = self.unsynced_epochs + max(behind, 0) > MAX_STALE and self.tracker.global_progress.num_peers > 1
        if self.local_epoch > 0 and stale and may_download:
            # weights more than MAX_STALE epochs older than the stage's, whatever the epoch says: refreshed at the
            # first chance (a peer left alone holds the stage's weights: nobody to download from)
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
        kwargs.update(self.gradient_wire.averager_options())  # in place of hivemind's `grad_compression`
        return super()._make_gradient_averager(RobustGradientAverager, allow_state_sharing=False,
                                               judges_by_lane=self.judges_by_lane, **kwargs)

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
            # the timeouts state rounds had before the gradient rounds' grew (made for a dense gradient on a home
            # link): a state round that cannot finish must not hold the link that long
            allreduce_timeout=STATE_ALLREDUCE_TIMEOUT,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=MATCHMAKING_TIME,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **kwargs,
        )


def _unchecked(download: Callable[[], None]) -> bool:
    download()
    return True


def stage_optimizer(stage: PipelineStage, manifest: Manifest, index: int, dht: DHT, signing_key: RSAPrivateKey | None,
                    poison_served_state: bool = False, label: str = "",
                    gradient_wire: GradientWire = GradientWire.FP16, judges_by_lane: bool = False) -> StageOptimizer:
    """The optimizer of stage `index` of the run, on `stage`'s own tensors.

    Its progress records are signed with `signing_key`, the key the DHT's signature validator signs with
    (`peer/join.py`): under hivemind's default key every node refused them, each peer saw no other and
    stepped alone, and replicas of a stage never averaged. A group may be one peer (`min_group_size` 1):
    a peer whose partner died waits out one matchmaking, not the whole averaging timeout, at each epoch
    until the dead peer's progress record expires. `gradient_wire`: what its gradient averaging sends;
    `judges_by_lane`: its gradient senders are judged among their lane's, else all together."""
    spec = manifest.optimizer
    return StageOptimizer(
        dht=dht,
        run_id=manifest.optimizer_run_id(index),
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
        next_chunk_timeout=AVERAGING_PART_TIMEOUT,
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
        gradient_wire=gradient_wire,
        judges_by_lane=judges_by_lane,
    )
