"""All stages in one process, every boundary through the real wire codec.

This is the proof of the method before any networking: the same `PipelineStage`, `BoundaryCodec`
and optimizer that peers use, chained in a loop. `run_trip` is also how tests compare the
pipeline with and without the wire in between. With context parallelism on, every stage's
attention runs its P chunks in one graph, and `swarm.cp_traffic` encodes the K/V messages between
chunks that a swarm would send, to count their bytes.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from swarm.codec import BoundaryCodec
from swarm.cp_model import start_collecting, warm_start
from swarm.cp_modes import DENSE_KV
from swarm.cp_traffic import CPTraffic, CPTripTraffic
from swarm.cp_wire import CPCodec
from swarm.data import load_splits
from swarm.manifest import Manifest
from swarm.model import PipelineStage, build_stages, next_token_loss
from swarm.optim import clip_grad_norm, lr_at, make_optimizer
from swarm.subspace import compress, decompress, relative_error
from swarm.subspace_update import basis_from_contributions, matrix_to_bytes


@dataclass
class TripStats:
    loss: float
    forward_bytes: int = 0  # summed over boundaries
    backward_bytes: int = 0
    max_reconstruction_error: float = 0.0
    boundaries: int = 0
    cp: CPTripTraffic | None = None  # K/V messages between context-parallel chunks, every layer


def cp_traffic(stages: list[PipelineStage], tokens: torch.Tensor) -> CPTraffic | None:
    """The K/V message counter of a trip of `tokens` through `stages` (None without context parallelism)."""
    manifest = stages[0].manifest
    spec = manifest.context_parallel
    if spec is None:
        return None
    codecs = {}
    for stage in stages:
        layers = manifest.layers_of(stage.index)
        codec = CPCodec(
            spec, manifest.model, tokens.shape[1], tokens.shape[0], manifest.run_id, stage.cp_basis, stage.index, layers
        )
        codecs.update(dict.fromkeys(layers, codec))
    return CPTraffic(codecs, [block.attn for stage in stages for block in stage.layers])


def run_trip(
    stages: list[PipelineStage],
    tokens: torch.Tensor,
    use_wire: bool = True,
    loss_scale: float = 1.0,
    backward: bool = True,
) -> TripStats:
    """One microbatch forward through every stage and (optionally) backward, like a swarm trip."""
    codecs = [BoundaryCodec(stage.manifest, stage.subspace) for stage in stages]
    inputs: list[torch.Tensor | None] = []
    outputs: list[torch.Tensor] = []
    residuals: list[torch.Tensor | None] = []
    stats = TripStats(loss=0.0)
    hidden = None
    trip_id = uuid.uuid4().hex
    grad_mode = torch.enable_grad() if backward else torch.no_grad()
    traffic = cp_traffic(stages, tokens) if use_wire and backward else None
    with grad_mode, traffic if traffic is not None else nullcontext():
        for i, stage in enumerate(stages):
            if i > 0 and use_wire:
                blob = codecs[i - 1].encode_forward(hidden, tokens, trip_id, to_stage=i)
                stats.forward_bytes += len(blob)
                _, received, _ = codecs[i].decode_forward(blob, stage=i)
                stats.max_reconstruction_error = max(stats.max_reconstruction_error, relative_error(received, hidden))
                stats.boundaries += 1
                hidden = received.requires_grad_(backward)
            inputs.append(hidden)
            hidden, residual = stage.forward_with_residual(hidden, tokens)
            outputs.append(hidden)
            residuals.append(residual)
        loss = next_token_loss(hidden, tokens)
    stats.loss = loss.item()
    if not backward:
        return stats
    (loss * loss_scale).backward()
    if not use_wire:
        return stats
    output_grads: list[torch.Tensor | None] = [None] * len(stages)
    for i in range(len(stages) - 1, 0, -1):
        blob = codecs[i].encode_backward(inputs[i].grad, trip_id, to_stage=i - 1, loss=stats.loss)
        stats.backward_bytes += len(blob)
        _, grad = codecs[i - 1].decode_backward(blob, stage=i - 1)
        outputs[i - 1].backward(grad)
        output_grads[i - 1] = grad
    if traffic is not None:
        stats.cp = traffic.flush()
    for i, stage in enumerate(stages):
        stage.note_boundaries(
            tokens, inputs[i], inputs[i].grad if inputs[i] is not None else None, residuals[i], output_grads[i]
        )
    return stats


def boundary_exactness(stages: list[PipelineStage], tokens: torch.Tensor) -> float:
    """Max relative error of an fp32 compress/decompress round trip over every boundary (no wire dtype):
    how exactly the boundary activations lie in T_fixed + span(U)."""
    worst, hidden = 0.0, None
    with torch.no_grad():
        for stage in stages[:-1]:
            hidden = stage(hidden, tokens)
            state = stage.subspace
            rebuilt = decompress(
                compress(hidden, tokens, state.basis, state.t_fixed), tokens, state.basis, state.t_fixed
            )
            worst = max(worst, relative_error(rebuilt, hidden))
    return worst


def update_subspace(stages: list[PipelineStage], optimizers: list) -> np.ndarray:
    """The swarm's update, in one process: each stage's contribution crosses as float32 bytes, every stage
    derives U' from the same bytes and switches."""
    manifest = stages[0].manifest
    contributions = {
        i: [matrix_to_bytes(stage.u_accumulator.mean())]
        for i, stage in enumerate(stages)
        if stage.u_accumulator is not None and stage.u_accumulator.terms
    }
    current = stages[0].subspace.basis.double().cpu().numpy()
    basis = basis_from_contributions(current, contributions, manifest.u_driver, manifest.subspace_step)
    new_basis = torch.from_numpy(basis.astype(np.float32))
    version = stages[0].subspace.version + 1
    for stage, optimizer in zip(stages, optimizers, strict=True):
        stage.apply_basis(new_basis, version, optimizer)
    return basis


class _CPWarmUp:
    """The manifest's `context_parallel.warm_start_steps`: K/V cross dense for that many optimizer steps
    while every layer sums Kᵀ K and Vᵀ V; then Ū := their principal components in every stage's basis
    copy (version 1, one hash) and compression starts. Nothing to do without compressed CP."""

    def __init__(self, stages: list[PipelineStage]):
        spec = stages[0].manifest.context_parallel
        self.steps = spec.warm_start_steps if spec is not None and spec.compressed else 0
        self.stages = stages
        self.attentions = [block.attn for stage in stages for block in stage.layers] if self.steps else []
        for attn in self.attentions:
            attn.mode = DENSE_KV

    def start(self) -> None:
        start_collecting(self.attentions)

    def due(self, step: int) -> bool:
        return self.steps > 0 and step + 1 == self.steps

    def switch(self) -> dict:
        info = warm_start(self.attentions, [stage.cp_basis for stage in self.stages])
        return {"step": self.steps, **info}


@dataclass
class SimulationResult:
    run_id: str
    compression: str
    steps: int
    tokens: int
    train_loss: list[float] = field(default_factory=list)
    val_loss_first: float = 0.0
    val_loss_last: float = 0.0
    wire_bytes_per_token: float = 0.0
    wire_bytes_per_token_forward: float = 0.0
    wire_bytes_per_token_backward: float = 0.0
    dense_wire_bytes_per_token: float = 0.0
    max_reconstruction_error: float = 0.0
    max_subspace_residual: float = 0.0
    seconds: float = 0.0
    step_seconds: float = 0.0
    optimizer_seconds: float = 0.0
    u_version: int = 0
    subspace_updates: list[dict] = field(default_factory=list)
    update_seconds: float = 0.0
    # context parallelism only: bytes per token per layer of the K/V messages, counted from the encoded messages
    cp_bytes_per_token: dict[str, float] | None = None  # {"forward": …, "backward": …}
    cp_dense_bytes_per_token: dict[str, float] | None = None  # the same crossings with dense K/V messages
    cp_formula_bytes_per_token: float | None = None  # payload formula, one direction, without headers
    cp_reconstruction_error: float | None = None  # max, K/V rebuilt from the decoded bytes vs the sender's
    cp_kv_residual: float | None = None  # mean ‖rebuilt − full-rank K/V‖ / ‖full‖: what the K/V subspace leaves out
    cp_warm_start: dict | None = None  # the PCA basis switch (step, version, hash, energy kept), if one happened
    val_curve: list[tuple[int, float]] = field(default_factory=list)  # (steps done, val loss) every `val_every` steps


def evaluate(stages: list[PipelineStage], batches: list[torch.Tensor]) -> float:
    for stage in stages:
        stage.eval()
    losses = [run_trip(stages, batch, backward=False).loss for batch in batches]
    for stage in stages:
        stage.train()
    return sum(losses) / len(losses)


def simulate(
    manifest: Manifest,
    steps: int,
    data: str | None = None,
    seed: int = 0,
    val_batches: int = 8,
    on_step: Callable[[int, float], None] | None = None,
    device: str | torch.device = "cpu",
    val_every: int = 0,
) -> SimulationResult:
    """Train `steps` optimizer steps on `device` (the batches move there; the data and the seeded init stay
    CPU-side, so a seed gives the same run on every device up to float rounding), validating every
    `val_every` steps too when it is set (`result.val_curve`)."""
    torch.manual_seed(seed)
    stages = [stage.to(device) for stage in build_stages(manifest)]
    optimizers = [make_optimizer(stage) for stage in stages]
    train, held_out = load_splits(manifest, data, seed=seed)
    batch = manifest.batch
    micro_per_step = max(1, batch.target_batch_size // batch.microbatch_size)
    validation = [tokens.to(device) for tokens in held_out.fixed_batches(batch.microbatch_size, val_batches)]
    result = SimulationResult(run_id=manifest.run_id, compression=manifest.compression, steps=steps, tokens=0)
    warm_up = _CPWarmUp(stages)
    result.val_loss_first = evaluate(stages, validation)
    warm_up.start()
    forward_bytes = backward_bytes = boundary_tokens = 0
    cp_totals = CPTripTraffic()
    started = time.perf_counter()
    optimizer_time = 0.0
    for step in range(steps):
        losses = []
        for _ in range(micro_per_step):
            tokens = train.batch(batch.microbatch_size).to(device)
            stats = run_trip(stages, tokens, loss_scale=1.0 / micro_per_step)
            losses.append(stats.loss)
            result.tokens += tokens.numel()
            result.max_reconstruction_error = max(result.max_reconstruction_error, stats.max_reconstruction_error)
            if stats.boundaries:
                forward_bytes += stats.forward_bytes / stats.boundaries
                backward_bytes += stats.backward_bytes / stats.boundaries
                boundary_tokens += tokens.numel()
            if stats.cp is not None:
                _add_cp(cp_totals, stats.cp)
        tick = time.perf_counter()
        for stage, optimizer in zip(stages, optimizers, strict=True):
            clip_grad_norm(stage.parameters(), manifest.optimizer.grad_clip)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, manifest.optimizer.lr, manifest.optimizer.warmup_steps)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        optimizer_time += time.perf_counter() - tick
        interval = manifest.subspace_update_interval
        if manifest.updates_u and (step + 1) % interval == 0:
            tick = time.perf_counter()
            update_subspace(stages, optimizers)
            result.update_seconds += time.perf_counter() - tick
            result.subspace_updates.append(
                {
                    "step": step + 1,
                    "u_version": stages[0].subspace.version,
                    "u_sha256": stages[0].subspace.basis_sha256,
                    "same_u_on_every_stage": len({s.subspace.basis_sha256 for s in stages}) == 1,
                    "reconstruction_error_fp32": boundary_exactness(stages, validation[0]),
                    "max_subspace_residual": max(s.subspace_residual() for s in stages),
                }
            )
        if warm_up.due(step):
            result.cp_warm_start = warm_up.switch()
        result.train_loss.append(sum(losses) / len(losses))
        if val_every and (step + 1) % val_every == 0:
            result.val_curve.append((step + 1, evaluate(stages, validation)))
        if on_step:
            on_step(step, result.train_loss[-1])
    elapsed = time.perf_counter() - started
    result.val_loss_last = evaluate(stages, validation)
    result.max_subspace_residual = max(stage.subspace_residual() for stage in stages)
    result.u_version = stages[0].subspace.version
    if boundary_tokens:
        result.wire_bytes_per_token_forward = forward_bytes / boundary_tokens
        result.wire_bytes_per_token_backward = backward_bytes / boundary_tokens
        result.wire_bytes_per_token = result.wire_bytes_per_token_forward + result.wire_bytes_per_token_backward
    result.dense_wire_bytes_per_token = 2 * manifest.dense_bytes_per_token()
    if manifest.context_parallel is not None:
        _report_cp(result, manifest, cp_totals)
    result.seconds = elapsed
    result.step_seconds = elapsed / max(steps, 1)
    result.optimizer_seconds = optimizer_time / max(steps, 1)
    return result


def _add_cp(total: CPTripTraffic, trip: CPTripTraffic) -> None:
    total.forward_bytes += trip.forward_bytes
    total.backward_bytes += trip.backward_bytes
    total.dense_forward_bytes += trip.dense_forward_bytes
    total.dense_backward_bytes += trip.dense_backward_bytes
    total.max_reconstruction_error = max(total.max_reconstruction_error, trip.max_reconstruction_error)
    total.kv_residuals += trip.kv_residuals


def _report_cp(result: SimulationResult, manifest: Manifest, total: CPTripTraffic) -> None:
    """Per token of training and per layer; zero bytes where nothing crossed (P = 1)."""
    spec, shape = manifest.context_parallel, manifest.model
    per = max(result.tokens * shape.n_layers, 1)
    result.cp_bytes_per_token = {"forward": total.forward_bytes / per, "backward": total.backward_bytes / per}
    result.cp_dense_bytes_per_token = {
        "forward": total.dense_forward_bytes / per,
        "backward": total.dense_backward_bytes / per,
    }
    formula = spec.payload_bytes_per_token(shape, manifest.batch.seq_len)
    result.cp_formula_bytes_per_token = formula["compressed" if spec.compressed else "dense"]
    result.cp_reconstruction_error = total.max_reconstruction_error
    residuals = total.kv_residuals
    result.cp_kv_residual = sum(residuals) / len(residuals) if residuals else 0.0
