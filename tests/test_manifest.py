"""The run manifest: every rule refuses a bad manifest with a message naming the field and the rule;
hashes of the seed-derived tensors are stable across processes and change with the seed."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from swarm.context_parallel import CPBasis
from swarm.manifest import (
    ManifestError,
    even_stages,
    load_manifest,
    parse_manifest,
    save_manifest,
)
from swarm.presets import PRESETS, preset, verify_hashes
from swarm.subspace import initial_basis, t_fixed_sha256, t_fixed_table, tensor_sha256


@pytest.fixture(scope="module")
def tiny_dict() -> dict:
    return preset("tiny").model_dump(mode="json")


def _refused(data: dict, *fragments: str) -> str:
    with pytest.raises(ManifestError) as info:
        parse_manifest(data)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def _with(base: dict, path: str, value) -> dict:
    data = copy.deepcopy(base)
    *parents, leaf = path.split(".")
    node = data
    for key in parents:
        node = node[key]
    node[leaf] = value
    return data


# --- the valid case, so the refusals below are refusals of one broken rule --------------------------

def test_tiny_dict_round_trips(tiny_dict):
    manifest = parse_manifest(tiny_dict)
    assert manifest == preset("tiny")
    assert manifest.run_id == preset("tiny").run_id
    assert manifest.num_stages == 2
    assert [list(manifest.layers_of(i)) for i in range(2)] == [[0, 1], [2, 3]]


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_is_valid(name):
    # hashing the large presets' V×d tables takes seconds, so validate their fields without hashes
    manifest = parse_manifest(_no_hash_preset(name))
    assert 1 <= manifest.k < manifest.model.d_model
    assert manifest.stages[-1].end_layer == manifest.model.n_layers


def _no_hash_preset(name: str) -> dict:
    # the 1b/8b presets hash a V×d table (up to 128256×4096 floats): validate their shape only
    from swarm import presets

    fields = dict(presets._SHAPES[name], name=name, seed=0)
    fields["stages"] = [s.model_dump() for s in even_stages(fields["model"].n_layers, fields["stages"])]
    for key in ("model", "batch", "optimizer"):
        fields[key] = fields[key].model_dump()
    if fields.get("stage_embedding_rank") == presets.FULL:  # as `preset` resolves it
        fields["stage_embedding_rank"] = fields["model"]["d_model"]
    return fields


def test_paper_preset_shape():
    data = _no_hash_preset("8b")
    assert data["model"]["d_model"] == 4096 and data["k"] == 40


# --- one test per rule ------------------------------------------------------------------------------

def test_k_not_smaller_than_d(tiny_dict):
    _refused(_with(tiny_dict, "k", 256), "k (256)", "smaller than model.d_model (256)")
    _refused(_with(tiny_dict, "k", 300), "k (300)", "model.d_model")


@pytest.mark.parametrize("k", [0, -3])
def test_k_below_one(tiny_dict, k):
    _refused(_with(tiny_dict, "k", k), "k:", "at least 1")


def test_stage_gap(tiny_dict):
    stages = [{"first_layer": 0, "end_layer": 1}, {"first_layer": 2, "end_layer": 4}]
    _refused(_with(tiny_dict, "stages", stages), "stages[1].first_layer", "without gaps or overlaps")


def test_stage_overlap(tiny_dict):
    stages = [{"first_layer": 0, "end_layer": 3}, {"first_layer": 2, "end_layer": 4}]
    _refused(_with(tiny_dict, "stages", stages), "stages[1].first_layer is 2 but must be 3")


def test_stages_not_starting_at_zero(tiny_dict):
    stages = [{"first_layer": 1, "end_layer": 4}]
    _refused(_with(tiny_dict, "stages", stages), "stages[0].first_layer", "cover the layers exactly")


def test_stages_not_covering_all_layers(tiny_dict):
    stages = [{"first_layer": 0, "end_layer": 2}, {"first_layer": 2, "end_layer": 3}]
    _refused(_with(tiny_dict, "stages", stages), "stages end at layer 3", "model.n_layers is 4")


def test_stages_beyond_last_layer(tiny_dict):
    stages = [{"first_layer": 0, "end_layer": 2}, {"first_layer": 2, "end_layer": 5}]
    _refused(_with(tiny_dict, "stages", stages), "stages end at layer 5", "model.n_layers is 4")


def test_empty_stage(tiny_dict):
    stages = [{"first_layer": 0, "end_layer": 2}, {"first_layer": 2, "end_layer": 2},
              {"first_layer": 2, "end_layer": 4}]
    _refused(_with(tiny_dict, "stages", stages), "stages[1]", "at least one layer")


def test_no_stages(tiny_dict):
    _refused(_with(tiny_dict, "stages", []), "stages", "at least one stage")


def test_negative_layer_index(tiny_dict):
    stages = [{"first_layer": -1, "end_layer": 4}]
    _refused(_with(tiny_dict, "stages", stages), "stages.0.first_layer", "greater than or equal to 0")


def test_unknown_wire_dtype(tiny_dict):
    _refused(_with(tiny_dict, "wire_dtype", "fp8"), "wire_dtype", "'fp32'", "'bf16'", "'fp16'")


def test_unknown_compression(tiny_dict):
    _refused(_with(tiny_dict, "compression", "zip"), "compression", "'subspace'")


def test_vocab_too_small_for_bytes(tiny_dict):
    _refused(_with(tiny_dict, "model.vocab_size", 100), "model.vocab_size (100)", ">= 256", "byte tokenizer")


def test_vocab_below_two(tiny_dict):
    data = _with(_with(tiny_dict, "model.vocab_size", 1), "tokenizer", "hf:gpt2")
    _refused(data, "model.vocab_size", "greater than or equal to 2")


def test_small_vocab_allowed_for_other_tokenizers(tiny_dict):
    data = _with(_with(tiny_dict, "model.vocab_size", 100), "tokenizer", "hf:gpt2")
    assert parse_manifest(data).model.vocab_size == 100


def test_heads_do_not_divide_d(tiny_dict):
    _refused(_with(tiny_dict, "model.n_heads", 3), "model.d_model (256)", "divisible by model.n_heads (3)")


def test_kv_heads_do_not_divide_heads(tiny_dict):
    data = _with(tiny_dict, "model.n_kv_heads", 3)
    _refused(data, "model.n_heads (4)", "divisible by model.n_kv_heads (3)")


def test_odd_head_dim(tiny_dict):
    data = _with(_with(tiny_dict, "model.n_heads", 256), "model.n_kv_heads", 256)
    _refused(data, "model.d_model / model.n_heads", "even")


def test_seq_len_exceeds_max(tiny_dict):
    _refused(_with(tiny_dict, "batch.seq_len", 512), "batch.seq_len (512)", "model.max_seq_len (256)")


def test_unknown_tokenizer(tiny_dict):
    _refused(_with(tiny_dict, "tokenizer", "sentencepiece"), "tokenizer", "'bytes' or 'hf:<name>'")


def test_extra_unknown_field(tiny_dict):
    _refused({**tiny_dict, "bogus": 1}, "bogus", "Extra inputs are not permitted")
    _refused(_with(tiny_dict, "model.dropout", 0.1), "model.dropout", "Extra inputs are not permitted")


def test_unknown_format(tiny_dict):
    _refused(_with(tiny_dict, "format", 2), "format:", "must be 1", "got 2")


def test_missing_field(tiny_dict):
    data = copy.deepcopy(tiny_dict)
    del data["seed"]
    _refused(data, "seed", "Field required")


def test_bad_hash_format(tiny_dict):
    _refused(_with(tiny_dict, "u_sha256", "XYZ"), "u_sha256", "64 lowercase hex digits")


def test_several_problems_reported_together(tiny_dict):
    data = _with(_with(tiny_dict, "wire_dtype", "fp8"), "tokenizer", "nope")
    _refused(data, "wire_dtype", "tokenizer")


def test_preset_overrides_are_validated():
    with pytest.raises(ManifestError, match=r"k \(256\)"):
        preset("tiny", k=256)
    with pytest.raises(ManifestError, match="stages must be between 1"):
        preset("tiny", stages=5)
    with pytest.raises(ManifestError, match="unknown preset"):
        preset("huge")


def test_even_stages():
    assert [(s.first_layer, s.end_layer) for s in even_stages(5, 2)] == [(0, 3), (3, 5)]
    assert [(s.first_layer, s.end_layer) for s in even_stages(4, 4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ManifestError):
        even_stages(4, 0)


# --- files ------------------------------------------------------------------------------------------

def test_load_missing_file(tmp_path):
    with pytest.raises(ManifestError, match="not found"):
        load_manifest(tmp_path / "absent.json")


def test_load_bad_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        load_manifest(path)


def test_load_not_an_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ManifestError, match="JSON object"):
        load_manifest(path)


def test_load_unreadable(tmp_path):
    with pytest.raises(ManifestError, match="cannot be read"):
        load_manifest(tmp_path)  # a directory
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(ManifestError, match="cannot be read"):
        load_manifest(binary)


def test_load_invalid_manifest_names_field(tmp_path, tiny_dict):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(_with(tiny_dict, "k", 0)))
    with pytest.raises(ManifestError, match="k: "):
        load_manifest(path)


def test_save_load_round_trip(tmp_path):
    manifest = preset("tiny", compression="boundary", seed=7)
    save_manifest(manifest, tmp_path / "m.json")
    loaded = load_manifest(tmp_path / "m.json")
    assert loaded == manifest
    assert loaded.canonical_json() == manifest.canonical_json()
    assert loaded.run_id == manifest.run_id


# --- run id and hashes ------------------------------------------------------------------------------

def test_run_id_depends_on_every_field():
    base = preset("tiny")
    assert base.run_id.startswith("tiny-") and len(base.run_id) == len("tiny-") + 12
    others = [preset("tiny", seed=1), preset("tiny", k=8), preset("tiny", compression="none"),
              preset("tiny", wire_dtype="fp32"), preset("tiny", stages=4)]
    ids = {m.run_id for m in others}
    assert base.run_id not in ids and len(ids) == len(others)


def test_streamed_t_fixed_hash_matches_table():
    table = t_fixed_table(3, 300, 16)
    assert table.shape == (300, 16) and table.dtype == torch.float32
    assert t_fixed_sha256(3, 300, 16) == tensor_sha256(table)
    # more rows than one streaming chunk
    assert t_fixed_sha256(3, 5000, 4) == tensor_sha256(t_fixed_table(3, 5000, 4))


def test_t_fixed_is_full_rank_and_scaled():
    table = t_fixed_table(0, 256, 64).double()
    assert torch.linalg.matrix_rank(table).item() == 64
    assert 0.015 < table.std().item() < 0.025


def test_preset_hashes_match_derived_tensors():
    manifest = preset("tiny")
    assert manifest.t_fixed_sha256 == tensor_sha256(t_fixed_table(0, 256, 256))
    assert manifest.u_sha256 == tensor_sha256(initial_basis(0, 256, 4))


_HASH_SCRIPT = """
import json
from swarm.presets import preset
from swarm.subspace import initial_basis, t_fixed_table, tensor_sha256
out = []
for seed in (0, 1):
    m = preset("tiny", seed=seed)
    out.append([tensor_sha256(t_fixed_table(seed, 256, 64)), tensor_sha256(initial_basis(seed, 64, 4)),
                m.t_fixed_sha256, m.u_sha256, m.run_id])
print(json.dumps(out))
"""


def test_hashes_identical_across_processes_and_change_with_seed():
    """A fresh interpreter derives the same bytes as this one; another seed derives other bytes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _HASH_SCRIPT], capture_output=True, text=True, timeout=240,
                         env=env)
    assert out.returncode == 0, out.stderr
    there, other_seed = json.loads(out.stdout.strip().splitlines()[-1])
    m = preset("tiny", seed=0)
    here = [tensor_sha256(t_fixed_table(0, 256, 64)), tensor_sha256(initial_basis(0, 64, 4)),
            m.t_fixed_sha256, m.u_sha256, m.run_id]
    assert there == here
    for a, b in zip(here, other_seed, strict=True):
        assert a != b
    assert all(len(h) == 64 and int(h, 16) >= 0 for h in here[:4])


def test_verify_hashes_accepts_the_preset():
    verify_hashes(preset("tiny"))
    verify_hashes(preset("tiny", seed=5))


def test_verify_hashes_refuses_wrong_t_fixed_hash():
    manifest = preset("tiny")
    wrong = "0" * 64
    forged = manifest.model_copy(update={"t_fixed_sha256": wrong})
    with pytest.raises(ManifestError) as info:
        verify_hashes(forged)
    message = str(info.value)
    assert "T_fixed" in message and wrong in message and manifest.t_fixed_sha256 in message


def test_verify_hashes_refuses_wrong_u_hash():
    manifest = preset("tiny")
    other = preset("tiny", seed=1).u_sha256
    forged = manifest.model_copy(update={"u_sha256": other})
    with pytest.raises(ManifestError) as info:
        verify_hashes(forged)
    message = str(info.value)
    assert "U v0" in message and other in message and manifest.u_sha256 in message


def test_verify_hashes_refuses_missing_hash():
    forged = preset("tiny").model_copy(update={"u_sha256": ""})
    with pytest.raises(ManifestError, match="none"):
        verify_hashes(forged)


def test_seed_changes_hashes_in_manifest():
    a, b = preset("tiny", seed=0), preset("tiny", seed=1)
    assert a.t_fixed_sha256 != b.t_fixed_sha256 and a.u_sha256 != b.u_sha256


def test_compression_ratio_fields():
    manifest = preset("tiny")
    assert manifest.dense_bytes_per_token() == 256 * 2
    assert manifest.compressed_bytes_per_token() == 4 * 2 + 1
    assert preset("tiny", compression="none").compressed_bytes_per_token() == 512
    assert preset("tiny", wire_dtype="fp32").dense_bytes_per_token() == 1024


# --- context parallelism ------------------------------------------------------------------------------

def test_context_parallel_off_leaves_the_canonical_manifest_and_run_id_as_they_were(tiny_dict):
    """A manifest written before the field existed has no `context_parallel` key: its canonical JSON,
    hence its run id, is what it was; writing the field as null changes nothing either."""
    assert "context_parallel" not in tiny_dict
    manifest = parse_manifest(tiny_dict)
    assert manifest.canonical_json() == json.dumps(tiny_dict, sort_keys=True, separators=(",", ":"))
    assert parse_manifest({**tiny_dict, "context_parallel": None}).run_id == manifest.run_id
    with_cp = parse_manifest({**tiny_dict, "context_parallel": {"size": 4}})
    assert with_cp.run_id != manifest.run_id
    assert with_cp.model_dump(mode="json")["context_parallel"]["size"] == 4


@pytest.mark.parametrize(
    "spec, fragments",
    [
        ({"size": 3}, ("batch.seq_len (128)", "divisible by context_parallel.size (3)")),
        ({"size": 4, "compression": "subspace", "r_k": 65}, ("context_parallel.r_k (65)", "d_kv")),
        ({"size": 4, "compression": "subspace", "r_v": 0}, ("r_k and r_v must be at least 1",)),
        ({"size": 4, "compression": "lossy"}, ("context_parallel.compression must be one of",)),
        ({"size": 4, "variant": "other"}, ("context_parallel.variant must be one of",)),
        ({"size": 4, "rank": 3}, ("context_parallel.rank",)),
        ({"size": 0}, ("context_parallel.size must be at least 1",)),
        ({"size": 4, "theta_max": 3}, ("theta_max",)),
    ],
)
def test_context_parallel_is_validated(tiny_dict, spec, fragments):
    _refused(_with(tiny_dict, "context_parallel", spec), *fragments)


def test_context_parallel_round_trips_through_a_file(tmp_path):
    manifest = preset("tiny", context_parallel={"size": 4, "compression": "subspace", "variant": "paper"})
    save_manifest(manifest, tmp_path / "m.json")
    loaded = load_manifest(tmp_path / "m.json")
    assert loaded == manifest and loaded.run_id == manifest.run_id
    assert loaded.context_parallel.mode.compressed and loaded.context_parallel.variant == "paper"


@pytest.mark.parametrize("name, seq, size", [("tiny-long", 4096, 4), ("1b-cp", 32768, 8), ("8b-cp", 131072, 8)])
def test_long_context_presets(name, seq, size):
    """Long sequences over P chunks, K/V compressed to at most 5% of dense K/V bytes (the issue's target)."""
    manifest = parse_manifest(_no_hash_preset(name))
    spec = manifest.context_parallel
    assert (manifest.batch.seq_len, manifest.model.max_seq_len, spec.size) == (seq, seq, size)
    formula = spec.payload_bytes_per_token(manifest.model, seq)
    assert spec.compressed and formula["compressed"] <= 0.05 * formula["dense"]


def test_context_parallel_basis_hash_is_recorded_and_verified():
    manifest = preset("tiny", context_parallel={"size": 4, "compression": "subspace"})
    spec = manifest.context_parallel
    assert spec.basis_sha256 == CPBasis.for_spec(spec, manifest.model, manifest.seed).sha256
    assert preset("tiny", context_parallel={"size": 4, "r_k": 8}).context_parallel.basis_sha256 != spec.basis_sha256
    verify_hashes(manifest)
    wrong = manifest.model_copy(update={"context_parallel": replace(spec, basis_sha256="0" * 64)})
    with pytest.raises(ManifestError, match="CP basis v0 hash mismatch"):
        verify_hashes(wrong)
    with pytest.raises(ManifestError, match="basis_sha256 must be 64 lowercase hex digits"):
        preset("tiny", context_parallel={"size": 4, "basis_sha256": "xyz"})


# --- the fixed embedding's scale and stage embeddings ---------------------------------------------------

# the tiny preset's run id and T_fixed hash before `t_fixed_std` and `stage_embedding_rank` existed (main at
# 3a505b3): a manifest at the old values must keep both, so its peers still find each other
OLD_TINY_RUN_ID = "tiny-e6a0d4b57aba"
OLD_TINY_T_FIXED = "47b206fe248e"


def test_old_values_leave_the_canonical_manifest_its_run_id_and_t_fixed_as_they_were():
    old = preset("tiny", t_fixed_std=0.02, stage_embedding_rank=0)
    data = json.loads(old.canonical_json())
    assert "t_fixed_std" not in data and "stage_embedding_rank" not in data
    assert old.run_id == OLD_TINY_RUN_ID and old.t_fixed_sha256.startswith(OLD_TINY_T_FIXED)
    assert parse_manifest(data).t_fixed_std == 0.02 and parse_manifest(data).stage_embedding_rank == 0


def test_t_fixed_std_scales_the_table_and_names_a_new_run_and_hash():
    old, new = preset("tiny", t_fixed_std=0.02), preset("tiny", t_fixed_std=1.0)
    assert new.run_id != old.run_id and new.t_fixed_sha256 != old.t_fixed_sha256
    small, large = t_fixed_table(0, 256, 64, 0.02), t_fixed_table(0, 256, 64, 1.0)
    assert 0.9 < large.std().item() < 1.1
    assert torch.allclose(large * 0.02, small, rtol=1e-5, atol=1e-8)  # the same draws, scaled
    assert preset("tiny", stage_embedding_rank=16).run_id not in {old.run_id, new.run_id}


def test_a_peer_of_one_std_refuses_a_manifest_of_another_by_hash():
    """A manifest that claims another std's T_fixed hash (an old peer's, say) is refused by name."""
    old, new = preset("tiny", t_fixed_std=0.02), preset("tiny", t_fixed_std=1.0)
    forged = new.model_copy(update={"t_fixed_sha256": old.t_fixed_sha256})
    with pytest.raises(ManifestError, match="T_fixed hash mismatch"):
        verify_hashes(forged)


@pytest.mark.parametrize(
    "field, value, fragments",
    [
        ("t_fixed_std", 0, ("t_fixed_std", "greater than 0")),
        ("t_fixed_std", 1e9, ("t_fixed_std", "less than or equal to 100")),
        ("stage_embedding_rank", -1, ("stage_embedding_rank", "greater than or equal to 0")),
        ("stage_embedding_rank", 257, ("stage_embedding_rank (257)", "at most model.d_model (256)")),
    ],
)
def test_fixed_embedding_and_stage_embedding_fields_are_validated(tiny_dict, field, value, fragments):
    _refused(_with(tiny_dict, field, value), *fragments)
