"""The throughput table against dense, on an emulated home internet (issue 7).

    sudo python -m benchmarks.netsim.run --out benchmarks/netsim/results.json

For each mode (dense bf16, dense int8, subspace) one swarm of real peers (one per stage, each in
its own network namespace) trains while the harness sweeps every peer host's link rate from
unshaped down; dense bf16 runs first, and the sweep is extended (halving the rate) until dense
runs >= `--target-slowdown` times slower than its own unshaped speed (the paper-equivalent rate);
the other modes then run the same rates. Results go to JSON; `--report` prints the Markdown
section and `--plot` draws tokens/s vs link rate.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.netsim.delay import add_delay_arguments, link_delay
from benchmarks.netsim.harness import NetSimError, NetSwarm, cell_dict, median_cells
from benchmarks.netsim.net import cleanup_leftovers
from swarm.manifest import Manifest
from swarm.presets import preset
from tracker.summary import POLL_INTERVAL

MODES = {"dense-bf16": ("none", "bf16"), "dense-int8": ("none", "int8"), "subspace": ("subspace", "bf16"),
         "boundary": ("boundary", "bf16")}  # boundary: same messages and bytes as subspace

# A stated GPU figure: H100 SXM dense bf16 peak 989 TFLOP/s at an assumed 40% model FLOPs utilisation,
# on the paper's shape (LLaMA-3 8B, one 218M-parameter layer per stage, d=4096, bf16 on the wire).
H100_FLOPS = 989e12 * 0.40
PAPER_LAYER_PARAMS = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336
PAPER_BYTES_PER_TOKEN = 4096 * 2
PAPER_RATE_MBIT = 80.0


def code_version() -> str:
    """The commit the peers ran (they run from this checkout), or the archive's marker file."""
    root = Path(__file__).resolve().parents[2]
    marker = root / "COMMIT"
    if marker.exists():
        return marker.read_text().strip()
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "swarm", "peer"],
                               capture_output=True, text=True).stdout
    except OSError:
        return "unknown"
    return head.strip() + (" (with uncommitted changes in swarm/ or peer/)" if dirty.strip() else "")


def manifest_for(mode: str, stages: int, k: int, seed: int, target_batch: int | None = None) -> Manifest:
    """The tiny preset; `target_batch` sets the samples per optimizer epoch, and with it how often each
    stage's hivemind optimizer talks to the DHT (progress reports, matchmaking) on the shaped links."""
    compression, wire_dtype = MODES[mode]
    batch = preset("tiny").batch
    if target_batch is not None:
        batch = batch.model_copy(update={"target_batch_size": target_batch})
    return preset("tiny", stages=stages, k=k, compression=compression, wire_dtype=wire_dtype, seed=seed, batch=batch)


def measure_cpu_flops(seconds: float = 3.0, n: int = 512) -> float:
    """FLOP/s of one thread on fp32 matmuls (what one peer gets: OMP_NUM_THREADS=1)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        for _ in range(3):
            a @ b
        best, end = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            started = time.perf_counter()
            for _ in range(5):
                a @ b
            best = max(best, 5 * 2 * n**3 / (time.perf_counter() - started))
        return best
    finally:
        torch.set_num_threads(threads)


def stage_flops_per_token(manifest: Manifest) -> float:
    """6 × parameters of the widest stage's layers (forward + backward), the usual estimate."""
    shape = manifest.model
    head_dim = shape.d_model // shape.n_heads
    per_layer = (2 * shape.d_model * shape.d_model + 2 * shape.d_model * head_dim * shape.n_kv_heads
                 + 3 * shape.d_model * shape.d_ff)
    widest = max(len(manifest.layers_of(i)) for i in range(manifest.num_stages))
    return 6.0 * per_layer * widest


def equivalent_rate_mbit(manifest: Manifest, cpu_flops: float) -> float:
    """The rate here whose link-time/compute-time ratio per token equals an H100's at 80 Mbit/s.

    t_link/t_compute must match: (B_here/R_here) / (F_here/C) = (B_paper/80M) / (F_paper/G).
    """
    f_paper = 6.0 * PAPER_LAYER_PARAMS
    b_here = manifest.dense_bytes_per_token()
    return PAPER_RATE_MBIT * (b_here / PAPER_BYTES_PER_TOKEN) * (f_paper / stage_flops_per_token(manifest)) \
        * (cpu_flops / H100_FLOPS)


def sweep(mode: str, manifest: Manifest, args, rates: list[float | None], log, extend: bool,
          peer_args: tuple[str, ...] = ()) -> tuple[list, list]:
    """One swarm of `manifest` measured at every rate (`args.repeats` times); with `extend` (the baseline) the
    rates are halved past the list until this mode runs `args.target_slowdown` times slower than unshaped."""
    workdir = Path(tempfile.mkdtemp(prefix=f"netsim-{mode}-"))
    swarm = NetSwarm(manifest, workdir, max_inflight=args.max_inflight, log=log, records_interval=args.records_interval,
                     peer_args=peer_args, delay=link_delay(args))
    cells = []
    try:
        log(f"{mode}: run {manifest.run_id}, starting {len(swarm.slots())} peers in namespaces {swarm.topology.tag}-*")
        swarm.start()
        swarm.wait_training(trips=args.warmup_trips)
        for repeat in range(args.repeats):
            for rate in list(rates):  # the baseline's extension appends to `rates`: measured there, once
                cells.append(swarm.measure(mode, rate, repeat, min_window=args.window, max_window=args.max_window,
                                           min_trips=args.min_trips))
                if extend and repeat == 0 and rate == rates[-1]:
                    unshaped = next(c.tokens_per_s for c in cells if c.rate_mbit is None)
                    while (cells[-1].tokens_per_s * args.target_slowdown > unshaped
                           and rates[-1] is not None and rates[-1] / 2 >= args.min_rate):
                        rates.append(rates[-1] / 2)
                        log(f"  {mode} is only {unshaped / max(cells[-1].tokens_per_s, 1e-9):.1f}x slower: "
                            f"adding {rates[-1]:g} Mbit/s")
                        cells.append(swarm.measure(mode, rates[-1], repeat, min_window=args.window,
                                                   max_window=args.max_window, min_trips=args.min_trips))
    except NetSimError as exc:
        log(f"{mode}: FAILED: {exc}")
        raise
    finally:
        trace = swarm.loss_trace()
        swarm.stop()
        log(f"{mode}: stopped; logs in {workdir}")
    return cells, trace


def loss_at(trace: list, tokens: int) -> float | None:
    """Mean of the driver's reported losses over the last 20% of tokens before `tokens`."""
    window = [loss for n, loss in trace if 0.8 * tokens <= n <= tokens]
    return statistics.mean(window) if window else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="dense-bf16,dense-int8,subspace")
    parser.add_argument("--rates", default="unshaped,1000,80,20,5,2,1",
                        help="link rates in Mbit/s per host and direction, 'unshaped' for none")
    parser.add_argument("--extend", action=argparse.BooleanOptionalAction, default=True,
                        help="halve the rate after the list until dense is --target-slowdown times slower")
    parser.add_argument("--target-slowdown", type=float, default=16.0)
    parser.add_argument("--min-rate", type=float, default=0.05)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--k", type=int, default=2, help="subspace width (tiny preset: d=256)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-batch", type=int, help="samples per optimizer epoch (tiny preset: 16)")
    parser.add_argument("--max-inflight", type=int, default=4)
    parser.add_argument("--window", type=float, default=40.0, help="minimum seconds measured per cell")
    parser.add_argument("--max-window", type=float, default=150.0)
    parser.add_argument("--min-trips", type=int, default=6, help="minimum driver trips per cell")
    parser.add_argument("--warmup-trips", type=int, default=4)
    parser.add_argument("--records-interval", type=float, default=POLL_INTERVAL,
                        help="seconds between the bootstrap's reads of the stage records (default: the tracker's poll)")
    parser.add_argument("--repeats", type=int, default=1, help="sweeps per mode (the same swarm); median per cell")
    add_delay_arguments(parser)
    parser.add_argument("--out", default="benchmarks/netsim/results.json")
    parser.add_argument("--plot", help="PNG path for tokens/s vs link rate")
    parser.add_argument("--report", action="store_true", help="print the Markdown section from --out and exit")
    parser.add_argument("--merge", nargs="*", default=[], metavar="JSON",
                        help="with --report: add the cells of further runs (same settings) as more repeats")
    args = parser.parse_args(argv)

    if args.report:
        data = json.loads(Path(args.out).read_text())
        data = merge_runs(data, [json.loads(Path(p).read_text()) for p in args.merge])
        if args.plot:
            plot(data, args.plot)
        print(report(data))
        return 0

    def on_term(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    removed = cleanup_leftovers()
    if removed:
        print(f"removed leftover namespaces: {' '.join(removed)}", file=sys.stderr)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    rates: list[float | None] = [None if r == "unshaped" else float(r) for r in args.rates.split(",")]
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    cpu_flops = measure_cpu_flops()
    log(f"CPU: {cpu_flops / 1e9:.1f} GFLOP/s on one thread (fp32 matmul)")
    data = {"command": " ".join(["python -m benchmarks.netsim.run", *(argv or sys.argv[1:])]),
            "stages": args.stages, "k": args.k, "max_inflight": args.max_inflight, "repeats": args.repeats,
            "records_interval": args.records_interval,
            "delay_ms": args.delay_ms, "jitter_ms": args.jitter_ms, "loss": args.loss,
            "cpu_flops": cpu_flops, "cells": [], "loss_traces": {}, "manifests": {}, "code": code_version()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        for mode in modes:
            manifest = manifest_for(mode, args.stages, args.k, args.seed, args.target_batch)
            data["manifests"][mode] = {"run_id": manifest.run_id, "d_model": manifest.model.d_model, "k": manifest.k,
                                       "compression": manifest.compression, "wire_dtype": manifest.wire_dtype,
                                       "microbatch": manifest.batch.microbatch_size, "seq_len": manifest.batch.seq_len,
                                       "target_batch": manifest.batch.target_batch_size,
                                       "per_direction_bytes": manifest.compressed_bytes_per_token(),
                                       "flops_per_token_stage": stage_flops_per_token(manifest),
                                       "equivalent_rate_mbit": equivalent_rate_mbit(manifest, cpu_flops)}
            cells, trace = sweep(mode, manifest, args, rates, log, extend=args.extend and mode == "dense-bf16")
            data["cells"] += [cell_dict(c) for c in cells]
            data["loss_traces"][mode] = trace
            data["rates"] = rates
            out.write_text(json.dumps(data, indent=1))
    except KeyboardInterrupt:
        log("interrupted; everything stopped and removed")
        return 130
    finally:
        leftovers = cleanup_leftovers()
        if leftovers:
            log(f"removed leftover namespaces: {' '.join(leftovers)}")
    if args.plot:
        plot(data, args.plot)
    print(report(data))
    return 0


# --- reporting ---------------------------------------------------------------------------------------


def merge_runs(data: dict, others: list[dict]) -> dict:
    """Cells of further runs become further repeats; their loss traces and CPU figures are kept too."""
    merged = {**data, "cells": list(data["cells"]), "runs": 1 + len(others),
              "cpu_flops_all": [data["cpu_flops"]], "commands": [data["command"]]}
    offset = 1 + max((c["repeat"] for c in data["cells"]), default=0)
    for other in others:
        merged["cells"] += [{**c, "repeat": c["repeat"] + offset} for c in other["cells"]]
        offset += 1 + max((c["repeat"] for c in other["cells"]), default=0)
        merged["cpu_flops_all"].append(other["cpu_flops"])
        merged["commands"].append(other["command"])
    return merged


def _rows(data: dict) -> dict:
    from benchmarks.netsim.harness import Cell

    return median_cells([Cell(**c) for c in data["cells"]])


def paper_equivalent_rate(rows: dict, target: float = 16.0) -> float | None:
    base = rows.get(("dense-bf16", None))
    if base is None:
        return None
    shaped = sorted((r for (m, r) in rows if m == "dense-bf16" and r is not None), reverse=True)
    for rate in shaped:
        if rows[("dense-bf16", rate)]["tokens_per_s"] * target <= base["tokens_per_s"]:
            return rate
    return None


def report(data: dict) -> str:
    rows = _rows(data)
    modes = [m for m in MODES if any(key[0] == m for key in rows)]
    rates = data.get("rates") or sorted({r for (_, r) in rows}, key=lambda r: -math.inf if r is None else -r)
    lines = []
    label = {None: "unshaped"}
    head = "| link (per host, each way) | " + " | ".join(f"{m} tok/s" for m in modes)
    ratio_modes = [m for m in modes if m != "dense-bf16"]
    head += "".join(f" | {m} / dense" for m in ratio_modes) + " |"
    lines += [head, "|" + "---|" * (1 + len(modes) + len(ratio_modes))]
    for rate in rates:
        cells = [rows.get((m, rate)) for m in modes]
        text = [f"{c['tokens_per_s']:.0f}" if c else "—" for c in cells]
        dense = rows.get(("dense-bf16", rate))
        ratios = []
        for m in ratio_modes:
            c = rows.get((m, rate))
            ratios.append(f"{c['tokens_per_s'] / dense['tokens_per_s']:.2f}×" if c and dense and dense["tokens_per_s"]
                          else "—")
        name = label[rate] if rate is None else f"{rate:g} Mbit/s"
        lines.append(f"| {name} | " + " | ".join(text + ratios) + " |")
    lines.append("")
    lines.append("| mode | wire bytes/token at the driver (both directions, measured) | theory (2 × per-direction "
                 "payload + ids) | on the links, all hosts' uploads per token (median over cells) | loss at "
                 "common token count |")
    lines.append("|---|---|---|---|---|")
    common = min((max((n for n, _ in trace), default=0) for trace in data["loss_traces"].values()), default=0)
    for m in modes:
        info = data["manifests"][m]
        d, k = info["d_model"], info["k"]
        if info["compression"] == "none":
            theory = 2 * info["per_direction_bytes"] + 1
        else:
            theory = 2 * 2 * k + 1  # k bf16 each way, 1-byte ids forward
        app = statistics.median(c["app_bytes_per_token"] for c in rows.values() if c["mode"] == m)
        veth = statistics.median(c["veth_bytes_per_token"] for c in rows.values() if c["mode"] == m
                                 and c["rate_mbit"] is not None)
        loss = loss_at(data["loss_traces"][m], common)
        lines.append(f"| {m} (d={d}{'' if info['compression'] == 'none' else f', k={k}'}, {info['wire_dtype']}) | "
                     f"{app:.2f} | {theory} | {veth:.1f} | {'—' if loss is None else f'{loss:.3f}'} |")
    lines.append(f"\nLoss: the driver's mean reported loss over the 20% of tokens before {common} tokens "
                 "(the fewest any mode trained).")
    peq = paper_equivalent_rate(rows)
    if peq is not None:
        lines.append(f"\nPaper-equivalent rate (dense bf16 ≥ 16× slower than unshaped): **{peq:g} Mbit/s**.")
        for m in modes:
            base, at = rows.get((m, None)), rows.get((m, peq))
            if base and at:
                lines.append(f"- {m}: {at['tokens_per_s']:.0f} tok/s at {peq:g} Mbit/s = "
                             f"{100 * at['tokens_per_s'] / base['tokens_per_s']:.0f}% of its unshaped "
                             f"{base['tokens_per_s']:.0f} tok/s")
    else:
        lines.append("\nDense bf16 never reached 16× slower than unshaped in this sweep.")
    info = data["manifests"].get("dense-bf16") or next(iter(data["manifests"].values()))
    lines.append(f"\nCPU: {data['cpu_flops'] / 1e9:.1f} GFLOP/s per thread (fp32 512² matmul, best of 3 s). "
                 f"With an H100 at {H100_FLOPS / 1e12:.0f} TFLOP/s (989 bf16 peak × 40% MFU) on the paper's shape "
                 f"(one LLaMA-3-8B layer per stage, {6 * PAPER_LAYER_PARAMS / 1e9:.2f} GFLOP and "
                 f"{PAPER_BYTES_PER_TOKEN} bytes per token per boundary and direction), 80 Mbit/s there has the "
                 f"same link-time / compute-time ratio as **{info['equivalent_rate_mbit'] * 1000:.1f} kbit/s** here "
                 f"({info['flops_per_token_stage'] / 1e6:.1f} MFLOP and {info['per_direction_bytes']} bytes per token "
                 "per stage and direction).")
    base = rows.get(("dense-bf16", None))
    if base:
        achieved = base["tokens_per_s"] * info["flops_per_token_stage"]
        scaled = info["equivalent_rate_mbit"] * achieved / data["cpu_flops"]
        lines.append(f"With what the widest stage actually achieved in the unshaped dense pipeline "
                     f"({achieved / 1e9:.1f} GFLOP/s = {base['tokens_per_s']:.0f} tok/s × "
                     f"{info['flops_per_token_stage'] / 1e6:.1f} MFLOP, on shared cores) the same ratio gives "
                     f"**{scaled * 1000:.1f} kbit/s**.")
    return "\n".join(lines)


def plot(data: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _rows(data)
    shaped = sorted({r for (_, r) in rows if r is not None})
    top = max(shaped) * 4 if shaped else 1.0
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in MODES:
        points = sorted((top if r is None else r, c["tokens_per_s"]) for (mm, r), c in rows.items() if mm == m)
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=m)
    peq = paper_equivalent_rate(rows)
    if peq:
        ax.axvline(peq, color="grey", linestyle="--", label=f"paper-equivalent {peq:g} Mbit/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link rate per host and direction (Mbit/s); rightmost point: unshaped")
    ax.set_ylabel("trained tokens/s")
    ax.set_title(f"{data['stages']} stages × 1 peer, tiny (d=256), k={data['k']}, in flight {data['max_inflight']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
