"""Context parallelism in the pipeline (issue 16): the manifest field turns every stage's attention into
P chunks; off, or at P = 1, the model is the one it was; the simulator trains through it and counts the
K/V messages it would send."""

from __future__ import annotations

import json
import math

import pytest
import torch
from builders import tiny_manifest

from launcher.cli import main
from swarm.context_parallel import ContextParallelSpec
from swarm.cp_attention import CPAttention
from swarm.cp_model import CPDecoder
from swarm.cp_traffic import CPTraffic
from swarm.cp_wire import CPCodec, wire_step
from swarm.manifest import save_manifest
from swarm.model import Attention, build_stages, next_token_loss
from swarm.simulate import run_trip, simulate

V, SEQ = 256, 32


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, V, (2, SEQ), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("".join(f"{i:05d} the chunks pass {i % 89} keys and values along\n" for i in range(3000)))
    return str(path)


def _trip(manifest, tokens) -> tuple[float, dict[str, torch.Tensor], list]:
    stages = build_stages(manifest)
    stats = run_trip(stages, tokens)
    grads = {f"{i}.{n}": p.grad for i, s in enumerate(stages) for n, p in s.named_parameters() if p.grad is not None}
    return stats.loss, grads, stages


def _cp(mode: str = "boundary", **spec) -> object:
    return tiny_manifest(mode, context_parallel=spec)


@pytest.mark.parametrize("mode", ["boundary", "subspace"])
@pytest.mark.parametrize("compression", ["none", "subspace"])
def test_one_chunk_is_exactly_the_model_without_context_parallelism(tokens, mode, compression):
    """P = 1 (remote variant: nothing crosses) gives bit-identical loss and gradients: same weights
    from the same seed, the same causal SDPA."""
    loss, grads, _ = _trip(tiny_manifest(mode), tokens)
    cp_loss, cp_grads, stages = _trip(_cp(mode, size=1, compression=compression), tokens)
    assert all(isinstance(block.attn, CPAttention) for stage in stages for block in stage.layers)
    assert cp_loss == loss
    assert cp_grads.keys() == grads.keys()  # the θ heads get no gradient: nothing crosses
    assert all(torch.equal(cp_grads[name], grads[name]) for name in grads)


def test_off_is_the_plain_attention_and_the_plain_manifest(tokens):
    manifest = tiny_manifest("boundary")
    assert manifest.context_parallel is None and "context_parallel" not in manifest.canonical_json()
    assert all(type(block.attn) is Attention for stage in build_stages(manifest) for block in stage.layers)


def test_dense_chunks_with_an_fp32_wire_equal_full_attention(tokens):
    """P = 4, K/V crossing whole in float32: the same function as one causal attention, up to the
    order of float32 sums (LSE merging across chunks)."""
    loss, grads, _ = _trip(tiny_manifest("boundary"), tokens)
    cp_loss, cp_grads, _ = _trip(_cp(size=4, wire_dtype="fp32"), tokens)
    assert abs(cp_loss - loss) < 1e-5
    for name, grad in grads.items():
        assert float((cp_grads[name] - grad).abs().max() / grad.abs().max()) < 1e-4, name


def test_compressed_chunks_change_the_function_and_train_the_theta_heads(tokens):
    loss, _, _ = _trip(tiny_manifest("boundary"), tokens)
    cp_loss, cp_grads, _ = _trip(_cp(size=4, compression="subspace", variant="paper"), tokens)
    assert cp_loss != loss
    assert any("theta_head" in name and float(g.abs().max()) > 0 for name, g in cp_grads.items())


@pytest.mark.parametrize("compression", ["none", "subspace"])
def test_simulator_trains_with_four_chunks(corpus, compression):
    manifest = tiny_manifest("boundary", microbatch=4, context_parallel={"size": 4, "compression": compression})
    result = simulate(manifest, 16, data=corpus, val_batches=2)
    assert result.val_loss_last < result.val_loss_first - 1.0
    sent, dense = result.cp_bytes_per_token, result.cp_dense_bytes_per_token
    # every message of every layer was encoded; backward messages are as large as forward ones
    assert sent["backward"] == pytest.approx(sent["forward"], rel=0.01)
    formula = result.cp_formula_bytes_per_token
    spec = manifest.context_parallel
    assert formula == spec.payload_bytes_per_token(manifest.model, SEQ)["compressed" if spec.compressed else "dense"]
    # 8-token chunks at batch 4: a ~300-byte header per message is a large share here (< 5% at 1024 tokens,
    # tests/test_context_parallel.py)
    assert formula <= sent["forward"] <= 1.5 * formula
    assert result.cp_reconstruction_error < 0.01  # bf16 rounding of Z
    if compression == "none":
        assert sent == dense and result.cp_kv_residual < 0.01
    else:
        assert sent["forward"] < 0.3 * dense["forward"]  # ranks 4 + 8 of d_kv = 32, headers included
        assert 0.1 < result.cp_kv_residual < 1.0  # the subspace leaves out part of the full-rank K/V


def test_cli_simulate_reports_context_parallel_bytes(tmp_path, corpus, capsys):
    """`--context-parallel` and `--cp-compression` reach the manifest (seen by `inspect`); a manifest
    file with the field trains, and `--json` carries the CP numbers."""
    assert main(["inspect", "--context-parallel", "4", "--cp-compression", "subspace", "--cp-variant", "paper"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out[: out.index("\nrun_id")])["context_parallel"]["variant"] == "paper"
    assert "context parallel  P=4, subspace (paper)" in out
    path = tmp_path / "cp.json"
    save_manifest(tiny_manifest("boundary", context_parallel={"size": 2, "compression": "subspace"}), path)
    assert main(["simulate", "--manifest", str(path), "--steps", "2", "--data", corpus, "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["cp_bytes_per_token"]["forward"] > 0 and result["cp_dense_bytes_per_token"]["forward"] > 0
    assert math.isfinite(result["cp_reconstruction_error"]) and math.isfinite(result["cp_kv_residual"])
    assert main(["simulate", "--manifest", str(path), "--steps", "1", "--data", corpus]) == 0
    assert "context parallel K/V" in capsys.readouterr().out


def test_cli_refuses_chunks_that_do_not_divide_the_sequence(capsys):
    assert main(["simulate", "--context-parallel", "3", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "divisible by context_parallel.size (3)" in err and len(err.splitlines()) == 1


def test_default_spec_is_the_one_documented():
    spec = ContextParallelSpec()
    assert (spec.size, spec.compression, spec.variant) == (1, "none", "remote")


def test_simulator_warm_start_switches_every_stage_to_the_pca_basis(corpus):
    """`warm_start_steps`: dense K/V messages first, then Ū := PCA of the K/V seen, the same version
    and hash on every stage, and compressed messages from then on."""
    manifest = tiny_manifest(
        "boundary", context_parallel={"size": 4, "compression": "subspace", "warm_start_steps": 2}
    )
    stages = build_stages(manifest)
    before = stages[0].cp_basis.sha256
    cold = simulate(manifest, 4, data=corpus, val_batches=1)
    info = cold.cp_warm_start
    assert info["step"] == 2 and info["version"] == 1 and info["sha256"] != before and info["same_on_every_copy"]
    assert all(0 < kept <= 1 + 1e-9 for kept in info["energy_kept"].values())
    # two dense steps and two compressed ones: the bytes lie between the two
    sent, dense = cold.cp_bytes_per_token["forward"], cold.cp_dense_bytes_per_token["forward"]
    assert 0.5 * dense < sent < 0.75 * dense


def test_a_sequence_that_does_not_split_is_refused(tokens):
    stage = build_stages(_cp(size=4))[0]
    with pytest.raises(ValueError, match="does not split into 4 chunks"):
        stage(None, tokens[:, :30])


@pytest.mark.parametrize("compression", ["none", "subspace"])
def test_counted_messages_are_the_ones_the_graph_cut_wire_sends(compression):
    """The simulator's tap on the one-graph model encodes exactly as many bytes, forward and backward,
    as swarm.cp_wire.wire_step ships with the graph cut at every message."""
    manifest = _cp(size=4, compression=compression, variant="paper")
    spec, shape = manifest.context_parallel, manifest.model
    model = CPDecoder(shape, spec, seed=5)
    batch = torch.randint(0, V, (2, SEQ), generator=torch.Generator().manual_seed(4))
    codec = CPCodec(spec, shape, SEQ, 2, "run-x", model.cp_basis)
    _, sent = wire_step(model, batch, codec)
    traffic = CPTraffic(dict.fromkeys(range(shape.n_layers), codec), [block.attn for block in model.layers])
    with traffic:
        loss = next_token_loss(model(batch), batch)
    loss.backward()
    counted = traffic.flush()
    assert counted.forward_bytes == sum(sent["forward"]) > 0
    assert counted.backward_bytes == sum(sent["backward"])
    assert counted.max_reconstruction_error < 0.01
