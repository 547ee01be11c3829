"""Where a trip's time goes, from what a netsim swarm already exposes (issue 27).

The peers keep no per-trip timings, so a cell is explained from outside: each peer's CPU seconds
(`/proc/<pid>/stat`: its main process, and its whole session with p2pd and hivemind's processes) and each
host's forwarder's over the measured window, the machine's load average (the
cores are shared with other work), and the trips each peer holds, which its progress log prints every
`--log-interval` seconds (`in flight N`: `Stats.load`, trips it is serving, not those it drives). With the
drivers' trip rate, Little's law turns trips held into the time a trip spends there, and the CPU share
says how much of that time the peer computed.
"""

from __future__ import annotations

import os
import re
import statistics
import time
from datetime import datetime
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")
_IN_FLIGHT = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+ .* in flight (\d+),")
_SPLIT = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+ .* where trips' time went: stage thread busy (\d+)%, "
                    r"queued (\S+)(?: ms/job)?; reply wait (\S+)(?: ms/trip)?; K/V wait (\S+)(?: ms/layer)?; "
                    r"served (\S+)(?: ms/trip)?$")
SPLIT_KEYS = ("busy_share", "queued_ms", "reply_ms", "kv_ms", "served_ms")


def _stat(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (field 3 onwards), None once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def process_cpu_seconds(pid: int) -> float | None:
    """User + system seconds of one process (None once it is gone): a peer's main process runs its stage's
    torch compute and its event loop."""
    fields = _stat(pid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def session_cpu_seconds(sid: int) -> float:
    """User + system seconds of the live processes of session `sid`: a peer started in its own session with its
    p2pd daemon and hivemind's DHT and averager processes (a process that already exited is not counted)."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        fields = _stat(entry.name) if entry.name.isdigit() else None
        if fields is not None and int(fields[3]) == sid:  # field 6: session id
            total += (int(fields[11]) + int(fields[12])) / _TICK
    return total


def thread_times(pid: int) -> dict[str, tuple[float, float]]:
    """Per thread id: seconds on a CPU and seconds runnable but waiting for one (`/proc/<pid>/task/*/schedstat`)."""
    times = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return times
    for task in tasks:
        try:
            run_ns, wait_ns = (int(v) for v in (task / "schedstat").read_text().split()[:2])
        except (OSError, ValueError):
            continue  # the thread ended
        times[task.name] = (run_ns / 1e9, wait_ns / 1e9)
    return times


def thread_shares(pid: int, before: dict, after: dict, wall: float) -> dict[str, dict[str, float]]:
    """Shares of the window each kind of thread spent running and runnable (waiting for a core): `loop`, the main
    thread (event loop, wire); `stage`, the busiest other thread in the window (Python names no OS thread, but
    `peer/runtime.py`'s one-worker stage executor runs the model: the busiest one while trips flow); `other`, the
    rest together. A stage thread neither running nor runnable waits for work: K/V, a reply, or a trip."""
    deltas = {tid: (end[0] - before.get(tid, (0.0, 0.0))[0], end[1] - before.get(tid, (0.0, 0.0))[1])
              for tid, end in after.items()}
    main = deltas.pop(str(pid), (0.0, 0.0))
    stage = max(deltas, key=lambda tid: deltas[tid][0], default=None)
    busiest = deltas.pop(stage) if stage is not None else (0.0, 0.0)
    rest = (sum(d[0] for d in deltas.values()), sum(d[1] for d in deltas.values()))
    return {kind: {"running": run / wall, "runnable": wait / wall}
            for kind, (run, wait) in {"loop": main, "stage": busiest, "other": rest}.items()}


def loadavg() -> float:
    """The one-minute load average."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def snapshot(swarm) -> dict:
    """CPU seconds so far of every process the swarm started and of every host's forwarder, with the time."""
    return {"at": time.time(), "load": loadavg(),
            "cpu": {child.name: process_cpu_seconds(child.process.pid) for child in swarm.children},
            "session_cpu": {child.name: session_cpu_seconds(child.process.pid) for child in swarm.children},
            "threads": {child.name: thread_times(child.process.pid) for child in swarm.children},
            "forwarders": swarm.topology.forwarder_cpu_seconds()}


def in_flight(log: Path, since: float, until: float) -> list[int]:
    """The `in flight N` values a peer logged between two wall-clock times (its log uses local time)."""
    values = []
    for line in log.read_text(errors="replace").splitlines():
        match = _IN_FLIGHT.match(line)
        if match and since <= datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S").timestamp() <= until:
            values.append(int(match[2]))
    return values


def logged_time_split(log: Path, since: float, until: float) -> dict[str, float | None]:
    """The peer's own account of where trips' time went (`peer/status_log.py` `time_split`), each figure's mean
    over the lines it logged between two wall-clock times: the stage thread's busy share, and the mean ms a job
    waited for the thread, a trip for the next stage's reply, a lane for one layer's K/V, a served trip in all
    (None where no line had it)."""
    rows = []
    for line in log.read_text(errors="replace").splitlines():
        match = _SPLIT.match(line)
        if match and since <= datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S").timestamp() <= until:
            rows.append([int(match[2]) / 100] + [None if v == "-" else float(v) for v in match.groups()[2:]])
    return {key: statistics.mean(column) if (column := [r[i] for r in rows if r[i] is not None]) else None
            for i, key in enumerate(SPLIT_KEYS)}


def served_share(name: str, lanes: int) -> float:
    """The share of the drivers' trips a peer serves (and holds in `in flight`): every one past stage 0; at
    stage 0 a lane serves the other lanes' drivers' chunks ((P-1)/P), a pipeline's driver none."""
    return 1.0 if not name.startswith("stage0") else (lanes - 1) / lanes


def seconds_per_trip(name: str, peer: dict, trip_rate: float, lanes: int) -> float | None:
    """Little's law: the seconds a trip spends at a peer, its trips held over the trips it serves per second."""
    served = trip_rate * served_share(name, lanes)
    return peer["in_flight_mean"] / served if peer["in_flight_mean"] is not None and served > 0 else None


def account(swarm, before: dict, after: dict, cell) -> dict:
    """A cell's accounting: per peer, CPU share of one core (main process, whole session, and per kind of thread
    running and runnable) and trips held (mean of its log lines); machine load at both ends; forwarders' CPU
    share (`seconds_per_trip` turns trips held into time)."""
    wall = max(after["at"] - before["at"], 1e-9)
    trip_rate = cell.trips / cell.window_s if cell.window_s > 0 else 0.0  # driver trips finished per second
    peers = {}
    for child in swarm.children:
        start, end = before["cpu"].get(child.name), after["cpu"].get(child.name)
        held = in_flight(child.log, before["at"], after["at"]) if child.name != "bootstrap" else []
        mean_held = statistics.mean(held) if held else None
        threads = thread_shares(child.process.pid, before["threads"][child.name], after["threads"][child.name], wall)
        peers[child.name] = {
            "cpu_share": None if start is None or end is None else (end - start) / wall,
            "session_cpu_share": (after["session_cpu"][child.name] - before["session_cpu"][child.name]) / wall,
            "in_flight": held, "in_flight_mean": mean_held,
            # Little's law: trips held / trips finished per second = seconds a trip spends at this peer
            "threads": threads,
            "split": logged_time_split(child.log, before["at"], after["at"]) if child.name != "bootstrap" else {},
            "cpu_seconds_per_trip": (end - start) / (trip_rate * wall)
            if start is not None and end is not None and trip_rate > 0 else None,
        }
    forwarders = sum(after["forwarders"].get(i, 0.0) - before["forwarders"].get(i, 0.0) for i in after["forwarders"])
    return {"probe_wall_s": wall, "load_start": before["load"], "load_end": after["load"],
            "trip_rate": trip_rate, "forwarders_cpu_share": forwarders / wall, "peers": peers}
