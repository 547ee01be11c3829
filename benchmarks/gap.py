"""Where the gap to dense comes from (issue 18, "decompose the gap first"), at one k.

`boundary` differs from dense in two ways at once: the head's `T_S` is kept in span(U), and every
non-tail stage ends by projecting its output onto `T_fixed[tok] + span(U)`. This trains, at equal
tokens and one learning rate, dense (`none`), each change alone (`dense-ts`: only `T_S`
constrained, the full residual crosses; `boundary-free-ts`: only the projection, `T_S` free),
both (`boundary`) and the paper's `subspace`, seed by seed with the modes interleaved, and
reports each one's validation loss as a paired per-seed ratio to dense.

At the first boundary (the head stage's output before any projection, on the held-out windows)
it also measures what the residual is made of: the RMS of `T_fixed[tok]` (frozen, std 0.02), of
`T_S[tok]`, of what the layers added, and of the learned part `x − T_fixed[tok]` (= `T_S` + the
layers), and the share of the learned part's energy inside span(U) — what the projection keeps.
This asks whether a random fixed embedding crowds the subspace.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/gap.py [--steps 150] [--seeds 0 1] \
        [--json /tmp/gap.json] [--resume] [--reuse other.json ...]

Runs are deterministic (the seed sets init, U, T_fixed and the batch order), so a resumed run
reuses finished ones from the JSON file, and `--reuse` joins the runs of several invocations (one
process per seed, say) into one table.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from convergence import CONFIGS, fmt_duration, make_manifest, mean_std  # noqa: E402

import swarm.data  # noqa: E402
import swarm.simulate  # noqa: E402
from swarm.manifest import Manifest  # noqa: E402
from swarm.model import PipelineStage, build_stages  # noqa: E402

MODES = ("none", "dense-ts", "boundary-free-ts", "boundary", "subspace")
WHAT = {  # what is constrained to span(U) / what crosses a boundary
    "none": ("nothing", "residual (d)"),
    "dense-ts": ("T_S", "residual (d)"),
    "boundary-free-ts": ("boundary projection", "k coefficients"),
    "boundary": ("T_S + boundary projection", "k coefficients"),
    "subspace": ("T_S + W_o, W_down upstream", "k coefficients"),
}
SETTINGS = ("config", "lr", "seq_len", "microbatch", "microbatches", "warmup", "data", "val_batches")


@dataclass
class Run:
    mode: str
    seed: int
    steps: int
    tokens: int
    val_loss_first: float
    val_loss_last: float
    wire_bytes_per_token: float
    max_reconstruction_error: float
    max_subspace_residual: float
    seconds: float
    boundary_init: dict[str, float]
    boundary_end: dict[str, float]


@contextmanager
def keeping_stages() -> Iterator[list[list[PipelineStage]]]:
    """The stages `swarm.simulate.simulate` builds, kept for measuring after it returns (it returns only
    numbers): its `build_stages` is wrapped for the duration."""
    built: list[list[PipelineStage]] = []

    def build(manifest: Manifest) -> list[PipelineStage]:
        built.append(build_stages(manifest))
        return built[-1]

    swarm.simulate.build_stages = build
    try:
        yield built
    finally:
        swarm.simulate.build_stages = build_stages


def rms(x: torch.Tensor) -> float:
    return float(x.pow(2).mean().sqrt())


@torch.no_grad()
def boundary_makeup(head: PipelineStage, batches: list[torch.Tensor]) -> dict[str, float]:
    """What the head stage's output is made of, before its projection (if any), over `batches`."""
    captured: list[torch.Tensor] = []
    hook = head.layers[-1].register_forward_hook(lambda _module, _inputs, out: captured.append(out))
    head.eval()
    try:
        parts: dict[str, list[torch.Tensor]] = {"t_fixed": [], "t_s": [], "layers": [], "learned": []}
        kept = total = 0.0
        for tokens in batches:
            captured.clear()
            head(None, tokens)
            t_fixed, t_s = head.subspace.t_fixed[tokens], head.t_s[tokens]
            learned = captured[0] - t_fixed  # what would cross: the stage's own embedding is taken out first
            if head.stage_embedding is not None:
                learned = learned - head.stage_embedding(tokens)
            for name, value in (("t_fixed", t_fixed), ("t_s", t_s), ("layers", learned - t_s), ("learned", learned)):
                parts[name].append(value)
            kept += float(head.subspace.project(learned, axis=-1).pow(2).sum())
            total += float(learned.pow(2).sum())
    finally:
        hook.remove()
        head.train()
    out = {f"rms_{name}": rms(torch.cat(values)) for name, values in parts.items()}
    out["t_fixed_over_learned"] = out["rms_t_fixed"] / out["rms_learned"]
    out["learned_energy_in_span"] = kept / total
    return out


def train(mode: str, seed: int, args: argparse.Namespace) -> Run:
    config = CONFIGS[args.config]
    manifest = make_manifest(config, mode, args.lr, seed, args.seq_len, args.microbatch, args.microbatches,
                             args.warmup)
    _, held_out = swarm.data.load_splits(manifest, args.data, seed=seed)
    batches = held_out.fixed_batches(args.microbatch, args.val_batches)  # the windows simulate validates on
    initial = boundary_makeup(build_stages(manifest)[0], batches)
    with keeping_stages() as built:
        result = swarm.simulate.simulate(manifest, args.steps, data=args.data, seed=seed,
                                         val_batches=args.val_batches)
    return Run(
        mode=mode, seed=seed, steps=result.steps, tokens=result.tokens, val_loss_first=result.val_loss_first,
        val_loss_last=result.val_loss_last, wire_bytes_per_token=result.wire_bytes_per_token,
        max_reconstruction_error=result.max_reconstruction_error,
        max_subspace_residual=result.max_subspace_residual, seconds=result.seconds,
        boundary_init=initial, boundary_end=boundary_makeup(built[-1][0], batches),
    )


def summarise(runs: list[Run], seeds: list[int]) -> list[dict]:
    dense = {r.seed: r.val_loss_last for r in runs if r.mode == "none"}
    rows = []
    for mode in MODES:
        mine = sorted((r for r in runs if r.mode == mode and r.seed in seeds), key=lambda r: r.seed)
        if not mine:
            continue
        ratios = [r.val_loss_last / dense[r.seed] for r in mine if r.seed in dense]
        end = {key: statistics.fmean(r.boundary_end[key] for r in mine) for key in mine[0].boundary_end}
        rows.append(dict(
            mode=mode, seeds=[r.seed for r in mine], val_losses=[r.val_loss_last for r in mine],
            val_loss=mean_std([r.val_loss_last for r in mine]), ratio=mean_std(ratios),
            ratio_spread=(min(ratios), max(ratios)) if ratios else None,
            wire_bytes_per_token=statistics.fmean(r.wire_bytes_per_token for r in mine),
            max_reconstruction_error=max(r.max_reconstruction_error for r in mine),
            max_subspace_residual=max(r.max_subspace_residual for r in mine),
            boundary_end=end, boundary_init=mine[0].boundary_init,
        ))
    return rows


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    tokens = args.steps * args.microbatch * args.microbatches * args.seq_len
    lines = [
        f"{args.config}, lr {args.lr:g} for every mode, {args.steps} steps x "
        f"{args.microbatch * args.microbatches} x {args.seq_len} tokens = {tokens:,} tokens, seeds "
        f"{' '.join(map(str, args.seeds))}; ratio = paired per-seed val loss / dense (mean, [min, max]).",
        "",
        "| mode | in span(U) | crosses | wire B/token | val loss per seed | ratio to dense |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        low, high = r["ratio_spread"] or (float("nan"), float("nan"))
        ratio = "1 (reference)" if r["mode"] == "none" else f"×{r['ratio'][0]:.3f} [{low:.3f}, {high:.3f}]"
        constrained, crosses = WHAT[r["mode"]]
        lines.append(f"| {r['mode']} | {constrained} | {crosses} | {r['wire_bytes_per_token']:.1f} "
                     f"| {' / '.join(f'{v:.4f}' for v in r['val_losses'])} | {ratio} |")
    lines += [
        "",
        "The head stage's output before any projection, on the held-out windows (RMS per element; "
        "learned = x − T_fixed[tok] = T_S[tok] + layers; in span = share of the learned energy in span(U)); "
        "after training, mean over seeds (at init, seed " + str(rows[0]["seeds"][0]) + ", in brackets):",
        "",
        "| mode | RMS T_fixed | RMS T_S | RMS layers | RMS learned | T_fixed / learned | learned energy in span(U) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        end, init = r["boundary_end"], r["boundary_init"]
        cells = [f"{end[key]:.3g} ({init[key]:.3g})" for key in ("rms_t_fixed", "rms_t_s", "rms_layers",
                                                                  "rms_learned", "t_fixed_over_learned")]
        share = f"{100 * end['learned_energy_in_span']:.1f}% ({100 * init['learned_energy_in_span']:.1f}%)"
        lines.append(f"| {r['mode']} | " + " | ".join(cells) + f" | {share} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="d256k4-2x2", choices=sorted(CONFIGS),
                        help="model shape and split (default: the tiny preset's, 2 stages, k=4)")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--lr", type=float, default=1e-3, help="one learning rate for every mode")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--microbatch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=2, help="microbatches per optimizer step")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--data", default="builtin:stdlib")
    parser.add_argument("--json", dest="json_path", help="write every run here (after each run)")
    parser.add_argument("--resume", action="store_true", help="reuse finished runs found in the --json file")
    parser.add_argument("--reuse", nargs="+", default=[], metavar="JSON",
                        help="also reuse finished runs from these files (e.g. one process per seed, then one table)")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    swarm.data.read_corpus = functools.lru_cache(maxsize=4)(swarm.data.read_corpus)  # one read for every run
    done: list[Run] = []
    for path in [*args.reuse, *([args.json_path] if args.resume and args.json_path else [])]:
        saved = json.loads(Path(path).read_text()) if Path(path).exists() else None
        if saved and all(saved["args"].get(key) == getattr(args, key) for key in SETTINGS):
            done += [Run(**r) for r in saved["runs"] if r["steps"] == args.steps]
    runs: list[Run] = []
    started = time.perf_counter()
    total = len(args.seeds) * len(MODES)
    for turn, seed in enumerate(args.seeds):
        order = MODES[turn % len(MODES):] + MODES[: turn % len(MODES)]  # interleaved: load drift hits all alike
        for mode in order:
            run = next((r for r in done if (r.mode, r.seed) == (mode, seed)), None) or train(mode, seed, args)
            runs.append(run)
            if args.json_path:
                Path(args.json_path).write_text(json.dumps(dict(args=vars(args), runs=[asdict(r) for r in runs]),
                                                           indent=1))
            print(f"[{len(runs)}/{total}] {mode:<16} seed={seed}: val {run.val_loss_first:.3f} -> "
                  f"{run.val_loss_last:.4f}, wire {run.wire_bytes_per_token:.1f} B/token, "
                  f"T_fixed/learned {run.boundary_end['t_fixed_over_learned']:.3f}, {run.seconds:.0f}s | "
                  f"elapsed {fmt_duration(time.perf_counter() - started)}", flush=True)
    print()
    print(markdown(summarise(runs, args.seeds), args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
