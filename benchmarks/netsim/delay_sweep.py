"""The pipeline's tokens/s at round-trip delays (issue 27), interleaved and resumable.

    sudo OMP_NUM_THREADS=1 python -m benchmarks.netsim.delay_sweep --out benchmarks/netsim/delay-pipeline.json

For each target RTT between two peers (each host's link gets RTT/4 each way: a frame crosses the
sender's link and the receiver's) and each mode, one swarm of real peers (`run.sweep`, one peer per
stage, the unshaped rate unless `--rate`) is started, measured once, and stopped. Points run RTT by
RTT with the modes' order alternating, so slow drift of the shared machine falls on both modes alike;
every cell is appended to `--out` as soon as it is measured and points already there are skipped, so
an interrupted sweep resumes. `--report` prints the table (ratios to each mode's RTT-0 cell and
boundary/dense per RTT) from `--out`.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from benchmarks.netsim.harness import cell_dict
from benchmarks.netsim.net import cleanup_leftovers
from benchmarks.netsim.run import MODES, code_version, manifest_for, sweep
from tracker.summary import POLL_INTERVAL


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"cells": []}


def _done(data: dict, mode: str, rtt: float, repeat: int) -> bool:
    return any(c["mode"] == mode and c["rtt_ms"] == rtt and c["repeat"] == repeat for c in data["cells"])


def points(rtts: list[float], modes: list[str], repeats: int) -> list[tuple[int, float, str]]:
    """(repeat, RTT, mode) in run order: RTT by RTT, the modes' order reversed every other RTT."""
    order = []
    for repeat in range(repeats):
        for i, rtt in enumerate(rtts):
            for mode in modes if (i + repeat) % 2 == 0 else list(reversed(modes)):
                order.append((repeat, rtt, mode))
    return order


def report(data: dict) -> str:
    cells = data["cells"]
    modes = list(dict.fromkeys(c["mode"] for c in cells))
    rtts = sorted({c["rtt_ms"] for c in cells})

    def rate(mode: str, rtt: float) -> float | None:
        got = [c["tokens_per_s"] for c in cells if c["mode"] == mode and c["rtt_ms"] == rtt]
        return sum(got) / len(got) if got else None

    head = "| RTT (ms) | " + " | ".join(f"{m} tok/s | {m} / its RTT 0" for m in modes)
    lines = [head + (" | " + " / ".join(modes) if len(modes) == 2 else "") + " |",
             "|---" * (1 + 2 * len(modes) + (len(modes) == 2)) + "|"]
    for rtt in rtts:
        row = [f"{rtt:g}"]
        for m in modes:
            here, base = rate(m, rtt), rate(m, rtts[0])
            row += ["—" if here is None else f"{here:.0f}",
                    "—" if here is None or not base else f"{here / base:.2f}"]
        if len(modes) == 2:
            a, b = rate(modes[0], rtt), rate(modes[1], rtt)
            row.append("—" if a is None or not b else f"{a / b:.2f}×")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rtts", default="0,20,50,100", help="RTT between two peers, ms")
    parser.add_argument("--modes", default="boundary,dense-bf16")
    parser.add_argument("--rate", default="unshaped", help="Mbit/s per host and direction, or 'unshaped'")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-inflight", type=int, default=4)
    parser.add_argument("--window", type=float, default=40.0)
    parser.add_argument("--max-window", type=float, default=150.0)
    parser.add_argument("--min-trips", type=int, default=6)
    parser.add_argument("--warmup-trips", type=int, default=4)
    parser.add_argument("--records-interval", type=float, default=POLL_INTERVAL)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/netsim/delay-pipeline.json")
    parser.add_argument("--report", action="store_true", help="print the table from --out and exit")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.report:
        print(report(_load(out)))
        return 0

    def on_term(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    cleanup_leftovers()

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    rate = None if args.rate == "unshaped" else float(args.rate)
    modes = args.modes.split(",")
    data = _load(out)
    data.setdefault("commands", []).append(" ".join(["python -m benchmarks.netsim.delay_sweep",
                                                     *(argv if argv is not None else sys.argv[1:])]))
    data.setdefault("code", code_version())
    if unknown := [m for m in modes if m not in MODES]:
        parser.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    # one measurement per swarm: the repeats are further swarms, interleaved with the other points
    sweep_args = argparse.Namespace(**{**vars(args), "repeats": 1, "jitter_ms": 0.0, "loss": 0.0})
    try:
        for repeat, rtt, mode in points([float(r) for r in args.rtts.split(",")], modes, args.repeats):
            if _done(data, mode, rtt, repeat):
                continue
            sweep_args.delay_ms = rtt / 4
            log(f"RTT {rtt:g} ms ({rtt / 4:g} ms per link each way), {mode}, repeat {repeat}")
            cells, _ = sweep(mode, manifest_for(mode, args.stages, args.k, args.seed), sweep_args, [rate], log,
                             extend=False)
            data["cells"] += [{**cell_dict(c), "rtt_ms": rtt, "repeat": repeat} for c in cells]
            out.write_text(json.dumps(data, indent=1))
    except KeyboardInterrupt:
        log("interrupted; what was measured is in the file")
        return 130
    finally:
        cleanup_leftovers()
    print(report(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
