"""Real peers on an emulated internet: a bootstrap DHT node in one namespace, one `protocol-peer`
per stage (with context parallelism, per stage and lane) in a namespace each, every peer host's link
shaped with `tc`.

`NetSwarm` starts and stops the processes (process groups inside the namespaces; the topology
kills whatever is left in its namespaces before deleting them) and measures a *cell*: after the
link rate changes it waits for the pipeline to turn over, then measures over a window, from the
driver's own signed counters (tokens, bytes in/out, loss) and the veths' byte counters. With lanes
every stage-0 peer drives trips: the swarm's tokens/s is the sum of the drivers' rates, each over its
own announcements, and the K/V bytes come from the peers' heartbeat files.

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

from benchmarks.netsim.delay import LinkDelay
from benchmarks.netsim.net import Topology
from launcher.supervisor import stop_process_groups
from swarm.context_parallel import kv_bytes_per_token
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
    kv_bytes_per_token: float | None = None  # K/V messages sent by every lane (heartbeats) per sequence token


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    log: Path


class NetSwarm:
    def __init__(self, manifest: Manifest, workdir: Path, max_inflight: int = 4, trip_timeout: float = 300.0,
                 tag: str | None = None, log=print, records_interval: float = POLL_INTERVAL,
                 peer_args: tuple[str, ...] = (), delay: LinkDelay | None = None):
        self.manifest, self.workdir, self.records_interval = manifest, workdir, records_interval
        self.max_inflight, self.trip_timeout, self.peer_args = max_inflight, trip_timeout, list(peer_args)
        self.lanes = manifest.lanes
        # host 0: the bootstrap; host 1 + stage * lanes + lane: that stage's lane
        # with `delay` every host's link, the bootstrap's too, is a delayed one (net.py)
        self.topology = Topology(manifest.num_stages * self.lanes + 1, tag=tag, delay=delay)
        self.children: list[Child] = []
        self.series: dict[str, list[Sample]] = {}  # per driver (stage-0 peer id)
        self.drivers: set[str] = set()  # stage-0 peers online at the last poll
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
        for index, (stage, lane) in enumerate(self.slots(), start=1):
            host, name = self.topology.hosts[index], self.peer_name(stage, lane)
            lanes = ["--lane", str(lane), "--heartbeat-file", str(self.heartbeat(name))] if self.lanes > 1 else []
            self._spawn(name, index, [
                *peer, "--manifest", str(self.manifest_path), "--initial-peers", *maddrs, "--stage", str(stage),
                *lanes, "--host-maddrs", f"/ip4/{host.address}/tcp/0", "--device", "cpu",
                "--public-name", f"netsim-{name}", "--max-inflight", str(self.max_inflight),
                "--trip-timeout", str(self.trip_timeout), "--log-interval", "10",
                "--checkpoint-every", "1000000", *self.peer_args])

    def slots(self) -> list[tuple[int, int]]:
        """(stage, lane) of peer hosts 1, 2, ... in order."""
        return [(stage, lane) for stage in range(self.manifest.num_stages) for lane in range(self.lanes)]

    def peer_name(self, stage: int, lane: int) -> str:
        return f"stage{stage}" if self.lanes == 1 else f"stage{stage}-lane{lane}"

    def heartbeat(self, name: str) -> Path:
        return self.workdir / f"{name}.heartbeat.json"

    def kv_per_token(self) -> float | None:
        """K/V bytes per token of the whole sequence since the peers started (`kv_bytes_per_token`: each
        peer's bytes against its own chunk tokens, so heartbeats written at other moments than the drivers'
        announcements do not cut it; the shape fixes it, so the whole run measures the window's)."""
        beats = []
        for stage, lane in self.slots():
            try:
                beats.append(json.loads(self.heartbeat(self.peer_name(stage, lane)).read_text()))
            except (OSError, ValueError):
                continue  # not written yet
        return kv_bytes_per_token(beats, self.lanes)

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
        self.drivers = set()
        for record in self.records:
            if record["stage"] == 0 and record["state"] == "online":
                self.drivers.add(record["peer_id"])
                series = self.series.setdefault(record["peer_id"], [])
                if not series or record["announced_at"] > series[-1].at + 1e-3:
                    series.append(Sample(record["announced_at"], record["tokens"], record["trips"],
                                         record["bytes_in"], record["bytes_out"], record["loss"],
                                         record["optimizer_epoch"]))
        return self.records

    def latest(self) -> dict[str, Sample]:
        """Each online driver's last announced counters."""
        return {peer: self.series[peer][-1] for peer in self.drivers if self.series.get(peer)}

    def wait_training(self, timeout: float = 240.0, trips: int = 1) -> None:
        """Until every stage's lanes are online and the drivers have finished `trips` trips."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            records = self.poll()
            online = {(r["stage"], r.get("lane", 0)) for r in records if r["state"] == "online"}
            if online >= set(self.slots()) and sum(s.trips for s in self.latest().values()) >= trips:
                return
            time.sleep(1.0)
        raise NetSimError(f"the swarm did not start training within {timeout:.0f}s; logs in {self.workdir}")

    def _wait_fresh(self, when: float, timeout: float) -> dict[str, Sample]:
        """The drivers' latest counters once every online driver has announced after `when`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            latest = self.latest()
            if latest and all(sample.at > when for sample in latest.values()):
                return latest
            time.sleep(0.5)
        raise NetSimError("the driver stopped announcing")

    def measure(self, mode: str, rate_mbit: float | None, repeat: int = 0, min_window: float = 40.0,
                max_window: float = 150.0, min_trips: int = 6, settle_trips: int | None = None,
                settle_max: float = 120.0) -> Cell:
        """Shape the peer hosts' links, let the pipeline turn over, and measure one cell."""
        self.topology.shape(rate_mbit, self.topology.hosts[1:])
        shaped_at, unwedged = time.time(), self.topology.unwedged
        settle_trips = self.max_inflight if settle_trips is None else settle_trips
        announce = 30.0 + 2 * self.records_interval  # a driver announces every 10 s; the bootstrap reads at its pace
        first = self._wait_fresh(shaped_at, announce)
        while time.time() - shaped_at < settle_max:  # trips sent before the change have drained
            last = self._wait_fresh(_newest(self.latest()), announce)
            if _delta(first, last, "trips") >= settle_trips:
                break
        start = self.latest()
        counters_start, wall_start = self.topology.counters(), time.time()
        while True:
            end = self._wait_fresh(_newest(self.latest()), announce)
            both = [peer for peer in start if peer in end]
            elapsed = min((end[peer].at - start[peer].at for peer in both), default=0.0)
            trips = _delta(start, end, "trips")
            if (elapsed >= min_window and trips >= min_trips) or elapsed >= max_window:
                break
        counters_end, wall_end = self.topology.counters(), time.time()
        tokens = _delta(start, end, "tokens")
        seconds = statistics.mean(end[peer].at - start[peer].at for peer in both) if both else 0.0
        # each driver's tokens over its own announcements: their announce times differ by up to 10 s
        rate = sum((end[p].tokens - start[p].tokens) / (end[p].at - start[p].at) for p in both
                   if end[p].at > start[p].at)
        upload = sum(counters_end[i][0] - counters_start[i][0] for i in range(1, len(self.topology.hosts)))
        wire_tokens = rate * (wall_end - wall_start)
        epochs = [max((r["optimizer_epoch"] for r in self.records if r["stage"] == s), default=0)
                  for s in range(self.manifest.num_stages)]
        totals = [end[peer] for peer in both]
        cell = Cell(
            mode=mode, rate_mbit=rate_mbit, repeat=repeat, tokens_per_s=rate, window_s=seconds, tokens=tokens,
            trips=_delta(start, end, "trips"),
            # cumulative: a window's delta counts messages of trips still in flight against finished tokens
            app_bytes_per_token=sum(s.bytes_in + s.bytes_out for s in totals) / max(sum(s.tokens for s in totals), 1),
            veth_bytes_per_token=upload / wire_tokens if wire_tokens > 0 else float("nan"),
            loss_start=_mean_loss(start.values()), loss_end=_mean_loss(totals),
            tokens_total=sum(s.tokens for s in totals), epochs=epochs,
            errors=sum(r["errors"] for r in self.records),
            upload_kbit_s=[8e-3 * (counters_end[i][0] - counters_start[i][0]) / max(wall_end - wall_start, 1e-9)
                           for i in range(1, len(self.topology.hosts))],
            unwedged=self.topology.unwedged - unwedged,
            kv_bytes_per_token=self.kv_per_token() if self.lanes > 1 else None,
        )
        self.log(f"  {mode:<10} {_rate_label(rate_mbit):>9}: {rate:8.1f} tokens/s over {seconds:.0f}s "
                 f"({cell.trips} trips), {cell.app_bytes_per_token:.1f} B/token at the driver, "
                 f"{cell.veth_bytes_per_token:.1f} B/token on the links, uploads "
                 f"{'/'.join(f'{u:.0f}' for u in cell.upload_kbit_s)} kbit/s, loss {cell.loss_end}")
        return cell

    def loss_trace(self) -> list[tuple[int, float]]:
        """(tokens all drivers had announced, the loss one of them announced), in announcement order."""
        tokens: dict[str, int] = {}
        trace = []
        announced = [(peer, sample) for peer, series in self.series.items() for sample in series]
        for peer, sample in sorted(announced, key=lambda item: item[1].at):
            tokens[peer] = sample.tokens
            if sample.loss is not None:
                trace.append((sum(tokens.values()), sample.loss))
        return trace


def _newest(latest: dict[str, Sample]) -> float:
    return max((sample.at for sample in latest.values()), default=0.0)


def _delta(start: dict[str, Sample], end: dict[str, Sample], counter: str) -> int:
    """How far `counter` went from `start` to `end`, summed over the drivers in both."""
    return sum(getattr(end[peer], counter) - getattr(start[peer], counter) for peer in start if peer in end)


def _mean_loss(samples) -> float | None:
    losses = [s.loss for s in samples if s.loss is not None]
    return statistics.mean(losses) if losses else None


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
