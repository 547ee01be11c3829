"""Context parallelism on an emulated home internet (issue 17): dense K/V vs compressed K/V between lanes.

    sudo OMP_NUM_THREADS=1 python -m benchmarks.netsim.cp --stages 1 --lanes 2 --out benchmarks/netsim/cp-p2.json

One swarm per mode, every (stage, lane) peer on its own host whose link is shaped in both directions
(`benchmarks/netsim/net.py`). `cp-dense` sends every lane's K/V in full (bf16), `cp-subspace` the
default compressed messages (remote variant, rotation mixture); the pipeline boundary is the preset's
in both. The dense sweep runs first and halves the rate past the list until dense runs
`--target-slowdown` (16) times slower than its own unshaped speed: that is the regime-scaled rate, where
the paper's 300 Mbit/s puts its dense CP (2.7K vs 55K tokens/s unshaped). The compressed swarm then runs
the same rates. `--report` prints the Markdown section from `--out`.

Per host, lane c uploads its K/V forward to the P-1-c later lanes and the gradients of what it received
backward to the c earlier ones: (P-1)/P of one message per token per layer, whatever c is, so the busiest
uplink carries (P-1)/P * m * L bytes per token (m: one token's K/V message, L: layers per stage), the
formula the report sets the links against. Peers accept streams down to `--min-stream-kbit` (the default
1 Mbit/s would cut dense K/V streams on these links before they degrade).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from benchmarks.netsim.delay import add_delay_arguments
from benchmarks.netsim.harness import NetSimError, cell_dict, median_cells
from benchmarks.netsim.net import cleanup_leftovers
from benchmarks.netsim.run import code_version, measure_cpu_flops, sweep
from swarm.manifest import Manifest
from swarm.presets import preset
from tracker.summary import POLL_INTERVAL

MODES = {"cp-dense": "none", "cp-subspace": "subspace"}  # context_parallel.compression


def manifest_for(mode: str, stages: int, lanes: int, seed: int) -> Manifest:
    return preset("tiny", stages=stages, seed=seed, context_parallel={"size": lanes, "compression": MODES[mode]})


def formula(manifest: Manifest) -> dict:
    """Payload bytes per driver token: K/V over all lanes and layers (both directions), and on one lane's uplink."""
    spec, shape = manifest.context_parallel, manifest.model
    kind = "compressed" if spec.compressed else "dense"
    per_layer = spec.payload_bytes_per_token(shape, manifest.batch.seq_len)[kind]
    message = per_layer / ((spec.size - 1) / 2)  # one token's message
    layers = max(len(manifest.layers_of(s)) for s in range(manifest.num_stages))
    return {"kv_all": 2 * per_layer * shape.n_layers, "message_per_token": message, "layers_per_stage": layers,
            "kv_per_lane_uplink": (spec.size - 1) / spec.size * message * layers}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="cp-dense,cp-subspace")
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--lanes", type=int, default=2, help="context_parallel.size P")
    parser.add_argument("--rates", default="unshaped,8,2,1,0.5",
                        help="link rates in Mbit/s per host and direction, 'unshaped' for none")
    parser.add_argument("--extend", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--target-slowdown", type=float, default=16.0)
    parser.add_argument("--min-rate", type=float, default=0.03)
    parser.add_argument("--min-stream-kbit", type=float, default=16.0, help="passed to every peer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-inflight", type=int, default=2, help="trips each stage-0 lane drives at once")
    parser.add_argument("--window", type=float, default=40.0)
    parser.add_argument("--max-window", type=float, default=150.0)
    parser.add_argument("--min-trips", type=int, default=4)
    parser.add_argument("--warmup-trips", type=int, default=4)
    parser.add_argument("--records-interval", type=float, default=POLL_INTERVAL)
    parser.add_argument("--repeats", type=int, default=1)
    add_delay_arguments(parser)
    parser.add_argument("--out", default="benchmarks/netsim/cp.json")
    parser.add_argument("--report", action="store_true", help="print the Markdown section from --out and exit")
    args = parser.parse_args(argv)
    if args.report:
        print(report(json.loads(Path(args.out).read_text())))
        return 0

    def on_term(*_):
        raise KeyboardInterrupt

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, on_term)
    cleanup_leftovers()
    rates: list[float | None] = [None if r == "unshaped" else float(r) for r in args.rates.split(",")]
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        parser.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    data = {"command": " ".join(["python -m benchmarks.netsim.cp", *(argv or sys.argv[1:])]), "stages": args.stages,
            "lanes": args.lanes, "max_inflight": args.max_inflight, "min_stream_kbit": args.min_stream_kbit,
            "delay_ms": args.delay_ms, "jitter_ms": args.jitter_ms, "loss": args.loss,
            "cpu_flops": measure_cpu_flops(), "cells": [], "loss_traces": {}, "manifests": {}, "code": code_version()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    peer_args = ("--min-stream-kbit", str(args.min_stream_kbit))
    try:
        for mode in modes:
            manifest = manifest_for(mode, args.stages, args.lanes, args.seed)
            data["manifests"][mode] = {"run_id": manifest.run_id, "d_model": manifest.model.d_model,
                                       "seq_len": manifest.batch.seq_len, "microbatch": manifest.batch.microbatch_size,
                                       "boundary": manifest.compression, "k": manifest.k,
                                       "r_k": manifest.context_parallel.r_k, "r_v": manifest.context_parallel.r_v,
                                       **formula(manifest)}
            cells, trace = sweep(mode, manifest, args, rates, log, extend=args.extend and mode == modes[0],
                                 peer_args=peer_args)
            data["cells"] += [cell_dict(c) for c in cells]
            data["loss_traces"][mode] = trace
            data["rates"] = rates
            out.write_text(json.dumps(data, indent=1))
    except (KeyboardInterrupt, NetSimError) as exc:
        log(f"stopped: {exc or 'interrupted'}; everything stopped and removed")
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        cleanup_leftovers()
    print(report(data))
    return 0


def report(data: dict) -> str:
    from benchmarks.netsim.harness import Cell

    rows = median_cells([Cell(**c) for c in data["cells"]])
    cells = {(c["mode"], c["rate_mbit"]): c for c in data["cells"] if c["repeat"] == 0}
    modes = [m for m in MODES if any(key[0] == m for key in rows)]
    rates = data["rates"]
    base, other = modes[0], modes[-1]
    label = lambda rate: "unshaped" if rate is None else f"{rate:g} Mbit/s"  # noqa: E731
    lines = [f"| link (per host, each way) | {base} tok/s | {other} tok/s | {other} / {base} | "
             f"busiest uplink kbit/s ({base} / {other}) |", "|---|---|---|---|---|"]
    for rate in rates:
        a, b = rows.get((base, rate)), rows.get((other, rate))
        ratio = f"{b['tokens_per_s'] / a['tokens_per_s']:.1f}×" if a and b and a["tokens_per_s"] > 0 else "—"
        uplinks = " / ".join(f"{max(cells[(m, rate)]['upload_kbit_s']):.0f}" if (m, rate) in cells else "—"
                             for m in (base, other))
        lines.append(f"| {label(rate)} | {a['tokens_per_s'] if a else float('nan'):.0f} | "
                     f"{b['tokens_per_s'] if b else float('nan'):.0f} | {ratio} | {uplinks} |")
    unshaped = rows.get((base, None))
    slow = next((r for r in rates if r is not None and unshaped and (base, r) in rows
                 and rows[(base, r)]["tokens_per_s"] * 16 <= unshaped["tokens_per_s"]), None)
    if slow is not None:
        a, b = rows[(base, slow)], rows.get((other, slow))
        text = (f"\nRegime-scaled rate (the first where {base} runs ≥ 16× slower than unshaped): **{slow:g} Mbit/s**, "
                f"{base} {unshaped['tokens_per_s'] / max(a['tokens_per_s'], 1e-9):.1f}× slower than unshaped")
        if b and (other, None) in rows and a["tokens_per_s"] > 0:
            text += (f"; {other} there: {b['tokens_per_s']:.0f} tok/s = **{b['tokens_per_s'] / a['tokens_per_s']:.1f}× "
                     f"{base}**, {100 * b['tokens_per_s'] / rows[(other, None)]['tokens_per_s']:.0f}% of its unshaped "
                     "speed")
        lines.append(text)
    else:
        lines.append(f"\n{base} never ran 16× slower than unshaped in this sweep.")
    lines += ["", "| mode | K/V B/token, all lanes and layers, both ways: measured (formula) | busiest uplink B/token: "
              "measured at the slowest rate (K/V formula per lane) | loss at the common token count |",
              "|---|---|---|---|"]
    common = min((max((n for n, _ in t), default=0) for t in data["loss_traces"].values()), default=0)
    for m in modes:
        info = data["manifests"][m]
        kv = [c["kv_bytes_per_token"] for c in data["cells"] if c["mode"] == m and c["kv_bytes_per_token"]]
        slowest = min((c for c in data["cells"] if c["mode"] == m and c["rate_mbit"] is not None),
                      key=lambda c: c["rate_mbit"], default=None)
        uplink = (max(slowest["upload_kbit_s"]) * 1000 / 8 / slowest["tokens_per_s"]
                  if slowest and slowest["tokens_per_s"] > 0 else float("nan"))
        window = [loss for n, loss in data["loss_traces"][m] if 0.8 * common <= n <= common]
        loss = f"{sum(window) / len(window):.3f}" if window else "—"
        kv_median = sorted(kv)[len(kv) // 2] if kv else float("nan")
        lines.append(f"| {m} (r_k {info['r_k']}, r_v {info['r_v']}) | {kv_median:.1f} ({info['kv_all']:.1f}) | "
                     f"{uplink:.0f} ({info['kv_per_lane_uplink']:.1f}) | {loss} |")
    info = data["manifests"][base]
    lines.append(f"\n{data['stages']} stage(s) × {data['lanes']} lanes, tiny (d={info['d_model']}, "
                 f"{info['layers_per_stage']} layers per stage), sequences of {info['seq_len']} tokens in "
                 f"{data['lanes']} chunks, microbatch {info['microbatch']}, boundary `{info['boundary']}` "
                 f"k={info['k']}; "
                 f"{data['max_inflight']} trips in flight per stage-0 lane; peers accept streams down to "
                 f"{data['min_stream_kbit']:g} kbit/s. Command: `{data['command']}` at {data['code']}.")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
