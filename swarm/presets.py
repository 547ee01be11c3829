"""Named run shapes, from a CPU toy to the paper's 8B, with the seed-derived hashes filled in.

The `-long` / `-cp` presets are their base shape with long sequences split into context-parallel
chunks (`swarm/context_parallel.py`), K/V compressed between chunks."""

from __future__ import annotations

from dataclasses import asdict, replace

from swarm.context_parallel import ContextParallelSpec, CPBasis, kv_width
from swarm.manifest import (
    BatchSpec,
    Manifest,
    ManifestError,
    ModelShape,
    OptimizerSpec,
    even_stages,
    parse_manifest,
)
from swarm.subspace import initial_basis, t_fixed_sha256, tensor_sha256

FULL = "full"  # a preset's stage embedding rank that means a full table at whatever width the preset ends up with

_SHAPES: dict[str, dict] = {
    # seconds per step on two CPU cores; d/k = 64
    "tiny": dict(
        model=ModelShape(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=704, vocab_size=256, max_seq_len=256),
        k=4,
        stages=2,
        tokenizer="bytes",
        dataset="builtin:stdlib",
        batch=BatchSpec(microbatch_size=8, seq_len=128, target_batch_size=16),
        optimizer=OptimizerSpec(lr=2e-3, warmup_steps=10),
        stage_embedding_rank=FULL,  # a V×d table per stage (64K parameters); RESULTS, "Convergence"
    ),
    # ~125M parameters, GPT-2 small's width
    "small": dict(
        model=ModelShape(
            d_model=768, n_layers=12, n_heads=12, n_kv_heads=4, d_ff=2048, vocab_size=50304, max_seq_len=1024
        ),
        k=8,
        stages=4,
        tokenizer="hf:gpt2",
        dataset="hf:HuggingFaceFW/fineweb-edu",
        batch=BatchSpec(microbatch_size=8, seq_len=1024, target_batch_size=256),
        optimizer=OptimizerSpec(lr=6e-4, warmup_steps=500, weight_decay=0.1),
    ),
    "1b": dict(
        model=ModelShape(
            d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192, vocab_size=50304, max_seq_len=2048
        ),
        k=20,
        stages=8,
        tokenizer="hf:gpt2",
        dataset="hf:HuggingFaceFW/fineweb-edu",
        batch=BatchSpec(microbatch_size=4, seq_len=2048, target_batch_size=512),
        optimizer=OptimizerSpec(lr=3e-4, warmup_steps=1000, weight_decay=0.1),
    ),
    # the paper's shape: LLaMA-3 8B, d=4096, k=40, 32 stages of one layer
    "8b": dict(
        model=ModelShape(
            d_model=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=8,
            d_ff=14336,
            vocab_size=128256,
            max_seq_len=4096,
            rope_theta=500000.0,
        ),
        k=40,
        stages=32,
        tokenizer="hf:meta-llama/Meta-Llama-3-8B",
        dataset="hf:HuggingFaceFW/fineweb-edu",
        batch=BatchSpec(microbatch_size=1, seq_len=4096, target_batch_size=1024),
        optimizer=OptimizerSpec(lr=3e-4, warmup_steps=2000, weight_decay=0.1),
    ),
}



def _long_context(base: str, seq_len: int, size: int, target: int, k_share: float, v_share: float) -> dict:
    """`base` with sequences of `seq_len` tokens over `size` chunks, one sequence per microbatch; the
    K and V ranks keep `k_share` and `v_share` of d_kv (the paper reports K 98%, V 95% less traffic)."""
    shape = _SHAPES[base]["model"].model_copy(update=dict(max_seq_len=seq_len))
    d_kv = kv_width(shape)
    return dict(
        _SHAPES[base],
        model=shape,
        batch=BatchSpec(microbatch_size=1, seq_len=seq_len, target_batch_size=target),
        context_parallel=ContextParallelSpec(
            size=size, compression="subspace", r_k=round(k_share * d_kv), r_v=round(v_share * d_kv)
        ),
    )


# tiny at 4096 tokens over 4 chunks (r_k 4, r_v 8 of d_kv 128: 4.7% of dense K/V bytes)
_SHAPES["tiny-long"] = _long_context("tiny", 4096, 4, 2, 1 / 32, 1 / 16)
# the paper's setting: 132K-token context over 8 devices (here 32K for the 1B shape); ranks at 2% / 5% of d_kv
_SHAPES["1b-cp"] = _long_context("1b", 32768, 8, 32, 0.02, 0.05)
_SHAPES["8b-cp"] = _long_context("8b", 131072, 8, 32, 0.02, 0.05)

PRESETS = tuple(_SHAPES)


def with_hashes(manifest: Manifest) -> Manifest:
    """Fill in the SHA-256 of T_fixed, U v0 and (with context parallelism) the CP bases v0 derived from
    the manifest's seed."""
    shape = manifest.model
    hashes = dict(
        t_fixed_sha256=t_fixed_sha256(manifest.seed, shape.vocab_size, shape.d_model, manifest.t_fixed_std),
        u_sha256=tensor_sha256(initial_basis(manifest.seed, shape.d_model, manifest.k)),
    )
    spec = manifest.context_parallel
    if spec is not None:
        digest = CPBasis.for_spec(spec, shape, manifest.seed).sha256
        hashes["context_parallel"] = replace(spec, basis_sha256=digest)
    return manifest.model_copy(update=hashes)


def preset(name: str, **overrides) -> Manifest:
    """A preset manifest; `stages` may be an int (even split), `stage_embedding_rank` "full" (d_model, after a
    `model` override), `context_parallel` a dict of the fields
    to change in the preset's context parallelism (starting from `ContextParallelSpec`'s defaults
    where the preset has none), other keys replace manifest fields."""
    if name not in _SHAPES:
        raise ManifestError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    fields = dict(_SHAPES[name], name=f"{name}", seed=0, wire_dtype="bf16")
    cp_changes = overrides.pop("context_parallel", None)
    if cp_changes:
        fields["context_parallel"] = {**asdict(fields.get("context_parallel") or ContextParallelSpec()), **cp_changes}
    fields.update({key: value for key, value in overrides.items() if value is not None})
    if fields.get("stage_embedding_rank") == FULL:
        fields["stage_embedding_rank"] = fields["model"].d_model
    if isinstance(fields["stages"], int):
        fields["stages"] = even_stages(fields["model"].n_layers, fields["stages"])
    manifest = parse_manifest(
        {
            **fields,
            "model": fields["model"].model_dump(),
            "batch": fields["batch"].model_dump(),
            "optimizer": fields["optimizer"].model_dump(),
            "stages": [s.model_dump() for s in fields["stages"]],
        }
    )
    return with_hashes(manifest)


def verify_hashes(manifest: Manifest) -> None:
    """Refuse a manifest whose recorded hashes differ from what this machine derives."""
    derived = with_hashes(manifest)
    checks = [
        ("T_fixed", manifest.t_fixed_sha256, derived.t_fixed_sha256),
        ("U v0", manifest.u_sha256, derived.u_sha256),
    ]
    if manifest.context_parallel is not None:
        checks.append(("CP basis v0", manifest.context_parallel.basis_sha256, derived.context_parallel.basis_sha256))
    for label, recorded, ours in checks:
        if recorded != ours:
            raise ManifestError(
                f"{label} hash mismatch: the manifest records {recorded or '(none)'}, this peer derives {ours} "
                f"from seed {manifest.seed}; refusing to start"
            )
