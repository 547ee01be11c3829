"""Calibration of the delayed emulated internet (issue 27): does a link do what it is set to?

    sudo OMP_NUM_THREADS=1 python -m benchmarks.netsim.calibrate --out benchmarks/netsim/calibration.json

Two hosts on delayed links (`net.Topology` with a `LinkDelay`). For each target round trip it sets
each host's one-way delay to RTT/4 (a frame A→B crosses A's link then B's, and back) and sends ICMP
echoes (`probe.py ping`); for each rate it shapes both links with `tc tbf`, sets the delay of
`--rate-rtt-ms`, runs one bulk TCP transfer A→B (`probe.py send`/`sink`, slow start left out) and
reads the CPU both forwarders used meanwhile, as a share of one core (they run beside the peers on
the same two cores). Unshaped, the forwarders themselves bound the rate: that is reported too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.netsim.delay import REPO, LinkDelay
from benchmarks.netsim.net import Topology, cleanup_leftovers

PROBE = [sys.executable, "-m", "benchmarks.netsim.probe"]


def _in(topology: Topology, index: int, argv: list[str]) -> list[str]:
    return topology.exec_prefix(topology.hosts[index]) + PROBE + argv


def ping_rtts(topology: Topology, src: int, dst: int, count: int = 20, interval: float = 0.05) -> list[float | None]:
    """ICMP round trips from host `src` to host `dst`, in ms (None: lost)."""
    out = subprocess.run(_in(topology, src, ["ping", topology.hosts[dst].address, "--count", str(count),
                                             "--interval", str(interval)]),
                         check=True, capture_output=True, text=True, cwd=str(REPO), timeout=60 + count * 3).stdout
    return json.loads(out)["rtt_ms"]


def bulk(topology: Topology, src: int, dst: int, seconds: float = 6.0, skip: float = 2.0,
         port: int = 5201) -> tuple[float, float]:
    """(Mbit/s one TCP connection src→dst reached after `skip` s, forwarders' CPU as a share of one core)."""
    sink = subprocess.Popen(_in(topology, dst, ["sink", "--port", str(port), "--skip", str(skip)]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO))
    try:
        if "listening" not in sink.stdout.readline():
            raise RuntimeError(f"the sink did not start: {sink.stderr.read()[-2000:]}")
        cpu_start, wall_start = sum(topology.forwarder_cpu_seconds().values()), time.monotonic()
        subprocess.run(_in(topology, src, ["send", topology.hosts[dst].address, "--port", str(port),
                                           "--seconds", str(seconds)]),
                       check=True, capture_output=True, cwd=str(REPO), timeout=seconds + 60)
        cpu = (sum(topology.forwarder_cpu_seconds().values()) - cpu_start) / (time.monotonic() - wall_start)
        result = json.loads(sink.communicate(timeout=60)[0].strip().splitlines()[-1])
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait()
    return result["mbit_s"], cpu


def rtt_row(topology: Topology, rtt_ms: float, count: int) -> dict:
    """Set both links to RTT/4 each way and ping."""
    topology.set_delay(LinkDelay.symmetric(rtt_ms / 4))
    rtts = ping_rtts(topology, 0, 1, count=count)
    got = [r for r in rtts if r is not None]
    return {"target_rtt_ms": rtt_ms, "delay_ms_per_host": rtt_ms / 4, "sent": len(rtts), "received": len(got),
            "median_ms": statistics.median(got) if got else None, "min_ms": min(got, default=None),
            # other work on the machine only ever adds delay: the lower quartile shows the link's own
            "p25_ms": statistics.quantiles(got, n=4)[0] if len(got) > 1 else None,
            "max_ms": max(got, default=None)}


def rate_row(topology: Topology, rate_mbit: float | None, rtt_ms: float, seconds: float) -> dict:
    topology.set_delay(LinkDelay.symmetric(rtt_ms / 4))
    topology.shape(rate_mbit)
    try:
        mbit, cpu = bulk(topology, 0, 1, seconds=seconds)
    finally:
        topology.shape(None)
    return {"rate_mbit": rate_mbit, "rtt_ms": rtt_ms, "measured_mbit": mbit,
            "ratio": mbit / rate_mbit if rate_mbit else None, "forwarder_cpu_cores": cpu}


def calibrate(rtts: list[float], rates: list[float | None], rate_rtt_ms: float, count: int = 20,
              seconds: float = 6.0, log=print) -> dict:
    with Topology(2, subnet="10.79.0", delay=LinkDelay()) as topology:
        rows = []
        for rtt in rtts:
            rows.append(rtt_row(topology, rtt, count))
            log(f"  RTT {rtt:g} ms: median {rows[-1]['median_ms']} ms over {rows[-1]['received']} echoes")
        rate_rows = []
        for rate in rates:
            rate_rows.append(rate_row(topology, rate, rate_rtt_ms, seconds))
            log(f"  {rate} Mbit/s at RTT {rate_rtt_ms:g} ms: {rate_rows[-1]['measured_mbit']:.2f} Mbit/s, "
                f"forwarders {100 * rate_rows[-1]['forwarder_cpu_cores']:.0f}% of a core")
    return {"rtt": rows, "rates": rate_rows}


def report(data: dict) -> str:
    lines = ["| target RTT (ms) | delay per host, each way (ms) | min RTT (ms) | lower quartile | median | max "
             "| received |", "|---|---|---|---|---|---|---|"]
    for r in data["rtt"]:
        lines.append(f"| {r['target_rtt_ms']:g} | {r['delay_ms_per_host']:g} | {r['min_ms']:.2f} | "
                     f"{r['p25_ms']:.2f} | {r['median_ms']:.2f} | {r['max_ms']:.2f} | {r['received']}/{r['sent']} |")
    lines += ["", "| rate set (Mbit/s) | RTT (ms) | one TCP stream (Mbit/s) | measured / set | "
              "forwarders' CPU (both hosts, share of one core) |", "|---|---|---|---|---|"]
    for r in data["rates"]:
        ratio = "—" if r["ratio"] is None else f"{r['ratio']:.3f}"
        rate = "unshaped" if r["rate_mbit"] is None else f"{r['rate_mbit']:g}"
        lines.append(f"| {rate} | "
                     f"{r['rtt_ms']:g} | {r['measured_mbit']:.2f} | {ratio} | {r['forwarder_cpu_cores']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rtts", default="0,10,20,40,50,100,150,200", help="target ping RTTs in ms")
    parser.add_argument("--rates", default="0.5,1,2,10,50,unshaped", help="Mbit/s per host and direction")
    parser.add_argument("--rate-rtt-ms", type=float, default=40.0, help="RTT during the bulk transfers")
    parser.add_argument("--count", type=int, default=20, help="echoes per RTT")
    parser.add_argument("--seconds", type=float, default=8.0, help="seconds per bulk transfer")
    parser.add_argument("--out", help="JSON file for the results")
    args = parser.parse_args(argv)
    cleanup_leftovers()

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    rates = [None if r == "unshaped" else float(r) for r in args.rates.split(",") if r]
    data = calibrate([float(r) for r in args.rtts.split(",") if r], rates, args.rate_rtt_ms, args.count,
                     args.seconds, log)
    data["command"] = " ".join(["python -m benchmarks.netsim.calibrate", *(argv if argv is not None else sys.argv[1:])])
    if args.out:
        Path(args.out).write_text(json.dumps(data, indent=1))
    print(report(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
