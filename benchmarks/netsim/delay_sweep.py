"""The pipeline's or the lanes' tokens/s at round-trip delays (issue 27), interleaved and resumable.

    sudo OMP_NUM_THREADS=1 python -m benchmarks.netsim.delay_sweep --out benchmarks/netsim/delay-pipeline.json
    sudo OMP_NUM_THREADS=1 python -m benchmarks.netsim.delay_sweep --lanes 2 --out benchmarks/netsim/delay-lanes.json

For each target RTT between two peers (each host's link gets RTT/4 each way: a frame crosses the
sender's link and the receiver's) and each mode, one swarm of real peers (one per stage, or with
`--lanes P` one per stage and lane, `cp.py`'s manifests and stream floor) is started at the unshaped
rate unless `--rate`, measured once, and stopped; the cell also keeps each process's CPU share, the
trips each peer held and the load average (`trip_time.py`), since the cores are shared. Points run RTT by
RTT with the modes' order alternating, so slow drift of the shared machine falls on both modes alike;
every cell is appended to `--out` as soon as it is measured and points already there are skipped, so
an interrupted sweep resumes. `--max-inflight 4,8` interleaves the drivers' windows as it interleaves modes (an
A/B in one run), each window a variant of its own in the tables; `--grad-averaging fp32,fp16` does the same for
what the peers' gradient averaging sends (`peer/stage_averagers.py` GradientWire). `--report` prints the table
(ratios to each variant's RTT-0 cell, and of the two variants per RTT where there are two) from `--out`.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from pathlib import Path

from benchmarks.netsim import cp, trip_time
from benchmarks.netsim.delay import LinkDelay
from benchmarks.netsim.harness import NetSimError, NetSwarm, cell_dict
from benchmarks.netsim.net import cleanup_leftovers
from benchmarks.netsim.run import MODES, code_version, manifest_for
from tracker.summary import POLL_INTERVAL


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"cells": []}


Variant = tuple[str, int, str]  # (mode, trips each driver keeps in flight, what gradient averaging sends)


def _variant(cell: dict, default_inflight: int) -> Variant:
    """A cell's variant; cells measured before `max_inflight` was recorded ran the default, and before
    `grad_averaging` was, fp32 (the only one then)."""
    return cell["mode"], cell.get("max_inflight", default_inflight), cell.get("grad_averaging", "fp32")


def label(cell: dict) -> str:
    """The name a cell's variant has in the tables: its mode, and its window where the sweep compared windows."""
    return cell.get("variant", cell["mode"])


def _done(data: dict, variant: Variant, rtt: float, repeat: int, default_inflight: int) -> bool:
    return any(_variant(c, default_inflight) == variant and c["rtt_ms"] == rtt and c["repeat"] == repeat
               for c in data["cells"])


def points(rtts: list[float], variants: list, repeats: int) -> list[tuple[int, float, object]]:
    """(repeat, RTT, variant) in run order: RTT by RTT, the variants' order reversed every other RTT."""
    order = []
    for repeat in range(repeats):
        for i, rtt in enumerate(rtts):
            for variant in variants if (i + repeat) % 2 == 0 else list(reversed(variants)):
                order.append((repeat, rtt, variant))
    return order


def measure_point(variant: Variant, rtt: float, rate: float | None, args, log) -> dict:
    """One swarm at one (RTT, rate): started, warmed up, measured once with the probes around it, stopped."""
    mode, max_inflight, grad_averaging = variant
    peer_args = ("--grad-averaging", grad_averaging)
    if args.lanes > 1:
        manifest = cp.manifest_for(mode, args.stages, args.lanes, args.seed)
        peer_args += ("--min-stream-kbit", str(args.min_stream_kbit))
    else:
        manifest = manifest_for(mode, args.stages, args.k, args.seed)
    if args.target_batch:  # a longer optimizer epoch: the stage's averaging carries that much less per token
        manifest = manifest.model_copy(update={"batch": manifest.batch.model_copy(
            update={"target_batch_size": args.target_batch})})
    workdir = Path(tempfile.mkdtemp(prefix=f"netsim-delay-{mode}-"))
    swarm = NetSwarm(manifest, workdir, max_inflight=max_inflight, log=log, peer_args=peer_args,
                     records_interval=args.records_interval, delay=LinkDelay.symmetric(rtt / 4))
    try:
        swarm.start()
        swarm.wait_training(trips=args.warmup_trips)
        before = trip_time.snapshot(swarm)
        cell = swarm.measure(mode, rate, 0, min_window=args.window, max_window=args.max_window,
                             min_trips=args.min_trips)
        accounting = trip_time.account(swarm, before, trip_time.snapshot(swarm), cell)
    finally:
        swarm.stop()
        log(f"  stopped; logs in {workdir}")
    log(f"  load {accounting['load_start']:.1f}->{accounting['load_end']:.1f}, CPU share "
        + ", ".join(f"{n} {p['cpu_share']:.2f}" for n, p in accounting["peers"].items() if p["cpu_share"] is not None)
        + ", in flight " + ", ".join(f"{n} {p['in_flight_mean']:.1f}" for n, p in accounting["peers"].items()
                                      if p["in_flight_mean"] is not None))
    return {**cell_dict(cell), **accounting}


def report(data: dict) -> str:
    cells = data["cells"]
    modes = list(dict.fromkeys(label(c) for c in cells))
    rtts = sorted({c["rtt_ms"] for c in cells})

    def rate(mode: str, rtt: float) -> float | None:
        got = [c["tokens_per_s"] for c in cells if label(c) == mode and c["rtt_ms"] == rtt]
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


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def trips_report(data: dict) -> str:
    """Per cell: the peers' CPU (their sessions, p2pd and hivemind's processes included) and tokens per CPU-second
    of it (the work per token: it grows with retried trips or overheads, not with waiting), load average, driver
    trips/s, forwarders' CPU, and per stage (mean over its lanes) the main process's CPU share of a core, trips
    held (log lines), Little's law's seconds per trip there, CPU seconds per trip, and where recorded the stage
    thread's shares of the window running / runnable (waiting for a core) / neither (waiting for K/V, a reply
    or a trip)."""
    fmt = lambda v, spec: "—" if v is None else format(v, spec)  # noqa: E731
    lines = ["| RTT (ms) | mode | tok/s | peers' CPU (cores) | tok per peer CPU-s | load (start–end) | driver trips/s "
             "| forwarders' CPU | per stage: CPU share / trips held / s per trip there / CPU s per trip / stage thread "
             "running, runnable, waiting |", "|---|---|---|---|---|---|---|---|---|"]
    for c in sorted((c for c in data["cells"] if "peers" in c), key=lambda c: (c["rtt_ms"], c["repeat"])):
        stages: dict[str, list[tuple[str, dict]]] = {}
        for name, peer in c["peers"].items():
            if name != "bootstrap":
                stages.setdefault(name.split("-")[0], []).append((name, peer))
        parts = []
        for stage, peers in sorted(stages.items()):
            lanes = len(peers) if len(peers) > 1 else 1
            text = " / ".join([fmt(_mean([p["cpu_share"] for _, p in peers]), ".2f"),
                               fmt(_mean([p["in_flight_mean"] for _, p in peers]), ".1f"),
                               fmt(_mean([trip_time.seconds_per_trip(n, p, c["trip_rate"], lanes) for n, p in peers]),
                                   ".1f"),
                               fmt(_mean([p["cpu_seconds_per_trip"] for _, p in peers]), ".2f")])
            if all("threads" in p for _, p in peers):
                running = _mean([p["threads"]["stage"]["running"] for _, p in peers])
                runnable = _mean([p["threads"]["stage"]["runnable"] for _, p in peers])
                text += f" / {running:.2f}, {runnable:.2f}, {1 - running - runnable:.2f}"
            parts.append(f"{stage}: {text}")
        cores = sum(p["session_cpu_share"] for n, p in c["peers"].items() if n != "bootstrap")
        lines.append(f"| {c['rtt_ms']:g} | {label(c)} | {c['tokens_per_s']:.0f} | {cores:.2f} | "
                     f"{c['tokens_per_s'] / cores:.0f} | {c['load_start']:.1f}–"
                     f"{c['load_end']:.1f} | {c['trip_rate']:.2f} | {c['forwarders_cpu_share']:.2f} | "
                     + "; ".join(parts) + " |")
    return "\n".join(lines)


def split_report(data: dict) -> str:
    """Per cell and stage (mean over its lanes), the peers' own account of where a trip's time went there
    (`trip_time.logged_time_split`): stage thread busy share, ms a job waited for the thread, ms a hop waited for the
    next stage's reply, ms a lane waited for one layer's K/V, ms a served trip took from decoded to reply."""
    fmt = lambda v, spec: "—" if v is None else format(v, spec)  # noqa: E731
    lines = ["| RTT (ms) | mode | per stage: busy / queued ms / reply ms / K/V ms per layer / served ms |",
             "|---|---|---|"]
    for c in sorted((c for c in data["cells"] if "peers" in c), key=lambda c: (c["rtt_ms"], c["repeat"])):
        stages: dict[str, list[dict]] = {}
        for name, peer in c["peers"].items():
            if peer.get("split"):
                stages.setdefault(name.split("-")[0], []).append(peer["split"])
        parts = [f"{stage}: " + " / ".join(
            [fmt(_mean([s["busy_share"] for s in splits]), ".0%")]
            + [fmt(_mean([s[key] for s in splits]), ".0f") for key in ("queued_ms", "reply_ms", "kv_ms", "served_ms")])
            for stage, splits in sorted(stages.items())]
        if parts:
            lines.append(f"| {c['rtt_ms']:g} | {label(c)} | " + "; ".join(parts) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rtts", default="0,20,50,100", help="RTT between two peers, ms")
    parser.add_argument("--lanes", type=int, default=1, help="context_parallel.size P; > 1 sweeps cp.py's lanes")
    parser.add_argument("--modes", help="default boundary,dense-bf16; with --lanes cp-subspace,cp-dense")
    parser.add_argument("--rate", default="unshaped", help="Mbit/s per host and direction, or 'unshaped'")
    parser.add_argument("--stages", type=int, help="default 3; with --lanes 2")
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-inflight", help="per driver, or a comma list to interleave; default 4, with --lanes 2 "
                        "(cp.py's)")
    parser.add_argument("--grad-averaging", default="fp16", help="what the peers' gradient averaging sends (fp16, "
                        "fp32), or a comma list to interleave")
    parser.add_argument("--min-stream-kbit", type=float, default=16.0, help="with --lanes: passed to every peer")
    parser.add_argument("--window", type=float, default=40.0)
    parser.add_argument("--max-window", type=float, default=150.0)
    parser.add_argument("--min-trips", type=int, help="default 6; with --lanes 4 (cp.py's)")
    parser.add_argument("--warmup-trips", type=int, default=4)
    parser.add_argument("--records-interval", type=float, default=POLL_INTERVAL)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--target-batch", type=int, help="samples per optimizer epoch (default: the preset's)")
    parser.add_argument("--out", default="benchmarks/netsim/delay-pipeline.json")
    parser.add_argument("--report", action="store_true", help="print the table from --out and exit")
    args = parser.parse_args(argv)
    lanes = args.lanes > 1
    defaults = {"modes": "cp-subspace,cp-dense" if lanes else "boundary,dense-bf16", "stages": 2 if lanes else 3,
                "max_inflight": "2" if lanes else "4", "min_trips": 4 if lanes else 6}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    out = Path(args.out)
    if args.report:
        data = _load(out)
        print(report(data) + ("\n\n" + trips_report(data) + "\n\n" + split_report(data)
                              if any("peers" in c for c in data["cells"]) else ""))
        return 0

    def on_term(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    cleanup_leftovers()

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    rate = None if args.rate == "unshaped" else float(args.rate)
    modes, windows = args.modes.split(","), [int(n) for n in args.max_inflight.split(",")]
    wires = args.grad_averaging.split(",")
    default_window = int(defaults["max_inflight"])
    data = _load(out)
    data.setdefault("commands", []).append(" ".join(["python -m benchmarks.netsim.delay_sweep",
                                                     *(argv if argv is not None else sys.argv[1:])]))
    data.setdefault("code", code_version())
    known = cp.MODES if lanes else MODES
    if unknown := [m for m in modes if m not in known]:
        parser.error(f"unknown modes {unknown}; choose from {list(known)}")
    try:
        variants = [(mode, window, wire) for mode in modes for window in windows for wire in wires]
        for repeat, rtt, variant in points([float(r) for r in args.rtts.split(",")], variants, args.repeats):
            if _done(data, variant, rtt, repeat, default_window):
                continue
            mode, window, wire = variant
            log(f"RTT {rtt:g} ms ({rtt / 4:g} ms per link each way), {mode}, {window} in flight, {wire} gradient "
                f"averaging, repeat {repeat}")
            cell = measure_point(variant, rtt, rate, args, log)
            # every cell names what its averaging sent (cells from before `--grad-averaging`, all fp32, by mode alone)
            named = ", ".join([mode] + [f"{window} in flight"] * (len(windows) > 1) + [f"{wire} averaging"])
            data["cells"].append({**cell, "variant": named, "max_inflight": window,
                                  "grad_averaging": wire, "rtt_ms": rtt, "repeat": repeat, "code": code_version()})
            out.write_text(json.dumps(data, indent=1))
    except (KeyboardInterrupt, NetSimError) as exc:
        log(f"stopped: {exc or 'interrupted'}; what was measured is in the file")
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        cleanup_leftovers()
    print(report(data) + "\n\n" + trips_report(data) + "\n\n" + split_report(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
