"""Control-plane traffic of a real local swarm: the DHT lookups and stores behind the trips.

On an emulated home link (benchmarks/netsim) every mode carried a few hundred bytes per token
that the trip counters never saw; for the compressed modes that is most of what is on the wire.
This runs `protocol-swarm local` with benchmarks/control_traffic_probe on the children's path,
which counts every process's hivemind DHT operations, and reports them per key family (our stage
records, hivemind's progress tracker, its averagers' group lookups...) per 1000 trained tokens,
with tokens/s, for each compression mode in the same invocation. `--checkout` runs another
checkout's code with this probe, so two commits can be compared. Usage:

    python benchmarks/control_traffic.py [--modes boundary none] [--stages 3] [--steps 60] [--checkout PATH]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = Path(__file__).resolve().parent / "control_traffic_probe"


def family(event: str) -> str:
    """`lookup tiny-ab12_stage1_grad_averager.0b` -> `lookup stage*_grad_averager.*`."""
    kind, _, key = event.partition(" ")
    if kind not in ("lookup", "store"):
        return event
    key = re.sub(r"^[^_]+_", "", key)  # the run id
    key = re.sub(r"stage\d+", "stage*", key)
    key = re.sub(r"\.[01]*b$", ".<group>", key)
    return f"{kind} {key}"


def run_cell(mode: str, args: argparse.Namespace) -> dict:
    checkout = Path(args.checkout).resolve()
    with tempfile.TemporaryDirectory(prefix="control-traffic-") as out_dir:
        env = dict(os.environ, CONTROL_TRAFFIC_DIR=out_dir,
                   PYTHONPATH=os.pathsep.join([str(checkout), str(PROBE), os.environ.get("PYTHONPATH", "")]))
        command = [sys.executable, "-m", "launcher.cli", "local", "--stages", str(args.stages), "--steps",
                   str(args.steps), "--compression", mode, "--json", "--timeout", "900"]
        result = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True, timeout=1000)
        if result.returncode != 0:
            raise RuntimeError(f"{mode}: {result.stderr[-2000:]}")
        summary = json.loads(result.stdout.strip().splitlines()[-1])
        counts: collections.Counter = collections.Counter()
        for path in Path(out_dir).glob("*.json"):
            for event, n in json.loads(path.read_text()).items():
                counts[family(event)] += n
    per_k = 1000.0 / max(summary["tokens"], 1)
    return {"mode": mode, "tokens": summary["tokens"], "seconds": summary["seconds"],
            "tokens_per_second": summary["tokens_per_second"],
            "per_1000_tokens": {event: n * per_k for event, n in sorted(counts.items())}}


def report(cells: list[dict], commit: str) -> str:
    lines = [f"code: {commit}", "", "| mode | tokens/s | DHT requests served / 1k tokens | DHT bytes served / token |"
             " top lookups and stores / 1k tokens |", "|---|---|---|---|---|"]
    for cell in cells:
        rates = cell["per_1000_tokens"]
        top = sorted(((n, e) for e, n in rates.items() if e.startswith(("lookup", "store"))), reverse=True)[:4]
        lines.append(f"| {cell['mode']} | {cell['tokens_per_second']:.0f} | {rates.get('served requests', 0):.1f} | "
                     f"{rates.get('served bytes', 0) / 1000:.0f} | {'; '.join(f'{e} {n:.1f}' for n, e in top)} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["boundary", "none"])
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checkout", default=str(Path(__file__).resolve().parents[1]),
                        help="the checkout whose code the swarm runs (default: this one)")
    parser.add_argument("--json", help="write the cells here")
    args = parser.parse_args()
    commit = subprocess.run(["git", "-C", args.checkout, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    cells = []
    for mode in args.modes:
        cells.append(run_cell(mode, args))
        print(f"{mode}: {cells[-1]['tokens_per_second']:.0f} tokens/s", file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"commit": commit, "cells": cells}, indent=1))
    print(report(cells, commit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
