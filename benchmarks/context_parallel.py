"""Context parallelism with mixtures of subspaces (issue 16): loss at equal tokens, bytes, step time.

One process, CPU. For each seed every mode trains the same CPDecoder shape on the same batches
(builtin stdlib corpus, byte tokens) and is validated on the same held-out windows:

    dense         compression none (exact causal attention, K/V shipped in full)
    fixed-*       compressed, Ū from the seed, θ_max = 0 (one fixed subspace)
    mix-*         compressed, rotation mixture (θ per chunk and layer from the chunk's mean input)
    warm-*        mixture, after `--warm-steps` dense steps Ū := PCA of the K/V seen (basis version 1)

each `paper` (every block, the owner's included, from the compressed K/V) and `remote` (only K/V
crossing to later chunks compressed). Bytes per token per layer are counted from encoded messages
(swarm.cp_wire.wire_step on one batch, on the CPU after training, which also checks its loss
against the one-graph model), and compared with the formula and with dense K/V.

`--lrs` sweeps the learning rate: the table takes each mode's best lr (mean validation loss over
the seeds) and flags a best lr at an edge of the sweep. `--json` is written after every run and
read back at the start, so an interrupted sweep resumes where it stopped. `--jobs N` runs N runs
at once (one torch thread each; `--device cuda` shares one GPU between them).

    OMP_NUM_THREADS=1 nice -n 15 python benchmarks/context_parallel.py --steps 150 --seeds 0 1 2 \
        --json /tmp/cp.json
    python benchmarks/context_parallel.py --device cuda --jobs 8 --seq 4096 --batch 4 --steps 600 \
        --seeds 0 1 2 --lrs 1e-3 2e-3 4e-3 8e-3 --json cp-4096.json
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lr_sweep import best_lr  # noqa: E402

from swarm.context_parallel import ContextParallelSpec  # noqa: E402
from swarm.cp_model import CPDecoder  # noqa: E402
from swarm.cp_wire import CPCodec, wire_step  # noqa: E402
from swarm.data import BUILTIN_STDLIB, ByteTokenizer, TokenStream, read_corpus  # noqa: E402
from swarm.manifest import ModelShape  # noqa: E402
from swarm.model import next_token_loss  # noqa: E402

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


def evaluate(model: CPDecoder, batches: list[torch.Tensor], device: str) -> float:
    with torch.no_grad():
        return statistics.fmean(float(next_token_loss(model(b.to(device)), b.to(device))) for b in batches)


def run(mode: str, seed: int, lr: float, args, shape, train_tokens, val_batches) -> dict:
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
    model = CPDecoder(shape, spec, seed=seed).to(args.device)
    stream = TokenStream(train_tokens, args.seq, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
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
            group["lr"] = lr_at(step, args.steps, lr, args.lr_warmup)
        batch = stream.batch(args.batch).to(args.device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = next_token_loss(model(batch), batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.detach())
    losses = [float(loss) for loss in losses]
    val = evaluate(model, val_batches, args.device)
    # bytes from encoded messages, and the wire path against the one-graph model on one batch (CPU)
    model.cpu()
    batch = val_batches[0]
    codec = CPCodec(spec, shape, args.seq, args.batch, f"cp-bench-{seed}", model.cp_basis)
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
            for block in model.layers:
                xn = block.attn_norm(model.enter(None, batch[:, : args.seq // args.P]))
                thetas.append(float(block.attn.project(xn, model.kv_mode)[3].abs().max()))
    return {
        "mode": mode,
        "seed": seed,
        "lr": lr,
        "seq": args.seq,
        "device": args.device,
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
        "basis_version": model.cp_basis.version,
        "basis_sha256": model.cp_basis.sha256[:16],
        "warm_start": warm_info,
        "theta_abs_max_first_chunk_layer0": thetas[:1],
    }


def build(args) -> tuple[ModelShape, torch.Tensor, list[torch.Tensor]]:
    """The model shape, the training tokens and the held-out batches every run of the sweep shares."""
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
    return shape, tokens[:split], val_batches


_SHARED: dict = {}


def _worker_init(args) -> None:
    torch.set_num_threads(1)
    # TF32 matmuls on a GPU: every mode alike; the byte count and the wire check run on the CPU in fp32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    _SHARED["args"] = args
    _SHARED["data"] = build(args)


def _worker_run(task: tuple[str, int, float]) -> dict:
    mode, seed, lr = task
    args = _SHARED["args"]
    start = time.perf_counter()
    try:
        result = run(mode, seed, lr, args, *_SHARED["data"])
    except Exception as error:  # one failed run is reported and kept out of the table, not fatal
        result = {"mode": mode, "seed": seed, "lr": lr, "error": f"{type(error).__name__}: {error}"}
    result["wall_seconds"] = time.perf_counter() - start
    return result


def sweep_order(args) -> list[tuple[str, int, float]]:
    """Every (mode, seed, lr), the middle of the lr sweep first and modes interleaved within a seed,
    so a sweep cut short still has every mode at the central learning rates, under the same load."""
    middle = (len(args.lrs) - 1) / 2
    lrs = sorted(args.lrs, key=lambda lr: abs(args.lrs.index(lr) - middle))
    return [(mode, seed, lr) for lr in lrs for seed in args.seeds for mode in args.modes]


def key(result: dict) -> tuple[str, int, float]:
    return result["mode"], result["seed"], result["lr"]


def best_lrs(results: list[dict], modes: list[str]) -> dict[str, float]:
    """Each mode's learning rate, by `lr_sweep.best_lr`."""
    best = {}
    for mode in modes:
        by_lr: dict[float, list[float]] = {}
        for r in results:
            if r["mode"] == mode and "error" not in r:
                by_lr.setdefault(r["lr"], []).append(r["val_loss"])
        if by_lr:
            best[mode] = best_lr(by_lr)
    return best


def summary(results: list[dict], modes: list[str], lrs: list[float]) -> str:
    """The markdown table: each mode at its best lr, its loss ratio to dense CP at dense's best lr
    (per seed, then the mean), step time, bytes."""
    ok = [r for r in results if "error" not in r]
    best = best_lrs(ok, modes)
    pick = {mode: [r for r in ok if r["mode"] == mode and r["lr"] == lr] for mode, lr in best.items()}
    dense = {r["seed"]: r for r in pick.get("dense", [])}
    dense_step = statistics.fmean(r["step_seconds"] for r in dense.values()) if dense else float("nan")
    lines = [
        "| mode | best lr | val loss (mean ± sd) | seeds | ratio to dense (mean ± sd of per-seed) | "
        "step s (× dense) | fwd B/tok/layer | formula | % of dense K/V |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, rows in pick.items():
        vals = [r["val_loss"] for r in rows]
        ratios = [r["val_loss"] / dense[r["seed"]]["val_loss"] for r in rows if r["seed"] in dense]
        edge = " (edge)" if best[mode] in (min(lrs), max(lrs)) and len(lrs) > 1 else ""
        step = statistics.fmean(r["step_seconds"] for r in rows)
        fwd = statistics.fmean(r["bytes_per_token_per_layer_fwd"] for r in rows)
        lines.append(
            f"| {mode} | {best[mode]:g}{edge} | {statistics.fmean(vals):.4f} ± {_sd(vals):.4f} | {len(rows)} | "
            f"{statistics.fmean(ratios) if ratios else float('nan'):.4f} ± {_sd(ratios):.4f} | "
            f"{step:.3f} ({step / dense_step:.2f}) | {fwd:.1f} | {rows[0]['formula_payload_bytes_per_token']:.1f} | "
            f"{100 * fwd / rows[0]['dense_payload_bytes_per_token']:.2f} |"
        )
    lines += ["", "| mode | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |", "|---|" + "---|" * len(lrs)]
    for mode in modes:
        cells = []
        for lr in lrs:
            vals = [r["val_loss"] for r in ok if r["mode"] == mode and r["lr"] == lr]
            cells.append(f"{statistics.fmean(vals):.4f} (n={len(vals)})" if vals else "–")
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    failed = [r for r in results if "error" in r]
    lines += [f"failed: {r['mode']} seed {r['seed']} lr {r['lr']:g}: {r['error']}" for r in failed]
    return "\n".join(lines)


def _sd(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


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
    parser.add_argument("--lrs", type=float, nargs="+", default=[2e-3], help="learning rates swept per mode")
    parser.add_argument("--lr-warmup", type=int, default=10)
    parser.add_argument("--warm-steps", type=int, default=30, help="dense steps before the PCA switch (warm-*)")
    parser.add_argument("--pca-steps", type=int, default=10, help="last warm-up steps whose K/V feed the PCA")
    parser.add_argument("--val-batches", type=int, default=4)
    parser.add_argument("--corpus-bytes", type=int, default=4 << 20)
    parser.add_argument("--device", default="cpu", help="cpu or cuda; bytes and the wire check run on the CPU")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, one torch thread each")
    parser.add_argument(
        "--json", help="results file: read at the start (runs in it are skipped), written after each run"
    )
    parser.add_argument("--summary-only", action="store_true", help="print the table of --json and run nothing")
    args = parser.parse_args()
    path = Path(args.json) if args.json else None
    results = json.loads(path.read_text())["results"] if path and path.exists() else []
    done = {key(r) for r in results if "error" not in r}
    tasks = [] if args.summary_only else [t for t in sweep_order(args) if t not in done]
    results = [r for r in results if "error" not in r]
    print(f"{len(done)} runs on record, {len(tasks)} to run, {args.jobs} at once on {args.device}", flush=True)
    context = multiprocessing.get_context("spawn")
    with context.Pool(args.jobs, initializer=_worker_init, initargs=(args,)) as pool:
        for result in pool.imap_unordered(_worker_run, tasks):
            results.append(result)
            if "error" in result:
                print(
                    f"seed {result['seed']} {result['mode']} lr {result['lr']:g} FAILED {result['error']}", flush=True
                )
            else:
                print(
                    f"seed {result['seed']} {result['mode']:13s} lr {result['lr']:g} val {result['val_loss']:.4f} "
                    f"step {result['step_seconds']:.3f}s fwd {result['bytes_per_token_per_layer_fwd']:.1f} B/tok/layer "
                    f"wire|graph {result['wire_vs_graph_loss']:.1e} [{result['wall_seconds']:.0f}s] "
                    f"({len(results)}/{len(done) + len(tasks)})",
                    flush=True,
                )
            if path:
                path.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print()
    print(summary(results, args.modes, sorted({r["lr"] for r in results if r["mode"] in args.modes})))


if __name__ == "__main__":
    main()
