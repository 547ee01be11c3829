"""The stage a peer serves: its layers, its hivemind optimizer, its checkpoints.

All torch work of a stage runs on one worker thread, so concurrent trips never interleave their
backward passes with an optimizer step. A trip submits one job per phase: `forward`, then `learn` (backward,
check, clip, then `step`: `opt.step`, `zero_grad`), or `learn_lane` for a lane trip (`peer/trip.py`,
`peer/lane_trip.py`). The event loop only awaits that thread.

A stage never applies a non-finite update, whatever a trip or a fellow peer sends:
- a microbatch whose gradients (of the parameters or of the input), or loss, are not finite is
  refused before hivemind sees it (`not_finite` back to its sender): its gradients are dropped,
  never accumulated, since one NaN in hivemind's accumulators would poison the whole epoch;
- `SubspaceAdamW` skips a step whose (averaged) gradients are not finite;
- after every optimizer call and every load the stage's parameters and moments are checked, and if
  they are not finite the last finite state is restored (`peer/finite_state.py`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from hivemind.utils.crypto import RSAPrivateKey

from peer.finite_state import FiniteStateGuard
from peer.processes import close_abandoned_loops, release_freed_memory
from peer.stage_averagers import GradientWire
from peer.stage_optimizer import stage_optimizer
from peer.state_load import stage_choice
from peer.stats import Stats
from swarm.codec import BoundaryCodec
from swarm.cp_lane import LaneTrip
from swarm.live_state import copies_entry, parameters_sha256, state_entry
from swarm.manifest import Manifest
from swarm.model import PipelineStage, next_token_loss
from swarm.optim import clip_grad_norm
from swarm.subspace import t_fixed_table, tensor_sha256
from swarm.wire import MAX_GRADIENT_NORM, ErrorCode, WireError, max_token_norm

logger = logging.getLogger("peer.runtime")


class StageRuntime:
    def __init__(
        self,
        manifest: Manifest,
        index: int,
        dht,
        device: torch.device,
        label: str,
        checkpoint_dir: str | None = None,
        fault_t_fixed_seed: int | None = None,
        fault_poison_served_state: bool = False,
        signing_key: RSAPrivateKey | None = None,
        checkpoint_every: int = 50,
        stats: Stats | None = None,
        gradient_wire: GradientWire = GradientWire.FP16,
        judges_by_lane: bool = False,
    ):
        """`stats`: the peer's counters, where this runtime's stage-thread times are added (its own by default).
        `judges_by_lane`: its gradient senders are judged among their lane's (the trip flavour's), else together."""
        self.manifest, self.index, self.device, self.label = manifest, index, device, label
        stats = stats or Stats()
        self.queued, self.busy = stats.stage_queued, stats.stage_busy
        self.stage = PipelineStage(manifest, index).to(device)
        if fault_t_fixed_seed is not None:  # fault injection: a peer whose T_fixed bytes differ
            shape = manifest.model
            table = t_fixed_table(fault_t_fixed_seed, shape.vocab_size, shape.d_model, manifest.t_fixed_std)
            self.stage.subspace.t_fixed = table.to(device)
            self.stage.subspace.t_fixed_sha256 = tensor_sha256(table)
        self.codec = BoundaryCodec(manifest, self.stage.subspace)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stage{index}")
        self.optimizer = stage_optimizer(self.stage, manifest, index, dht, signing_key, fault_poison_served_state,
                                         label, gradient_wire, judges_by_lane)
        self.checkpoint_dir = Path(checkpoint_dir) / manifest.run_id if checkpoint_dir else None
        self.checkpoint_every = max(checkpoint_every, 1)
        self.state_sha256 = parameters_sha256(self.stage)
        self.state_hashes: deque[str] = deque(maxlen=16)
        self.loaded_state = ""
        self.served_states: deque[str] = deque(maxlen=4)
        averager = self.optimizer.state_averager
        averager.after_averaging, averager.after_serving = self._averaged_state_landed, self._state_served
        averager.choose = stage_choice(self.stage, averager.main_parameters, dht, manifest, index, label)
        self.optimizer.checked_download = self._checked_download
        self._hashed_epoch = -1
        self._skipped_steps = 0
        self.guard = FiniteStateGuard(self.stage, self.optimizer, device, label)
        self.guard.keep()

    @property
    def refused_updates(self) -> Counter[str]:
        """Why microbatches or states were refused, ever."""
        return self.guard.refused_updates

    @property
    def epoch(self) -> int:
        return self.optimizer.local_epoch

    async def run(self, fn, *args):
        """`fn(*args)` on the stage thread; its wait for the thread and its run are counted (`Stats`)."""
        submitted = time.perf_counter()

        def timed():
            began = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.queued.add(began - submitted)
                self.busy.add(time.perf_counter() - began)

        return await asyncio.get_running_loop().run_in_executor(self.executor, timed)

    # --- work done on the stage thread -------------------------------------------------------

    def check_version(self, version: int) -> None:
        """A trip runs under one U from end to end: if U switched since it started, it must start over."""
        current = self.stage.subspace.version
        if version != current:
            raise WireError(ErrorCode.WRONG_VERSION, f"U switched from v{version} to v{current} during this trip")

    def encode_forward(
        self, version: int, output: torch.Tensor, tokens: torch.Tensor, trip_id: str, to_stage: int
    ) -> bytes:
        self.check_version(version)
        return self.codec.encode_forward(output, tokens, trip_id, to_stage)

    def forward(
        self, hidden: torch.Tensor | None, tokens: torch.Tensor, version: int | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """Run the layers keeping the autograd graph; returns (input leaf, output, boundary residual)."""
        if version is not None:
            self.check_version(version)
        tokens = tokens.to(self.device)
        leaf = None
        if hidden is not None:
            leaf = hidden.to(self.device).requires_grad_(True)
        with torch.enable_grad():
            output, residual = self.stage.forward_with_residual(leaf, tokens)
        return leaf, output, residual

    def backward(
        self,
        leaf: torch.Tensor | None,
        output: torch.Tensor,
        grad: torch.Tensor | None,
        tokens: torch.Tensor,
        residual: torch.Tensor | None = None,
        version: int | None = None,
    ) -> tuple[torch.Tensor | None, float | None]:
        """Backward from the incoming gradient (or from the loss on the tail); returns (input gradient,
        loss). A trip calls it through `learn`, which steps in the same stage-thread job.

        If an optimizer epoch ended while this trip was in flight, the saved graph refers to
        weights that have since changed and autograd refuses it; the forward is then recomputed
        with the current weights (a rare, bounded cost: once per in-flight trip per epoch).
        """
        if version is not None:
            self.check_version(version)
        accumulator = self.stage.u_accumulator
        snapshot = accumulator.snapshot() if accumulator is not None else None  # for `_refuse_if_not_finite`

        def attempt(stale: bool) -> tuple[torch.Tensor | None, float | None]:
            nonlocal leaf, output, residual
            if stale:  # the stage's one rule (`PipelineStage.backward_or_recompute`): forward again, then back
                self.stage.zero_grad(set_to_none=True)
                leaf, output, residual = self.forward(leaf.detach() if leaf is not None else None, tokens)
            return self._backward_once(leaf, output, grad, tokens)

        result = self.stage.backward_or_recompute(attempt)
        self._refuse_if_not_finite(result, snapshot)
        self.stage.note_boundaries(
            tokens.to(self.device),
            leaf.detach() if leaf is not None else None,
            result[0],
            residual,
            grad.to(self.device) if grad is not None else None,
        )
        return result

    def learn(
        self,
        leaf: torch.Tensor | None,
        output: torch.Tensor,
        grad: torch.Tensor | None,
        tokens: torch.Tensor,
        residual: torch.Tensor | None,
        version: int,
    ) -> tuple[torch.Tensor | None, float | None]:
        """After a pipeline trip's reply (or on the tail, its forward): `backward` (checked and clipped), then the
        optimizer's step, in one stage-thread job so no other trip's gradients come in between. Returns (input
        gradient, loss); a refused trip raises before the step (`_refuse_if_not_finite`)."""
        result = self.backward(leaf, output, grad, tokens, residual, version)
        self.step(batch_size=tokens.shape[0])
        return result

    def learn_lane(
        self,
        lane: LaneTrip,
        tokens: torch.Tensor,
        residual: torch.Tensor | None,
        output_grad: torch.Tensor | None,
        version: int,
    ) -> torch.Tensor | None:
        """After a lane trip's last layer backward (`peer/lane_trip.py`): its input gradient, and its parameter
        gradients applied at once, checked and clipped like a trip's, then the optimizer's step for its chunk
        (`tokens`, B sequences of it), all in one stage-thread job. Its weight-hook terms of ∂/∂U were added
        layer by layer and are not taken back if it is refused."""
        self.check_version(version)
        input_grad = lane.input_grad()
        lane.apply_grads()
        self._refuse_if_not_finite((input_grad, None), None)
        tokens = tokens.to(self.device)
        hidden = lane.input.detach() if lane.input is not None else None
        grad = output_grad.to(self.device) if output_grad is not None else None
        self.stage.note_boundaries(tokens, hidden, input_grad, residual, grad)
        self.step(batch_size=tokens.shape[0])
        return input_grad

    def _backward_once(self, leaf, output, grad, tokens) -> tuple[torch.Tensor | None, float | None]:
        loss_value = None
        if self.stage.is_tail:
            loss = next_token_loss(output, tokens.to(self.device))
            loss.backward()
            loss_value = float(loss.item())
        else:
            output.backward(grad.to(self.device, output.dtype))
        input_grad = leaf.grad.detach() if leaf is not None else None
        return input_grad, loss_value

    def apply_basis(self, basis: torch.Tensor, version: int) -> None:
        """Switch U between two microbatches (this runs on the stage thread)."""
        with self.optimizer.state_averager.lock_optimizer:  # a joiner never downloads a half-switched state
            self.stage.apply_basis(basis.to(self.device), version, self.optimizer.opt)
        self._note_state()
        self.guard.keep()

    def _refuse_if_not_finite(self, result: tuple[torch.Tensor | None, float | None], snapshot) -> None:
        """Clip this microbatch's gradients, or refuse the trip if they (or its loss, or the gradient
        going back upstream) are not finite: nothing of it reaches hivemind's accumulators."""
        input_grad, loss = result
        norm = clip_grad_norm(self.stage.parameters(), self.manifest.optimizer.grad_clip)
        if loss is not None and not math.isfinite(loss):
            code, what = ErrorCode.NOT_FINITE, f"loss {loss}"
        elif not math.isfinite(norm):
            code, what = ErrorCode.NOT_FINITE, f"parameter gradients (norm {norm})"
        elif input_grad is not None and not max_token_norm(input_grad) <= MAX_GRADIENT_NORM:
            # the codec would refuse to send it; refuse before stepping rather than after
            code, what = ErrorCode.OUT_OF_RANGE, f"input gradient (token norm {max_token_norm(input_grad):.3g})"
        else:
            return
        self.stage.zero_grad(set_to_none=True)
        accumulator = self.stage.u_accumulator
        if snapshot is not None:  # the weight hooks may have added this microbatch's terms already
            accumulator.restore(snapshot)
        self.guard.report(f"trip refused ({code.value})")
        if not self.guard.is_finite():  # the stage itself, not the trip, is broken: repair it
            self._restore_finite_state("non-finite parameters replaced by the last finite state")
        raise WireError(code, f"{what} out of range or not finite; this trip was not trained on")

    def step(self, batch_size: int) -> None:
        """The optimizer step for one microbatch of `batch_size` sequences: hivemind accumulates it and, when the
        stage's peers together reach the target batch, starts averaging; the update lands at a later step, once
        the round is over (`StageOptimizer`)."""
        self.optimizer.step(batch_size=batch_size)
        self.optimizer.zero_grad(set_to_none=True)
        skipped = getattr(self.optimizer.opt, "skipped_steps", 0)
        if skipped != self._skipped_steps:
            self._skipped_steps = skipped
            self.guard.report("optimizer step skipped (non-finite averaged gradients)")
        if not self.guard.is_finite():  # averaging with peers, or a download, brought NaN or inf
            self._restore_finite_state("non-finite parameters replaced by the last finite state")
        if self.epoch != self._hashed_epoch and not self.optimizer.update_pending:
            # the epoch's update landed (a step or more after the epoch ended: StageOptimizer); the step left
            # constrained tensors in span(U) (SubspaceAdamW projects them); averaged parameters are re-projected
            # and hashed where they land (_averaged_state_landed)
            self._note_state()
            self.guard.keep()
            if self.checkpoint_dir and self.epoch and self.epoch % self.checkpoint_every == 0:
                self.save_checkpoint()

    def _averaged_state_landed(self) -> None:
        """Parameters averaged with the stage's peers just replaced ours (hivemind applies them between two
        microbatches, here under the optimizer lock): wash float drift out of span(U) and hash the state a joiner
        may download from now on. A round that found no peer copies back our own parameters: hashed again, same
        bits up to the re-projection."""
        self.stage.reproject_()
        self._note_state()

    def _state_served(self, epoch: int, parameters: list[torch.Tensor]) -> None:
        """A joiner was sent these copies of our parameters (hivemind's thread, off the stage thread): note their
        hash, computed as the joiner computes it, so its loaded_state can be checked against our record."""
        main = self.optimizer.state_averager.main_parameters
        self.served_states.append(copies_entry(self.stage, main, epoch, parameters))

    def _restore_finite_state(self, why: str) -> None:
        self.guard.restore(why)
        self._note_state()

    def _note_state(self) -> None:
        self._hashed_epoch = self.epoch
        self.state_sha256 = parameters_sha256(self.stage)
        self.state_hashes.append(state_entry(self.epoch, self.state_sha256))

    def load_from_peers(self) -> bool:
        """A joiner's download of the stage's state (the optimizer's catch-up downloads take the same checks)."""
        try:
            return self.optimizer.load_state_from_peers()
        except Exception as exc:  # noqa: BLE001 - a failed download must not kill the peer
            logger.warning("%s could not load state from peers: %s", self.label, exc)
            return False

    def next_download_in(self) -> float:
        """Seconds until the stage's state may be downloaded again (`peer/state_load.py` RETRY_S)."""
        return max(self.optimizer.state_averager.retry_at - time.monotonic(), 0.0)

    def _checked_download(self, download: Callable[[], None]) -> bool:
        """Every download (stage thread): refused if not finite; the state taken is noted as loaded, so our record
        is no witness of it (`swarm/live_state.py confirmations`), then re-projected and hashed as ours."""
        download()
        if not self.optimizer.state_averager.taken:  # hivemind returns quietly where the load returned no state
            logger.warning("%s took no state from the stage's peers", self.label)
            return False
        # hashed as received, before our own re-projection, so it compares with the donor's hashes
        received = (self.epoch, parameters_sha256(self.stage))
        if not self.guard.is_finite():
            self._restore_finite_state("state served by a peer was not finite; kept ours")
            return False
        self.loaded_state = state_entry(*received)
        self.stage.reproject_()
        self._note_state()
        self.guard.keep()
        return True

    # --- checkpoints ---------------------------------------------------------------------------

    @property
    def checkpoint_path(self) -> Path | None:
        return self.checkpoint_dir / f"stage{self.index}.pt" if self.checkpoint_dir else None

    def save_checkpoint(self) -> Path | None:
        path = self.checkpoint_path
        if path is None:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp, subspace = path.with_suffix(".tmp"), self.stage.subspace
        torch.save(
            {
                "run_id": self.manifest.run_id, "stage": self.index, "epoch": self.epoch,
                "model": self.stage.state_dict(), "optimizer": self.optimizer.state_dict(),
                # what the stage computed with: `protocol-swarm export` checks them, and a run whose U moved
                # can only be exported from checkpoints that say which U their constrained tensors are in
                "t_fixed_sha256": subspace.t_fixed_sha256,
                "u_version": subspace.version,
                "u": subspace.basis.detach().cpu().contiguous(),
                "u_sha256": subspace.basis_sha256,
            },
            tmp,
        )
        tmp.replace(path)
        logger.info("%s checkpoint saved: %s (epoch %d)", self.label, path, self.epoch)
        return path

    def load_checkpoint(self) -> bool:
        path = self.checkpoint_path
        if path is None or not path.exists():
            return False
        try:
            state = torch.load(path, map_location=self.device, weights_only=False)
            if state.get("run_id") != self.manifest.run_id or state.get("stage") != self.index:
                raise ValueError("checkpoint belongs to another run or stage")
            self.stage.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        except Exception as exc:  # noqa: BLE001 - a bad file must not stop a peer from starting fresh
            logger.warning("%s ignoring unreadable checkpoint %s: %s", self.label, path, exc)
            return False
        if not self.guard.is_finite():
            self._restore_finite_state(f"checkpoint {path} holds non-finite values; ignored")
            return False
        self.stage.reproject_()
        self._note_state()
        self.guard.keep()
        logger.info("%s resumed from checkpoint %s (epoch %d)", self.label, path, self.epoch)
        return True

    def shutdown(self) -> None:
        """Release the stage: hivemind's optimizer (its averager processes and tracker thread), the stage thread,
        the loop hivemind's tracker leaves behind with a task pending, and the freed heap. Blocking: call it off
        the event loop."""
        # the averager's hooks are bound to this runtime and something outside the runtime keeps the stopped
        # averager referenced: cleared here, or every stage a peer leaves stays in memory (test_stage_moves.py)
        averager = self.optimizer.state_averager
        averager.after_averaging = averager.after_serving = averager.choose = None
        self.optimizer.shutdown()
        self.executor.shutdown(wait=True, cancel_futures=True)
        close_abandoned_loops()
        release_freed_memory()
