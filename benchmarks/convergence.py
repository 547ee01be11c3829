"""Dense vs subspace vs boundary compression: convergence, wire bytes and step time.

Every run trains the same model shape on the same corpus with the same tokens (for one seed,
every mode sees the same batches in the same order and is validated on the same held-out
windows), so validation losses are compared at equal tokens. The seed sets the model
initialisation, `U`, `T_fixed` and the batch order.

Learning rate: a small sweep per mode on seed 0 (on the first config of each (d, k) width),
then every mode uses its own best learning rate for the seeded comparison, so that no mode is
judged against a mistuned baseline (DESIGN.md §2.8).

    python benchmarks/convergence.py [--steps N] [--seeds 0 1 2] [--configs ...] [--lrs ...]
                                     [--threads 1] [--json out.json]

Prints one progress line per run (with an ETA) and a markdown table at the end.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lr_sweep  # noqa: E402

import swarm.data  # noqa: E402
from swarm.manifest import BatchSpec, Manifest, OptimizerSpec  # noqa: E402
from swarm.model import build_stages  # noqa: E402
from swarm.optim import clip_grad_norm, make_optimizer  # noqa: E402
from swarm.presets import preset  # noqa: E402
from swarm.simulate import run_trip, simulate  # noqa: E402

MODES = ("none", "subspace", "boundary")
BATCH_ARGS = ("seq_len", "microbatch", "microbatches", "warmup", "data")


@dataclass(frozen=True)
class Config:
    name: str
    d_model: int
    k: int
    stages: int
    n_layers: int = 4
    d_ff: int | None = None

    @property
    def ratio(self) -> float:
        return self.d_model / self.k

    @property
    def width(self) -> tuple[int, int]:
        """Configs of one width share the learning-rate sweep."""
        return (self.d_model, self.k)

    @property
    def split(self) -> str:
        per = self.n_layers // self.stages
        return f"{self.stages} stages x {per} layer{'s' if per > 1 else ''}"


CONFIGS = {
    c.name: c
    for c in (
        Config("d256k4-4x1", 256, 4, stages=4),  # d/k = 64, the tiny preset's width
        Config("d256k4-2x2", 256, 4, stages=2),
        Config("d256k2-4x1", 256, 2, stages=4),  # d/k = 128
        Config("d256k2-2x2", 256, 2, stages=2),
        Config("d512k5-4x1", 512, 5, stages=4, d_ff=1376),  # d/k = 102, slower: not in the default set
        Config("d512k5-2x2", 512, 5, stages=2, d_ff=1376),
    )
}
DEFAULT_CONFIGS = ("d256k4-4x1", "d256k4-2x2", "d256k2-4x1", "d256k2-2x2")


def make_manifest(config: Config, mode: str, lr: float, seed: int, seq_len: int, microbatch: int,
                  microbatches: int, warmup: int) -> Manifest:
    base = preset("tiny")
    shape = base.model.model_copy(update=dict(
        d_model=config.d_model, n_layers=config.n_layers, d_ff=config.d_ff or base.model.d_ff,
        n_heads=max(4, config.d_model // 64), n_kv_heads=max(2, config.d_model // 128),
    ))
    return preset(
        "tiny",
        model=shape,
        k=config.k,
        stages=config.stages,
        compression=mode,
        seed=seed,
        batch=BatchSpec(microbatch_size=microbatch, seq_len=seq_len,
                        target_batch_size=microbatch * microbatches),
        optimizer=OptimizerSpec(lr=lr, warmup_steps=warmup),
    )


@dataclass
class Run:
    config: str
    mode: str
    lr: float
    seed: int
    purpose: str  # "sweep" (seed 0, every lr) or "seed" (best lr, other seeds)
    steps: int
    tokens: int
    val_loss_first: float
    val_loss_last: float
    train_loss_last: float
    wire_bytes_per_token: float
    dense_wire_bytes_per_token: float
    step_seconds: float
    optimizer_seconds: float
    max_reconstruction_error: float
    max_subspace_residual: float
    seconds: float


def mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def fmt_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s"


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.runs: list[Run] = []
        self.started = time.perf_counter()
        self.steps_done = 0
        self.run_seconds = 0.0
        self.total_runs = 0
        self.total_steps = 0
        self.resumed: list[Run] = []
        if (args.resume or args.report_only) and args.json_path and Path(args.json_path).exists():
            saved = json.loads(Path(args.json_path).read_text())
            same = all(saved["args"].get(key) == getattr(args, key) for key in BATCH_ARGS)
            self.resumed = [Run(**r) for r in saved["runs"]] if same else []

    def save(self, **extra) -> None:
        if self.args.json_path:
            Path(self.args.json_path).write_text(json.dumps(
                dict(args=vars(self.args), runs=[asdict(r) for r in self.runs + self.resumed], **extra), indent=1))

    def plan(self, configs: list[Config], swept_modes: int) -> None:
        widths = {c.width for c in configs} if swept_modes else set()
        sweep_runs = len(widths) * swept_modes * len(self.args.lrs)
        other_seeds = [s for s in self.args.seeds if s != self.args.sweep_seed]
        seeded_runs = len(configs) * len(MODES) * len(other_seeds)
        if self.args.sweep_seed in self.args.seeds:
            seeded_runs += len(configs) * len(MODES) - len(widths) * swept_modes
        self.total_runs = sweep_runs + seeded_runs
        self.total_steps = self.total_runs * self.args.steps

    def run(self, config: Config, mode: str, lr: float, seed: int, purpose: str) -> Run | None:
        a = self.args
        for done in self.resumed:
            if (done.config, done.mode, done.lr, done.seed, done.steps) == (config.name, mode, lr, seed, a.steps):
                self.resumed.remove(done)
                done.purpose = purpose
                self.runs.append(done)
                self.total_steps -= a.steps
                print(f"[{len(self.runs):>3}/{self.total_runs}] {config.name} {mode:<8} lr={lr:.0e} seed={seed} "
                      f"({purpose}): val {done.val_loss_last:.4f} (resumed from {a.json_path})", flush=True)
                return done
        if a.report_only:
            return None
        manifest = make_manifest(config, mode, lr, seed, a.seq_len, a.microbatch, a.microbatches, a.warmup)
        tick = time.perf_counter()
        result = simulate(manifest, a.steps, data=a.data, seed=seed)
        self.run_seconds += time.perf_counter() - tick
        run = Run(
            config=config.name, mode=mode, lr=lr, seed=seed, purpose=purpose, steps=result.steps,
            tokens=result.tokens, val_loss_first=result.val_loss_first, val_loss_last=result.val_loss_last,
            train_loss_last=statistics.fmean(result.train_loss[-10:]),
            wire_bytes_per_token=result.wire_bytes_per_token,
            dense_wire_bytes_per_token=result.dense_wire_bytes_per_token,
            step_seconds=result.step_seconds, optimizer_seconds=result.optimizer_seconds,
            max_reconstruction_error=result.max_reconstruction_error,
            max_subspace_residual=result.max_subspace_residual, seconds=result.seconds,
        )
        self.runs.append(run)
        self.save()
        self.steps_done += a.steps
        elapsed = time.perf_counter() - self.started
        eta = self.run_seconds / self.steps_done * (self.total_steps - self.steps_done)
        print(
            f"[{len(self.runs):>3}/{self.total_runs}] {config.name} {mode:<8} lr={lr:.0e} "
            f"seed={seed} ({purpose}): "
            f"val {run.val_loss_first:.3f} -> {run.val_loss_last:.4f}, step {run.step_seconds:.3f}s "
            f"(opt {run.optimizer_seconds:.3f}s), wire {run.wire_bytes_per_token:.1f} B/tok | "
            f"elapsed {fmt_duration(elapsed)}, ETA {fmt_duration(eta)}",
            flush=True,
        )
        return run


def interleaved_timing(config: Config, args: argparse.Namespace, lrs: dict[str, float]) -> dict[str, dict]:
    """Median step and optimizer time per mode, the modes taking turns step by step.

    On a shared machine the load drifts over minutes; alternating the modes every step exposes
    them to the same load, and the median drops steps that a burst of other work slowed down.
    """
    torch.manual_seed(0)
    setups = {}
    for mode in MODES:
        manifest = make_manifest(config, mode, lrs.get(mode, 1e-3), 0, args.seq_len, args.microbatch,
                                 args.microbatches, args.warmup)
        stages = build_stages(manifest)
        train, _ = swarm.data.load_splits(manifest, args.data, seed=0)
        setups[mode] = (manifest, stages, [make_optimizer(s) for s in stages], train, [], [])
    for step in range(args.timing_steps + 3):  # 3 warm-up steps are not counted
        order = MODES[step % 3:] + MODES[: step % 3]
        for mode in order:
            manifest, stages, optimizers, train, step_times, opt_times = setups[mode]
            tick = time.perf_counter()
            for _ in range(args.microbatches):
                run_trip(stages, train.batch(args.microbatch), loss_scale=1.0 / args.microbatches)
            opt_tick = time.perf_counter()
            for stage, optimizer in zip(stages, optimizers, strict=True):
                clip_grad_norm(stage.parameters(), manifest.optimizer.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            done = time.perf_counter()
            if step >= 3:
                step_times.append(done - tick)
                opt_times.append(done - opt_tick)
    out = {}
    for mode, (*_, step_times, opt_times) in setups.items():
        out[mode] = dict(step=statistics.median(step_times), optimizer=statistics.median(opt_times))
    dense = out["none"]
    for mode in MODES:
        out[mode]["step_overhead"] = out[mode]["step"] / dense["step"] - 1
        out[mode]["optimizer_overhead"] = (out[mode]["optimizer"] - dense["optimizer"]) / dense["step"]
    return out


def timing_markdown(timings: dict[str, dict], args: argparse.Namespace) -> str:
    lines = [
        f"Interleaved step timing ({args.timing_steps} steps per mode, modes alternating every step, median):",
        "",
        "| config | mode | step s | Δ step vs dense | optimizer s | optimizer share | Δ optimizer vs dense "
        "(as % of dense step) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, per_mode in timings.items():
        for mode, t in per_mode.items():
            dense = mode == "none"
            step_gap = "—" if dense else f"{100 * t['step_overhead']:+.1f}%"
            opt_gap = "—" if dense else f"{100 * t['optimizer_overhead']:+.2f}%"
            lines.append(f"| {name} | {mode} | {t['step']:.3f} | {step_gap} | {t['optimizer']:.4f} "
                         f"| {100 * t['optimizer'] / t['step']:.1f}% | {opt_gap} |")
    return "\n".join(lines)


def find(runs: list[Run], **match) -> list[Run]:
    return [r for r in runs if all(getattr(r, key) == value for key, value in match.items())]


def summarise(runs: list[Run], configs: list[Config], best_lr: dict, seeds: list[int]) -> list[dict]:
    rows = []
    for config in configs:
        dense_by_seed = {r.seed: r for r in runs if r.config == config.name and r.mode == "none"
                         and r.lr == best_lr[(config.width, "none")] and r.seed in seeds}
        dense_steps = [r.step_seconds for r in find(runs, config=config.name, mode="none")]
        for mode in MODES:
            lr = best_lr[(config.width, mode)]
            chosen = [r for r in find(runs, config=config.name, mode=mode, lr=lr) if r.seed in seeds]
            chosen.sort(key=lambda r: r.seed)
            # timing does not depend on the learning rate: use every run of this config and mode
            timed = find(runs, config=config.name, mode=mode)
            val = mean_std([r.val_loss_last for r in chosen])
            gap = mean_std([r.val_loss_last / dense_by_seed[r.seed].val_loss_last - 1
                            for r in chosen if r.seed in dense_by_seed])
            wire = mean_std([r.wire_bytes_per_token for r in chosen])
            dense_wire = chosen[0].dense_wire_bytes_per_token if chosen else math.nan
            step = mean_std([r.step_seconds for r in timed])
            opt_share = mean_std([r.optimizer_seconds / r.step_seconds for r in timed])
            rows.append(dict(
                config=config.name, split=config.split, d=config.d_model, k=config.k, ratio=config.ratio,
                mode=mode, lr=lr, seeds=[r.seed for r in chosen], val_loss=val, val_gap_vs_dense=gap,
                val_losses=[r.val_loss_last for r in chosen], wire_bytes_per_token=wire,
                wire_percent_of_dense_bf16=100 * wire[0] / dense_wire, dense_wire_bytes_per_token=dense_wire,
                step_seconds=step, step_overhead_vs_dense=step[0] / statistics.fmean(dense_steps) - 1,
                # the fastest run is the least disturbed by other load on a shared machine
                step_seconds_min=min(r.step_seconds for r in timed),
                step_overhead_min_vs_dense=min(r.step_seconds for r in timed) / min(dense_steps) - 1,
                optimizer_share=opt_share, timed_runs=len(timed),
                max_reconstruction_error=max((r.max_reconstruction_error for r in chosen), default=math.nan),
                max_subspace_residual=max((r.max_subspace_residual for r in chosen), default=math.nan),
            ))
    return rows


def markdown(rows: list[dict], sweep: dict, lrs: list[float], args: argparse.Namespace) -> str:
    lines = [
        f"Validation loss after {args.steps} steps x {args.microbatch * args.microbatches} sequences x "
        f"{args.seq_len} tokens (equal tokens in every mode), mean ± std over seeds "
        f"{' '.join(map(str, args.seeds))}; Δ val is the paired per-seed ratio to dense. Step time and "
        "optimizer share (optimizer_seconds / step_seconds): mean ± std over every run of that config and "
        "mode (sweep runs included); min step s is the fastest such run.",
        "",
        "| config | d/k | mode | lr | val loss | Δ val vs dense | wire B/token | % of dense bf16 "
        "| step s | Δ step vs dense | min step s | Δ min step vs dense | optimizer share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gap_mean, gap_std = r["val_gap_vs_dense"]
        gap = "—" if r["mode"] == "none" else f"{100 * gap_mean:+.1f}% ± {100 * gap_std:.1f}"
        step_gap = "—" if r["mode"] == "none" else f"{100 * r['step_overhead_vs_dense']:+.1f}%"
        min_gap = "—" if r["mode"] == "none" else f"{100 * r['step_overhead_min_vs_dense']:+.1f}%"
        lines.append(
            f"| {r['config']} ({r['split']}) | {r['ratio']:.0f} | {r['mode']} | {r['lr']:.0e} "
            f"| {r['val_loss'][0]:.4f} ± {r['val_loss'][1]:.4f} | {gap} "
            f"| {r['wire_bytes_per_token'][0]:.1f} | {r['wire_percent_of_dense_bf16']:.2f}% "
            f"| {r['step_seconds'][0]:.3f} ± {r['step_seconds'][1]:.3f} | {step_gap} "
            f"| {r['step_seconds_min']:.3f} | {min_gap} "
            f"| {100 * r['optimizer_share'][0]:.1f}% ± {100 * r['optimizer_share'][1]:.1f} |"
        )
    if not sweep:
        return "\n".join(lines + ["", f"Learning rates fixed with --lr {' '.join(args.lr)} (no sweep in this run)."])
    lines += [
        "",
        f"Learning-rate sweep (seed {args.sweep_seed}, validation loss; best per mode in bold):",
        "",
        "| width (sweep config) | mode | " + " | ".join(f"lr {lr:.0e}" for lr in lrs) + " |",
        "|---|---|" + "---|" * len(lrs),
    ]
    for (config_name, mode), losses in sweep.items():
        best = min(losses.values())
        cells = [f"**{losses[lr]:.4f}**" if losses[lr] == best else f"{losses[lr]:.4f}" for lr in lrs]
        lines.append(f"| {config_name} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), choices=sorted(CONFIGS))
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 2e-3, 4e-3],
                        help="learning rates swept per mode on --sweep-seed")
    parser.add_argument("--sweep-seed", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--microbatch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=2, help="microbatches per optimizer step")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--data", default="builtin:stdlib")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", dest="json_path", help="write every run and the summary here (after each run)")
    parser.add_argument("--resume", action="store_true", help="reuse finished runs found in the --json file")
    parser.add_argument("--timing-steps", type=int, default=40,
                        help="steps per mode of the interleaved timing after the runs (0: skip)")
    parser.add_argument("--timing-only", action="store_true", help="run only the interleaved timing")
    parser.add_argument("--report-only", action="store_true",
                        help="print the table from the runs in the --json file, run nothing")
    parser.add_argument("--lr", nargs="+", default=[], metavar="MODE=LR",
                        help="fix a mode's learning rate instead of sweeping it, e.g. none=1e-3")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    # every run reads the same corpus: read it once
    swarm.data.read_corpus = functools.lru_cache(maxsize=4)(swarm.data.read_corpus)
    configs = [CONFIGS[name] for name in args.configs]
    fixed = {mode: float(lr) for mode, lr in (item.split("=", 1) for item in args.lr)}
    if unknown := set(fixed) - set(MODES):
        parser.error(f"--lr: unknown mode(s) {', '.join(sorted(unknown))}; modes are {', '.join(MODES)}")
    swept_modes = [mode for mode in MODES if mode not in fixed]
    if args.timing_only:
        timings = {c.name: interleaved_timing(c, args, fixed) for c in configs}
        print(timing_markdown(timings, args))
        if args.json_path:
            Path(args.json_path).write_text(json.dumps(dict(args=vars(args), timing=timings), indent=1))
        return 0
    bench = Bench(args)
    bench.plan(configs, len(swept_modes))
    print(f"{bench.total_runs} runs x {args.steps} steps, threads={args.threads}, data={args.data}",
          flush=True)

    best_lr: dict[tuple, float] = {}
    sweep: dict[tuple[str, str], dict[float, float]] = {}
    swept_widths: set[tuple[int, int]] = set()
    for config in configs:
        for mode, lr in fixed.items():
            best_lr[(config.width, mode)] = lr
        if config.width not in swept_widths and swept_modes:
            swept_widths.add(config.width)
            for lr in args.lrs:
                for mode in swept_modes:  # modes interleaved, so machine load affects them alike
                    run = bench.run(config, mode, lr, args.sweep_seed, "sweep")
                    if run is not None:
                        sweep.setdefault((config.name, mode), {})[lr] = run.val_loss_last
            for mode in swept_modes:
                losses = sweep.get((config.name, mode)) or {math.nan: math.nan}
                best_lr[(config.width, mode)] = lr_sweep.best_lr({lr: [loss] for lr, loss in losses.items()})
        for seed in args.seeds:
            for mode in MODES:
                lr = best_lr[(config.width, mode)]
                if not find(bench.runs, config=config.name, mode=mode, lr=lr, seed=seed):
                    bench.run(config, mode, lr, seed, "seed")

    # with --report-only, configs with a mode that has no run yet are left out of the table
    configs = [c for c in configs if all(find(bench.runs, config=c.name, mode=m) for m in MODES)]
    rows = summarise(bench.runs, configs, best_lr, args.seeds)
    table = markdown(rows, sweep, args.lrs, args)
    print()
    print(table)
    print(f"\ntotal {fmt_duration(time.perf_counter() - bench.started)}")
    if args.report_only or not args.timing_steps:
        return 0
    timings = {c.name: interleaved_timing(c, args, best) for c in configs
               for best in [{mode: best_lr[(c.width, mode)] for mode in MODES}]}
    print()
    print(timing_markdown(timings, args))
    bench.save(summary=rows, timing=timings, best_lr={f"{d}x{k}:{mode}": lr for ((d, k), mode), lr in best_lr.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
