"""Context parallelism with mixtures of subspaces (issue 16): loss at equal tokens, bytes, step time.

One process, CPU. For each seed every mode trains the same CPDecoder shape on the same batches
(builtin stdlib corpus, byte tokens) and is validated on the same held-out windows:

    dense         compression none (exact causal attention, K/V shipped in full)
    fixed-*       compressed, Ū from the seed, θ_max = 0 (one fixed subspace)
    mix-*         compressed, rotation mixture (θ per chunk and layer from the chunk's mean input)
    warm-*        mixture, after `--warm-steps` dense steps Ū := PCA of the K/V seen (basis version 1)

each `paper` (every block, the owner's included, from the compressed K/V) and `remote` (only K/V
crossing to later chunks compressed). Bytes per token per layer are counted from encoded messages
(swarm.cp_wire.wire_step on one batch, which also checks its loss against the one-graph model),
and compared with the formula and with dense K/V.

    OMP_NUM_THREADS=1 nice -n 15 python benchmarks/context_parallel.py --steps 150 --seeds 0 1 2 \
        --json /tmp/cp.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarm.context_parallel import ContextParallelSpec  # noqa: E402
from swarm.cp_model import CPDecoder, next_token_loss  # noqa: E402
from swarm.cp_wire import CPCodec, wire_step  # noqa: E402
from swarm.data import BUILTIN_STDLIB, ByteTokenizer, TokenStream, read_corpus  # noqa: E402
from swarm.manifest import ModelShape  # noqa: E402

MODES = {
    "dense": dict(compression="none"),
    "fixed-paper": dict(compression="subspace", variant="paper", theta_max=0.0),
    "fixed-remote": dict(compression="subspace", variant="remote", theta_max=0.0),
    "mix-paper": dict(compression="subspace", variant="paper"),
    "mix-remote": dict(compression="subspace", variant="remote"),
    "warm-paper": dict(compression="subspace", variant="paper", warm=True),
    "warm-remote": dict(compression="subspace", variant="remote", warm=True),
}


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def evaluate(model: CPDecoder, batches: list[torch.Tensor]) -> float:
    with torch.no_grad():
        return statistics.fmean(float(next_token_loss(model(b), b)) for b in batches)


def run(mode: str, seed: int, args, shape, train_tokens, val_batches) -> dict:
    options = dict(MODES[mode])
    warm = options.pop("warm", False)
    spec = ContextParallelSpec(
        size=args.P,
        r_k=args.r_k,
        r_v=args.r_v,
        wire_dtype=args.wire_dtype,
        warm_start_steps=args.warm_steps if warm else 0,
        **{"theta_max": args.theta_max, **options},
    )
    spec.validate(shape, args.seq)
    torch.manual_seed(seed)
    model = CPDecoder(shape, spec, seed=seed)
    stream = TokenStream(train_tokens, args.seq, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warm_info = None
    if warm:
        model.compress_active = False
    times, losses = [], []
    for step in range(args.steps):
        if warm and step == max(0, args.warm_steps - args.pca_steps):
            model.start_collecting()
        if warm and step == args.warm_steps:
            warm_info = model.warm_start()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.lr_warmup)
        batch = stream.batch(args.batch)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = next_token_loss(model(batch), batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    val = evaluate(model, val_batches)
    # bytes from encoded messages, and the wire path against the one-graph model on one batch
    batch = val_batches[0]
    codec = CPCodec(spec, shape, args.seq, args.batch, f"cp-bench-{seed}", model.basis)
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    wire_loss, sent = wire_step(model, batch, codec)
    wire_seconds = time.perf_counter() - start
    with torch.no_grad():
        graph_loss = float(next_token_loss(model(batch), batch))
    tokens = batch.numel()
    formula = spec.payload_bytes_per_token(shape, args.seq)
    thetas = []
    if spec.rotates:
        with torch.no_grad():
            for block in model.blocks:
                xn = block.attn_norm(model.embed[batch[:, : args.seq // args.P]])
                thetas.append(float(block.attn.project(xn, model.mode)[3].abs().max()))
    return {
        "mode": mode,
        "seed": seed,
        "steps": args.steps,
        "tokens": args.steps * args.batch * args.seq,
        "val_loss": val,
        "train_loss_last10": statistics.fmean(losses[-10:]),
        "step_seconds": statistics.median(times[2:] if len(times) > 4 else times),
        "wire_step_seconds": wire_seconds,
        "wire_vs_graph_loss": abs(wire_loss - graph_loss),
        "bytes_per_token_per_layer_fwd": statistics.fmean(sent["forward"]) / tokens,
        "bytes_per_token_per_layer_bwd": statistics.fmean(sent["backward"]) / tokens,
        "formula_payload_bytes_per_token": formula["compressed"] if spec.compressed else formula["dense"],
        "dense_payload_bytes_per_token": formula["dense"],
        "basis_version": model.basis.version,
        "basis_sha256": model.basis.sha256[:16],
        "warm_start": warm_info,
        "theta_abs_max_first_chunk_layer0": thetas[:1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--P", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--r-k", type=int, default=4)
    parser.add_argument("--r-v", type=int, default=8)
    parser.add_argument("--theta-max", type=float, default=0.5)
    parser.add_argument("--wire-dtype", default="bf16")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--lr-warmup", type=int, default=10)
    parser.add_argument("--warm-steps", type=int, default=30, help="dense steps before the PCA switch (warm-*)")
    parser.add_argument("--pca-steps", type=int, default=10, help="last warm-up steps whose K/V feed the PCA")
    parser.add_argument("--val-batches", type=int, default=4)
    parser.add_argument("--corpus-bytes", type=int, default=4 << 20)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = ModelShape(
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=max(4, args.d_model // 64),
        n_kv_heads=max(2, args.d_model // 128),
        d_ff=int(args.d_model * 2.75) // 16 * 16,
        vocab_size=256,
        max_seq_len=args.seq,
    )
    tokens = ByteTokenizer().encode(read_corpus(BUILTIN_STDLIB, args.corpus_bytes))
    split = int(len(tokens) * 0.95)
    val_batches = TokenStream(tokens[split:], args.seq, 0).fixed_batches(args.batch, args.val_batches)
    results = []
    for seed in args.seeds:
        for mode in args.modes:
            start = time.perf_counter()
            result = run(mode, seed, args, shape, tokens[:split], val_batches)
            results.append(result)
            print(
                f"seed {seed} {mode:13s} val {result['val_loss']:.4f} step {result['step_seconds']:.3f}s "
                f"fwd {result['bytes_per_token_per_layer_fwd']:.1f} B/tok/layer "
                f"(formula {result['formula_payload_bytes_per_token']:.1f}, "
                f"dense {result['dense_payload_bytes_per_token']:.1f}) "
                f"wire|graph {result['wire_vs_graph_loss']:.1e} [{time.perf_counter() - start:.0f}s]",
                flush=True,
            )
    dense = {r["seed"]: r["val_loss"] for r in results if r["mode"] == "dense"}
    dense_step = statistics.fmean(r["step_seconds"] for r in results if r["mode"] == "dense") if dense else None
    print(
        "\n| mode | val loss (mean ± sd over seeds) | ratio to dense | step s (x dense) | fwd B/tok/layer | "
        "formula | dense K/V | % of dense |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mode in args.modes:
        rows = [r for r in results if r["mode"] == mode]
        vals = [r["val_loss"] for r in rows]
        spread = statistics.stdev(vals) if len(vals) > 1 else 0.0
        ratio = statistics.fmean(r["val_loss"] / dense[r["seed"]] for r in rows) if dense else float("nan")
        step = statistics.fmean(r["step_seconds"] for r in rows)
        fwd = statistics.fmean(r["bytes_per_token_per_layer_fwd"] for r in rows)
        print(
            f"| {mode} | {statistics.fmean(vals):.4f} ± {spread:.4f} | {ratio:.4f} | {step:.3f} "
            f"({step / dense_step if dense_step else float('nan'):.2f}) | {fwd:.1f} | "
            f"{rows[0]['formula_payload_bytes_per_token']:.1f} | {rows[0]['dense_payload_bytes_per_token']:.1f} | "
            f"{100 * fwd / rows[0]['dense_payload_bytes_per_token']:.2f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
