"""The pipeline with the wire in between computes exactly what it computes without it; the simulator
and the `protocol-swarm` command report what the issue promises."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess

import pytest
import torch
from builders import tiny_manifest

from launcher.cli import build_parser, main
from launcher.manifest_args import manifest_from
from swarm.manifest import save_manifest
from swarm.model import PipelineStage, build_stages
from swarm.presets import preset
from swarm.simulate import run_trip, simulate

D, K, V, SEQ = 64, 4, 256, 32
RESULT_KEYS = {"run_id", "compression", "steps", "tokens", "train_loss", "val_loss_first", "val_loss_last",
               "wire_bytes_per_token", "dense_wire_bytes_per_token", "max_reconstruction_error", "seconds"}
# one thread: tiny tensors on two shared cores are many times faster without oversubscription
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def small(compression: str = "subspace", n_layers: int = 3, stages: int = 3, wire_dtype: str = "fp32",
          microbatch: int = 2, target: int = 2):
    return tiny_manifest(compression, n_layers, stages, wire_dtype, microbatch, target)


def _stirred_stages(manifest, keep_constraints: bool = True) -> list[PipelineStage]:
    """Stages with weights far from init (same bytes every call); constraints restored unless told not to."""
    stages = build_stages(manifest)
    generator = torch.Generator().manual_seed(42)
    with torch.no_grad():
        for stage in stages:
            for param in stage.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
            if keep_constraints:
                stage.reproject_()
    return stages


def _grads(stages) -> dict[str, torch.Tensor]:
    return {f"{i}.{name}": p.grad.clone()
            for i, stage in enumerate(stages) for name, p in stage.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, V, (2, SEQ), generator=torch.Generator().manual_seed(3))


# --- wire or no wire: the same loss and the same gradients ------------------------------------------

@pytest.mark.parametrize("compression", ["subspace", "boundary", "none"])
def test_wire_gives_same_loss_and_gradients(compression, tokens):
    manifest = small(compression)
    wired, direct = _stirred_stages(manifest), _stirred_stages(manifest)
    for a, b in zip(wired, direct, strict=True):  # identical starting points
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
            assert torch.equal(pa, pb)
    stats = run_trip(wired, tokens, use_wire=True)
    plain = run_trip(direct, tokens, use_wire=False)
    assert stats.boundaries == 2 and plain.boundaries == 0
    assert stats.forward_bytes > 0 and stats.backward_bytes > 0
    assert stats.max_reconstruction_error < 1e-5
    assert abs(stats.loss - plain.loss) <= 1e-4 * abs(plain.loss)
    wired_grads, direct_grads = _grads(wired), _grads(direct)
    assert wired_grads.keys() == direct_grads.keys()
    worst = max(_rel(wired_grads[name], direct_grads[name]) for name in direct_grads)
    assert worst < 1e-4
    # every stage got a gradient, including the head's embedding
    assert wired_grads["0.t_s"].norm() > 0 and wired_grads["0.layers.0.attn.wq.weight"].norm() > 0


def test_wire_changes_gradients_when_constraints_are_broken(tokens):
    """The comparison above can fail: with W_o/W_down outside span(U) the wire drops information."""
    manifest = small("subspace")
    wired = _stirred_stages(manifest, keep_constraints=False)
    direct = _stirred_stages(manifest, keep_constraints=False)
    stats = run_trip(wired, tokens, use_wire=True)
    run_trip(direct, tokens, use_wire=False)
    assert stats.max_reconstruction_error > 1e-2
    wired_grads, direct_grads = _grads(wired), _grads(direct)
    assert max(_rel(wired_grads[name], direct_grads[name]) for name in direct_grads) > 1e-2


def test_loss_scale_and_forward_only(tokens):
    stages = _stirred_stages(small())
    evaluation = run_trip(stages, tokens, backward=False)
    assert evaluation.backward_bytes == 0
    assert all(p.grad is None for stage in stages for p in stage.parameters())
    run_trip(stages, tokens, loss_scale=0.5)
    half = _grads(stages)
    for stage in stages:
        stage.zero_grad(set_to_none=True)
    full = run_trip(stages, tokens)
    assert full.loss == pytest.approx(evaluation.loss, rel=1e-6)
    assert max(_rel(2 * half[name], grad) for name, grad in _grads(stages).items()) < 1e-5


# --- the simulator ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    lines = (f"{i:05d} the pipeline passes {i % 97} coefficients per token\n" for i in range(3000))
    path.write_text("".join(lines))
    return str(path)


@pytest.mark.parametrize("compression", ["subspace", "boundary", "none"])
def test_simulate_in_process(compression, corpus):
    manifest = small(compression, n_layers=2, stages=2, microbatch=4, target=8)
    steps = []
    result = simulate(manifest, 4, data=corpus, val_batches=2,
                      on_step=lambda step, loss: steps.append((step, loss)))
    assert [s for s, _ in steps] == [0, 1, 2, 3]
    assert result.steps == 4 and len(result.train_loss) == 4
    assert result.tokens == 4 * 8 * SEQ
    assert all(math.isfinite(x) for x in result.train_loss)
    assert math.isfinite(result.val_loss_first) and math.isfinite(result.val_loss_last)
    assert result.val_loss_first == pytest.approx(math.log(V), abs=0.3)
    assert result.max_reconstruction_error < 1e-5  # fp32 wire
    assert result.max_subspace_residual < 1e-6
    dense = 2 * D * 4
    assert result.dense_wire_bytes_per_token == dense
    per_dir = result.wire_bytes_per_token_forward, result.wire_bytes_per_token_backward
    assert result.wire_bytes_per_token == pytest.approx(sum(per_dir))
    if compression == "none":
        assert abs(result.wire_bytes_per_token / dense - 1) < 0.05  # only headers and token ids on top
    else:
        # k fp32 coefficients each way plus one byte of token id, plus the header's share
        assert 2 * K * 4 + 1 <= result.wire_bytes_per_token < 2 * K * 4 + 1 + 10
        assert result.wire_bytes_per_token < 0.1 * dense


def test_simulate_learns(corpus):
    manifest = small("subspace", n_layers=2, stages=2, microbatch=4, target=4)
    result = simulate(manifest, 30, data=corpus, val_batches=2)
    assert result.val_loss_last < result.val_loss_first - 1.0


# --- the command line -------------------------------------------------------------------------------

def test_cli_simulate_tiny_json():
    """The installed console script, in its own process, as a user runs it."""
    script = shutil.which("protocol-swarm")
    assert script, "protocol-swarm is not installed (pip install -e .)"
    out = subprocess.run([script, "simulate", "--preset", "tiny", "--steps", "3", "--json"], capture_output=True,
                         text=True, timeout=400, env=ENV)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert RESULT_KEYS <= result.keys()
    tiny = preset("tiny")
    assert result["run_id"] == tiny.run_id and result["compression"] == tiny.compression == "boundary"
    assert result["steps"] == 3 and len(result["train_loss"]) == 3
    assert result["tokens"] == 3 * tiny.batch.target_batch_size * tiny.batch.seq_len
    assert result["dense_wire_bytes_per_token"] == 2 * 256 * 2
    assert 0 < result["wire_bytes_per_token"] < 0.02 * result["dense_wire_bytes_per_token"]
    assert 0 <= result["max_reconstruction_error"] < 0.02  # bf16 wire
    assert math.isfinite(result["val_loss_first"]) and math.isfinite(result["val_loss_last"])
    assert result["seconds"] > 0
    assert "Traceback" not in out.stderr


def test_cli_simulate_dense_from_manifest_file(tmp_path, corpus, capsys):
    path = tmp_path / "dense.json"
    save_manifest(small("none", n_layers=2, stages=2, wire_dtype="bf16", microbatch=4, target=4), path)
    assert main(["simulate", "--manifest", str(path), "--steps", "2", "--data", corpus, "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert RESULT_KEYS <= result.keys()
    assert result["compression"] == "none" and result["dense_wire_bytes_per_token"] == 2 * D * 2
    assert abs(result["wire_bytes_per_token"] / result["dense_wire_bytes_per_token"] - 1) < 0.1


def test_cli_simulate_summary_without_json(tmp_path, corpus, capsys):
    path = tmp_path / "m.json"
    save_manifest(small("boundary", n_layers=2, stages=2, microbatch=2, target=2), path)
    assert main(["simulate", "--manifest", str(path), "--steps", "2", "--data", corpus]) == 0
    printed = capsys.readouterr().out
    assert "val loss" in printed and "B/token" in printed and "reconstruction error" in printed


def test_cli_inspect_tiny(capsys):
    assert main(["inspect", "--preset", "tiny"]) == 0
    printed = capsys.readouterr().out
    tiny = preset("tiny")
    for value in (tiny.run_id, tiny.t_fixed_sha256, tiny.u_sha256):
        assert value in printed
    assert "d/k               256/4 = 64.0" in printed and "% of dense" in printed


def test_cli_inspect_overrides_and_write(tmp_path, capsys):
    path = tmp_path / "written.json"
    argv = ["inspect", "--preset", "tiny", "--seed", "5", "--compression", "none", "--write", str(path)]
    assert main(argv) == 0
    expected = preset("tiny", seed=5, compression="none")
    assert expected.run_id in capsys.readouterr().out
    assert json.loads(path.read_text()) == expected.model_dump(mode="json")


@pytest.mark.parametrize("command", ["inspect", "simulate", "local"])
def test_context_parallel_alone_sends_compressed_kv(command):
    """`--context-parallel P` alone ships compressed K/V, as the -long and -cp presets do, in every command that
    takes it (`local` sent dense K/V, 521 B/token/layer against 25.5); `--cp-compression none` is the dense
    baseline, and without the flag there is no context parallelism."""
    parser = build_parser()

    def spec(*flags: str):
        return manifest_from(parser.parse_args([command, *flags])).context_parallel

    compressed = spec("--context-parallel", "2")
    assert (compressed.size, compressed.compression, compressed.variant, compressed.compressed) == (
        2, "subspace", "remote", True)
    dense = spec("--context-parallel", "2", "--cp-compression", "none")
    assert (dense.size, dense.compression, dense.compressed) == (2, "none", False)
    tiny = preset("tiny")
    sent = compressed.payload_bytes_per_token(tiny.model, tiny.batch.seq_len)
    assert sent["compressed"] < 0.1 * dense.payload_bytes_per_token(tiny.model, tiny.batch.seq_len)["dense"]
    assert spec() is None
    assert spec("--preset", "tiny-long", "--context-parallel", "2").compression == "subspace"


def test_cli_bad_manifest_file_exits_2(tmp_path, capsys):
    bad = preset("tiny").model_dump(mode="json")
    bad["k"] = 0
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    assert main(["simulate", "--manifest", str(path), "--steps", "1", "--json"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err
    assert lines[0].startswith("protocol-swarm:") and "k" in lines[0] and "at least 1" in lines[0]
    assert captured.out == ""


@pytest.mark.parametrize("argv,fragment", [
    (["inspect", "--manifest", "/nonexistent/manifest.json"], "not found"),
    (["inspect", "--k", "0"], "at least 1"),
    (["inspect", "--k", "256"], "smaller than model.d_model"),
    (["inspect", "--stages", "9"], "stages must be between"),
    (["simulate", "--steps", "1", "--data", "/nonexistent/corpus"], "neither"),
])
def test_cli_errors_are_one_line(argv, fragment, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], captured.err


def test_cli_bad_json_manifest(tmp_path, capsys):
    path = tmp_path / "broken.json"
    path.write_text("{ not json")
    assert main(["inspect", "--manifest", str(path)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
