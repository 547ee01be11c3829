"""Wire bytes per token and tokens/s of a real local swarm (`protocol-swarm local`), per compression mode.

Every cell is a fresh swarm of real peer processes on loopback with the same preset, stages,
steps and in-flight window; ratios against the dense baseline (`none`, bf16) come from the same
invocation. Usage:

    python benchmarks/local_swarm.py [--modes subspace boundary none] [--steps 40] [--repeats 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def run_cell(mode: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, "-m", "launcher.cli", "local", "--preset", args.preset, "--stages", str(args.stages),
               "--steps", str(args.steps), "--compression", mode, "--max-inflight", str(args.max_inflight),
               "--json", "--timeout", "900"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1000)
    if result.returncode != 0:
        raise RuntimeError(f"{mode}: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["subspace", "boundary", "none"])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--max-inflight", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="write all cells here")
    args = parser.parse_args()
    cells: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    total, done, started = len(args.modes) * args.repeats, 0, time.monotonic()
    for repeat in range(args.repeats):
        for mode in args.modes:  # interleaved, so machine load drifts hit every mode alike
            cell = run_cell(mode, args)
            cells[mode].append(cell)
            done += 1
            eta = (time.monotonic() - started) / done * (total - done)
            print(f"[{done}/{total}] {mode} repeat {repeat}: {cell['tokens_per_second']:.0f} tokens/s, "
                  f"{cell['wire_bytes_per_token']:.1f} B/token, loss {cell['loss_first']:.2f} -> "
                  f"{cell['loss_last']:.2f}; ETA {eta:.0f}s", flush=True)
    rows = {}
    for mode, runs in cells.items():
        rows[mode] = {
            "tokens_per_second": statistics.median(r["tokens_per_second"] for r in runs),
            "wire_bytes_per_token": statistics.median(r["wire_bytes_per_token"] for r in runs),
            "loss_last": statistics.median(r["loss_last"] for r in runs),
            "dense_wire_bytes_per_token": runs[0]["dense_wire_bytes_per_token"],
        }
    base = rows.get("none")
    print("\n| mode | tokens/s (median) | wire B/token/boundary | bytes vs none | tokens/s vs none | loss |")
    print("|---|---|---|---|---|---|")
    for mode, row in rows.items():
        byte_ratio = row["wire_bytes_per_token"] / base["wire_bytes_per_token"] if base else float("nan")
        speed_ratio = row["tokens_per_second"] / base["tokens_per_second"] if base else float("nan")
        print(f"| {mode} | {row['tokens_per_second']:.0f} | {row['wire_bytes_per_token']:.1f} | {byte_ratio:.4f} | "
              f"{speed_ratio:.2f} | {row['loss_last']:.2f} |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "cells": cells, "rows": rows}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
