"""Every byte a real local swarm sends, by kind: the trips, and the control traffic behind them.

On an emulated home link (benchmarks/netsim) the compressed modes carried several times more
non-trip bytes than trip payload. This runs `protocol-swarm local` with
benchmarks/control_traffic_probe on the children's path, which counts, inside every process and on
the serving side of every exchange: trip messages (header and payload), DHT requests served
(protobuf sizes) named by the key they are about (our stage records, hivemind's progress records,
its averagers' group keys and announcements, the subspace records), averaging matchmaking, the
all-reduce payload and state downloads. It reports them per trained token and per second, for
each compression mode and peers-per-stage count in the same invocation. What it cannot see is
libp2p's own framing, encryption and keep-alives inside p2pd: benchmarks/netsim measures those
as the on-link total minus the above. `--checkout` runs another checkout's code with this probe,
so two commits can be compared. Usage:

    python benchmarks/control_traffic.py [--modes boundary none] [--peers 1 2] [--stages 3] [--steps 60]
        [--checkout PATH] [--json OUT]
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
# the rows of the byte table, in order: what a served DHT request was about, then the non-DHT kinds
KINDS = ("trip payload", "trip headers", "DHT stage records", "DHT progress", "DHT averaging groups",
         "DHT subspace", "DHT other (pings, routing)", "averaging matchmaking", "averaging payload",
         "state download")
# the local launcher reads every stage's records once a second to follow the run: a real swarm has no such
# reader, so its reads are reported apart and left out of the non-trip total
LAUNCHER = "DHT stage records read by the launcher (local runs only)"
# what the swarm's stage-record bytes are made of (counted on the asking side; the launcher's reads excluded)
STAGE_SPLIT = ("read by peers", "read by the tracker", "found while announcing", "stores")


def family(event: str) -> str:
    """`lookup tiny-ab12_stage1_grad_averager.0b` -> `lookup stage*_grad_averager.*`."""
    kind, _, key = event.partition(" ")
    if kind not in ("lookup", "store"):
        return event
    key = re.sub(r"^[^_]+_", "", key)  # the run id
    key = re.sub(r"stage\d+", "stage*", key)
    key = re.sub(r"\.[01]*b$", ".<group>", key)
    return f"{kind} {key}"


def dht_kind(key: str | None) -> str:
    """Which row of the table a DHT key's traffic belongs to (None: a DHT id no process named)."""
    if key is None:
        return "DHT other (pings, routing)"
    if key.endswith("_progress"):
        return "DHT progress"
    if "_averager" in key:
        return "DHT averaging groups"
    if key.endswith(("_subspace", "_ucontrib")):
        return "DHT subspace"
    if re.search(r"_stage\d+$", key):
        return "DHT stage records"
    return "DHT other (pings, routing)"


def served_dht(event: str, names: dict[str, str]) -> tuple[str, str] | None:
    """`served find <DHT id>` -> ("find", its row of KINDS); None for other events."""
    parts = event.split(" ")
    if parts[0] != "served" or len(parts) < 2 or parts[1] not in ("find", "store", "ping"):
        return None
    return parts[1], dht_kind(names.get(parts[2]) if len(parts) > 2 else None)


def byte_kinds(counts: collections.Counter, names: dict[str, str]) -> dict[str, int]:
    """Bytes per row of KINDS from the probes' raw counts (`names`: DHT id hex -> key)."""
    kinds = dict.fromkeys(KINDS, 0)
    for event, n in counts.items():
        if dht := served_dht(event, names):
            kinds[dht[1]] += n
        elif event.startswith("trip ") and event.endswith("payload bytes"):
            kinds["trip payload"] += n
        elif event.startswith("trip ") and event.endswith("header bytes"):
            kinds["trip headers"] += n
        elif event in kinds:
            kinds[event] += n
    return kinds


def stage_finds(counts: collections.Counter, names: dict[str, str]) -> dict[tuple[str, str], int]:
    """Bytes of the finds sent about stage records, by (why, who asked): `asked find read tracker <id>`."""
    out: collections.Counter = collections.Counter()
    for event, n in counts.items():
        parts = event.split(" ")
        if parts[:2] == ["asked", "find"] and len(parts) == 5 and dht_kind(names.get(parts[4])) == "DHT stage records":
            out[parts[2], parts[3]] += n
    return dict(out)


def run_cell(mode: str, peers: int, args: argparse.Namespace) -> dict:
    checkout = Path(args.checkout).resolve()
    with tempfile.TemporaryDirectory(prefix="control-traffic-") as out_dir:
        env = dict(os.environ, CONTROL_TRAFFIC_DIR=out_dir,
                   PYTHONPATH=os.pathsep.join([str(checkout), str(PROBE), os.environ.get("PYTHONPATH", "")]))
        command = [sys.executable, "-m", "launcher.cli", "local", "--stages", str(args.stages), "--steps",
                   str(args.steps), "--compression", mode, "--peers-per-stage", str(peers), "--json",
                   "--timeout", "900"]
        result = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True, timeout=1000)
        if result.returncode != 0:
            raise RuntimeError(f"{mode}: {result.stderr[-2000:]}")
        summary = json.loads(result.stdout.strip().splitlines()[-1])
        counts: collections.Counter = collections.Counter()
        names: dict[str, str] = {}
        for path in Path(out_dir).glob("*.json"):
            for event, n in json.loads(path.read_text()).items():
                if event.startswith("key "):
                    _, dht_id, key = event.split(" ", 2)
                    names[dht_id] = key
                else:
                    counts[event] += n
    tokens, seconds = max(summary["tokens"], 1), max(summary["seconds"], 1e-9)
    kinds = byte_kinds(counts, names)
    asked = stage_finds(counts, names)
    kinds["DHT stage records"] -= asked.get(("read", "launcher"), 0)
    kinds[LAUNCHER] = asked.get(("read", "launcher"), 0)
    split = dict(zip(STAGE_SPLIT, (asked.get(("read", "peer"), 0), asked.get(("read", "tracker"), 0),
                                   sum(n for (why, _), n in asked.items() if why == "store"),
                                   sum(n for e, n in counts.items() if served_dht(e, names) == (
                                       "store", "DHT stage records"))), strict=True))
    dht_by_operation: collections.Counter = collections.Counter()  # e.g. "find DHT stage records" -> bytes
    for event, n in counts.items():
        if dht := served_dht(event, names):
            dht_by_operation[" ".join(dht)] += n
    operations = collections.Counter()
    for event, n in counts.items():
        operations[family(event)] += n
    return {"mode": mode, "peers_per_stage": peers, "tokens": summary["tokens"], "seconds": summary["seconds"],
            "tokens_per_second": summary["tokens_per_second"], "trip_messages": sum(
                n for e, n in counts.items() if e.startswith("trip ") and e.endswith("messages")),
            "bytes": kinds,
            "bytes_per_token": {k: n / tokens for k, n in kinds.items()},
            "bytes_per_second": {k: n / seconds for k, n in kinds.items()},
            "stage_records_per_token": {k: n / tokens for k, n in split.items()},
            "stage_records_per_second": {k: n / seconds for k, n in split.items()},
            "dht_bytes_per_token_by_operation": {k: n / tokens for k, n in sorted(dht_by_operation.items())},
            "per_1000_tokens": {e: n * 1000.0 / tokens for e, n in sorted(operations.items())
                                if e.startswith(("lookup", "store", "served requests"))}}


def report(cells: list[dict], commit: str) -> str:
    """A markdown table: one row per kind, bytes per token and per second for every cell."""
    heads = [f"{c['mode']} × {c['peers_per_stage']}" for c in cells]
    lines = [f"code: {commit}; swarm totals over every link, bytes per trained token (bytes per second)", "",
             "| kind | " + " | ".join(heads) + " |", "|---|" + "---|" * len(cells)]
    for kind in (*KINDS, LAUNCHER):
        lines.append(f"| {kind} | " + " | ".join(
            f"{c['bytes_per_token'][kind]:.1f} ({c['bytes_per_second'][kind]:.0f})" for c in cells) + " |")
        if kind == "DHT stage records":
            lines.extend(f"| … {part} | " + " | ".join(
                f"{c['stage_records_per_token'][part]:.1f} ({c['stage_records_per_second'][part]:.0f})"
                for c in cells) + " |" for part in STAGE_SPLIT)
    non_trip = [sum(v for k, v in c["bytes_per_token"].items() if not k.startswith("trip") and k != LAUNCHER)
                for c in cells]
    lines.append("| **non-trip total** (without the launcher's reads) | "
                 + " | ".join(f"**{n:.1f}**" for n in non_trip) + " |")
    ratios = [n / max(c["bytes_per_token"]["trip payload"], 1e-9) for n, c in zip(non_trip, cells, strict=True)]
    lines.append("| non-trip / trip payload | " + " | ".join(f"{r:.2f}" for r in ratios) + " |")
    lines.append("| tokens/s (under load) | " + " | ".join(f"{c['tokens_per_second']:.0f}" for c in cells) + " |")
    lines.append("| DHT requests served / 1k tokens | " + " | ".join(
        f"{c['per_1000_tokens'].get('served requests', 0):.1f}" for c in cells) + " |")
    for cell, head in zip(cells, heads, strict=True):
        rates = cell["per_1000_tokens"]
        top = sorted(((n, e) for e, n in rates.items() if e.startswith(("lookup", "store"))), reverse=True)[:5]
        lines.append(f"\n{head}: top lookups and stores / 1k tokens: {'; '.join(f'{e} {n:.1f}' for n, e in top)}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["boundary", "none"])
    parser.add_argument("--peers", nargs="+", type=int, default=[1], help="peers per stage, one cell each")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checkout", default=str(Path(__file__).resolve().parents[1]),
                        help="the checkout whose code the swarm runs (default: this one)")
    parser.add_argument("--json", help="write the cells here")
    args = parser.parse_args()
    commit = subprocess.run(["git", "-C", args.checkout, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    cells = []
    for peers in args.peers:
        for mode in args.modes:
            cells.append(run_cell(mode, peers, args))
            print(f"{mode} × {peers}: {cells[-1]['tokens_per_second']:.0f} tokens/s", file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"commit": commit, "cells": cells}, indent=1))
    print(report(cells, commit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
