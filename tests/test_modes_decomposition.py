"""The two halves of `boundary` (issue 18's gap decomposition), each a mode of its own:
`dense-ts` (only `T_S` in span(U), the full residual crosses) and `boundary-free-ts` (only the
boundary projection, `T_S` free, k coefficients cross)."""

from __future__ import annotations

import math

import pytest
import torch
from builders import tiny_manifest

from launcher.cli import build_parser
from launcher.manifest_args import manifest_from
from swarm.data import load_splits
from swarm.manifest import OptimizerSpec
from swarm.model import build_stages
from swarm.modes import MODES
from swarm.optim import make_optimizer, parameter_groups
from swarm.simulate import boundary_exactness, run_trip, simulate
from swarm.subspace_update import subspace_driver

D, K, SEQ = 64, 4, 32
HALVES = ("dense-ts", "boundary-free-ts")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("".join(f"{i:05d} a stage sends {i % 89} numbers per token\n" for i in range(3000)))
    return str(path)


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(5))


def _off_span(tensor: torch.Tensor, stage) -> float:
    """‖T − T P‖ / ‖T‖ for a tensor whose rows have length d."""
    return ((tensor - stage.subspace.project(tensor, axis=1)).norm() / tensor.norm()).item()


def test_what_each_half_answers():
    dense_ts, free_ts = MODES["dense-ts"], MODES["boundary-free-ts"]
    assert not dense_ts.compressed and not dense_ts.moves_u  # the full residual crosses: no U to move
    assert free_ts.compressed and free_ts.moves_u and subspace_driver("gradient").boundary_terms(free_ts)
    assert tiny_manifest("dense-ts", subspace_update_interval=5).updates_u is False
    assert tiny_manifest("boundary-free-ts", subspace_update_interval=5).updates_u is True
    stages = {name: build_stages(tiny_manifest(name, n_layers=3, stages=3)) for name in HALVES}
    assert [s.projects_boundary for s in stages["dense-ts"]] == [False, False, False]
    assert [s.projects_boundary for s in stages["boundary-free-ts"]] == [True, True, False]
    assert [[c.name for c in s.constrained] for s in stages["dense-ts"]] == [["t_s"], [], []]
    assert [[c.name for c in s.constrained] for s in stages["boundary-free-ts"]] == [[], [], []]
    # T_S of dense-ts gets the per-row second moment, exactly as in boundary; free T_S plain AdamW
    def axis_of_t_s(name: str) -> list[int | None]:
        head = stages[name][0]
        return [g["subspace_axis"] for g in parameter_groups(head) if any(p is head.t_s for p in g["params"])]

    assert axis_of_t_s("dense-ts") == [1] and axis_of_t_s("boundary-free-ts") == [None]


@pytest.mark.parametrize("name", ["dense-ts", "boundary-free-ts"])
def test_the_manifest_takes_every_wire_dtype(name):
    for dtype in ("fp32", "bf16", "fp16", "int8"):
        assert tiny_manifest(name, wire_dtype=dtype).wire_dtype == dtype


@pytest.mark.parametrize("name", HALVES)
def test_the_command_line_names_each_half(name):
    args = build_parser().parse_args(["simulate", "--compression", name, "--steps", "1"])
    assert manifest_from(args).compression == name


@pytest.mark.parametrize("name", HALVES)
def test_each_half_trains_in_the_simulator(name, corpus):
    reference = {mode: simulate(tiny_manifest(mode, microbatch=4), 1, data=corpus, val_batches=1)
                 for mode in ("none", "boundary")}
    result = simulate(tiny_manifest(name, microbatch=4), 25, data=corpus, val_batches=2)
    assert all(math.isfinite(x) for x in result.train_loss)
    assert result.val_loss_last < result.val_loss_first - 0.5
    assert result.max_reconstruction_error < 1e-5  # fp32 wire
    assert result.max_subspace_residual < 1e-6  # dense-ts: T_S; boundary-free-ts: nothing constrained
    # the bytes of what crosses: the residual like `none`, or k coefficients like `boundary`
    like = reference["none" if name == "dense-ts" else "boundary"]
    assert result.wire_bytes_per_token == pytest.approx(like.wire_bytes_per_token, rel=0.02)
    if name == "boundary-free-ts":
        assert 2 * K * 4 + 1 <= result.wire_bytes_per_token < 2 * K * 4 + 1 + 10


def _train(name: str, corpus: str, steps: int = 6):
    """Stages after `steps` optimizer steps through the wire (weights far enough from init to matter)."""
    manifest = tiny_manifest(name, microbatch=4, optimizer=OptimizerSpec(lr=1e-2, warmup_steps=0))
    torch.manual_seed(0)
    stages = build_stages(manifest)
    optimizers = [make_optimizer(stage) for stage in stages]
    train, _ = load_splits(manifest, corpus, seed=0)
    for _ in range(steps):
        run_trip(stages, train.batch(4))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return stages


def test_dense_ts_keeps_t_s_in_span_and_sends_what_leaves_it(corpus, tokens):
    stages = _train("dense-ts", corpus)
    assert _off_span(stages[0].t_s.detach(), stages[0]) < 1e-6
    # no projection: the layers' output leaves T_fixed[tok] + span(U), so k coefficients could not carry it
    assert boundary_exactness(stages, tokens) > 0.5
    assert run_trip(stages, tokens, backward=False).max_reconstruction_error < 1e-6  # the residual itself crosses


def test_boundary_free_ts_reconstructs_exactly_with_t_s_free(corpus, tokens):
    stages = _train("boundary-free-ts", corpus)
    assert _off_span(stages[0].t_s.detach(), stages[0]) > 0.9  # T_S is nowhere near span(U) (k/d = 1/16)
    assert boundary_exactness(stages, tokens) < 1e-5  # the projection alone puts the boundary in span
    stats = run_trip(stages, tokens, backward=False)
    assert stats.max_reconstruction_error < 1e-5 and stats.forward_bytes < 2 * SEQ * (K * 4 + 1) + 400


def test_boundary_free_ts_upstream_gradients_are_exact_through_k_coefficients(corpus, tokens):
    stages = _train("boundary-free-ts", corpus)
    grads = []
    for use_wire in (True, False):
        for stage in stages:
            stage.zero_grad(set_to_none=True)
        run_trip(stages, tokens, use_wire=use_wire)
        grads.append({f"{i}.{n}": p.grad.clone() for i, s in enumerate(stages) for n, p in s.named_parameters()})
    wired, direct = grads
    assert wired.keys() == direct.keys() and "0.t_s" in wired
    for key, grad in direct.items():
        assert ((wired[key] - grad).norm() / grad.norm().clamp_min(1e-30)).item() < 1e-4, key
