"""Real peers on an emulated internet: a bootstrap DHT node in one namespace, one `protocol-peer`
per stage in a namespace each, every peer host's link shaped with `tc`.

`NetSwarm` starts and stops the processes (process groups inside the namespaces; the topology
kills whatever is left in its namespaces before deleting them) and measures a *cell*: after the
link rate changes it waits for the pipeline to turn over, then measures over a window, from the
driver's own signed counters (tokens, bytes in/out, loss) and the veths' byte counters.

The bootstrap reads every stage's records (for the driver's counters) every `records_interval`
seconds, by default as often as the tracker polls a real swarm (`tracker.summary.POLL_INTERVAL`):
each read is answered by the peers' DHT nodes over their shaped uplinks, so a harness that read more
often than any real reader would count its own traffic against the swarm's.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.netsim.net import Topology
from launcher.supervisor import stop_process_groups
from swarm.manifest import Manifest, save_manifest
from tracker.summary import POLL_INTERVAL

REPO = Path(__file__).resolve().parents[2]


class NetSimError(RuntimeError):
    pass


@dataclass
class Sample:
    at: float  # wall-clock time the driver announced these counters
    tokens: int
    trips: int
    bytes_in: int
    bytes_out: int
    loss: float | None
    epoch: int


@dataclass
class Cell:
    mode: str
    rate_mbit: float | None  # None: unshaped
    repeat: int
    tokens_per_s: float
    window_s: float
    tokens: int  # trained during the window
    trips: int
    app_bytes_per_token: float  # driver's boundary, both directions, as the peer counted messages
    veth_bytes_per_token: float  # every byte on every peer host's link (upload), all boundaries + DHT
    loss_start: float | None
    loss_end: float | None
    tokens_total: int  # driver tokens at the end of the window
    epochs: list[int] = field(default_factory=list)  # optimizer epoch per stage at the end
    upload_kbit_s: list[float] = field(default_factory=list)  # per peer host, mean over the window
    unwedged: int = 0  # stalled shaped queues restarted during settle + window (Topology.unwedge)
    errors: int = 0


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    log: Path


class NetSwarm:
    def __init__(self, manifest: Manifest, workdir: Path, max_inflight: int = 4, trip_timeout: float = 300.0,
                 tag: str | None = None, log=print, records_interval: float = POLL_INTERVAL):
        self.manifest, self.workdir, self.records_interval = manifest, workdir, records_interval
        self.max_inflight, self.trip_timeout = max_inflight, trip_timeout
        self.topology = Topology(manifest.num_stages + 1, tag=tag)  # host 0: bootstrap; host i+1: stage i
        self.children: list[Child] = []
        self.samples: list[Sample] = []
        self.records: list[dict] = []
        self.log = log
        self.manifest_path = workdir / "manifest.json"

    # --- processes ------------------------------------------------------------------------------

    def _spawn(self, name: str, host_index: int, argv: list[str]) -> Child:
        log = self.workdir / f"{name}.log"
        handle = log.open("wb")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        host = self.topology.hosts[host_index]
        process = subprocess.Popen(self.topology.exec_prefix(host) + argv, stdout=handle, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True, env=env, cwd=str(REPO))
        handle.close()
        child = Child(name, process, log)
        self.children.append(child)
        return child

    def start(self, timeout: float = 90.0) -> None:
        self.topology.create()
        save_manifest(self.manifest, self.manifest_path)
        bootstrap_host = self.topology.hosts[0]
        self._spawn("bootstrap", 0, [sys.executable, "-m", "benchmarks.netsim.bootstrap", "--manifest",
                                     str(self.manifest_path), "--host", bootstrap_host.address,
                                     "--out", str(self.workdir), "--interval", str(self.records_interval)])
        maddrs_file = self.workdir / "maddrs.json"
        deadline = time.monotonic() + timeout
        while not maddrs_file.exists():
            self.check_children()
            if time.monotonic() > deadline:
                raise NetSimError("the bootstrap DHT did not start")
            time.sleep(0.2)
        maddrs = json.loads(maddrs_file.read_text())
        peer = [sys.executable, "-m", "peer.cli"]  # this checkout's code (PYTHONPATH), not whatever is installed
        for stage in range(self.manifest.num_stages):
            host = self.topology.hosts[stage + 1]
            self._spawn(f"stage{stage}", stage + 1, [
                *peer, "--manifest", str(self.manifest_path), "--initial-peers", *maddrs, "--stage", str(stage),
                "--host-maddrs", f"/ip4/{host.address}/tcp/0", "--device", "cpu",
                "--public-name", f"netsim-stage{stage}", "--max-inflight", str(self.max_inflight),
                "--trip-timeout", str(self.trip_timeout), "--log-interval", "10",
                "--checkpoint-every", "1000000"])

    def check_children(self) -> None:
        for child in self.children:
            code = child.process.poll()
            if code is not None:
                tail = child.log.read_text(errors="replace")[-3000:]
                raise NetSimError(f"{child.name} exited with code {code}; its log ends:\n{tail}")

    def stop(self) -> None:
        """Stop every process we started, then delete the namespaces (which kills any stragglers)."""
        try:
            stop_process_groups([child.process for child in self.children], grace=15.0)
        finally:
            self.topology.close()

    def pids(self) -> list[int]:
        return [c.process.pid for c in self.children]

    # --- observation ------------------------------------------------------------------------------

    def poll(self) -> list[dict]:
        self.check_children()
        if self.topology.unwedge():
            self.log(f"  restarted a stalled shaped queue (total {self.topology.unwedged})")
        path = self.workdir / "records.json"
        try:
            data = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return self.records
        self.records = data["records"]
        for record in self.records:
            if record["stage"] == 0 and record["state"] == "online":
                if not self.samples or record["announced_at"] > self.samples[-1].at + 1e-3:
                    self.samples.append(Sample(record["announced_at"], record["tokens"], record["trips"],
                                               record["bytes_in"], record["bytes_out"], record["loss"],
                                               record["optimizer_epoch"]))
        return self.records

    def wait_training(self, timeout: float = 240.0, trips: int = 1) -> None:
        """Until every stage is online and the driver has finished `trips` trips."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            records = self.poll()
            online = {r["stage"] for r in records if r["state"] == "online"}
            if len(online) == self.manifest.num_stages and self.samples and self.samples[-1].trips >= trips:
                return
            time.sleep(1.0)
        raise NetSimError(f"the swarm did not start training within {timeout:.0f}s; logs in {self.workdir}")

    def _wait_sample_after(self, when: float, timeout: float) -> Sample:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            if self.samples and self.samples[-1].at > when:
                return self.samples[-1]
            time.sleep(0.5)
        raise NetSimError("the driver stopped announcing")

    def measure(self, mode: str, rate_mbit: float | None, repeat: int = 0, min_window: float = 40.0,
                max_window: float = 150.0, min_trips: int = 6, settle_trips: int | None = None,
                settle_max: float = 120.0) -> Cell:
        """Shape the peer hosts' links, let the pipeline turn over, and measure one cell."""
        self.topology.shape(rate_mbit, self.topology.hosts[1:])
        shaped_at, unwedged = time.time(), self.topology.unwedged
        settle_trips = self.max_inflight if settle_trips is None else settle_trips
        first = self._wait_sample_after(shaped_at, 30.0)
        while time.time() - shaped_at < settle_max:  # trips sent before the change have drained
            last = self._wait_sample_after(self.samples[-1].at, 30.0)
            if last.trips - first.trips >= settle_trips:
                break
        start = self.samples[-1]
        counters_start, wall_start = self.topology.counters(), time.time()
        while True:
            end = self._wait_sample_after(self.samples[-1].at, 30.0)
            elapsed = end.at - start.at
            if (elapsed >= min_window and end.trips - start.trips >= min_trips) or elapsed >= max_window:
                break
        counters_end, wall_end = self.topology.counters(), time.time()
        tokens = end.tokens - start.tokens
        seconds = end.at - start.at
        rate = tokens / seconds if seconds > 0 else 0.0
        upload = sum(counters_end[i][0] - counters_start[i][0] for i in range(1, len(self.topology.hosts)))
        wire_tokens = rate * (wall_end - wall_start)
        epochs = [max((r["optimizer_epoch"] for r in self.records if r["stage"] == s), default=0)
                  for s in range(self.manifest.num_stages)]
        cell = Cell(
            mode=mode, rate_mbit=rate_mbit, repeat=repeat, tokens_per_s=rate, window_s=seconds, tokens=tokens,
            trips=end.trips - start.trips,
            # cumulative: a window's delta counts messages of trips still in flight against finished tokens
            app_bytes_per_token=(end.bytes_in + end.bytes_out) / max(end.tokens, 1),
            veth_bytes_per_token=upload / wire_tokens if wire_tokens > 0 else float("nan"),
            loss_start=start.loss, loss_end=end.loss, tokens_total=end.tokens, epochs=epochs,
            errors=sum(r["errors"] for r in self.records),
            upload_kbit_s=[8e-3 * (counters_end[i][0] - counters_start[i][0]) / max(wall_end - wall_start, 1e-9)
                           for i in range(1, len(self.topology.hosts))],
            unwedged=self.topology.unwedged - unwedged,
        )
        self.log(f"  {mode:<10} {_rate_label(rate_mbit):>9}: {rate:8.1f} tokens/s over {seconds:.0f}s "
                 f"({cell.trips} trips), {cell.app_bytes_per_token:.1f} B/token at the driver, "
                 f"{cell.veth_bytes_per_token:.1f} B/token on the links, uploads "
                 f"{'/'.join(f'{u:.0f}' for u in cell.upload_kbit_s)} kbit/s, loss {cell.loss_end}")
        return cell

    def loss_trace(self) -> list[tuple[int, float]]:
        return [(s.tokens, s.loss) for s in self.samples if s.loss is not None]


def _rate_label(rate_mbit: float | None) -> str:
    return "unshaped" if rate_mbit is None else f"{rate_mbit:g} Mbit/s"


def median_cells(cells: list[Cell]) -> dict:
    """One row per (mode, rate): medians over repeats."""
    rows: dict[tuple[str, float | None], list[Cell]] = {}
    for cell in cells:
        rows.setdefault((cell.mode, cell.rate_mbit), []).append(cell)
    out = {}
    for key, group in rows.items():
        out[key] = {
            "mode": key[0], "rate_mbit": key[1], "repeats": len(group),
            "tokens_per_s": statistics.median(c.tokens_per_s for c in group),
            "tokens_per_s_all": [c.tokens_per_s for c in group],
            "app_bytes_per_token": statistics.median(c.app_bytes_per_token for c in group),
            "veth_bytes_per_token": statistics.median(c.veth_bytes_per_token for c in group),
            "loss_end": group[-1].loss_end, "tokens_total": group[-1].tokens_total,
        }
    return out


def cell_dict(cell: Cell) -> dict:
    return asdict(cell)
