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


def loadavg() -> float:
    """The one-minute load average."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def snapshot(swarm) -> dict:
    """CPU seconds so far of every process the swarm started and of every host's forwarder, with the time."""
    return {"at": time.time(), "load": loadavg(),
            "cpu": {child.name: process_cpu_seconds(child.process.pid) for child in swarm.children},
            "session_cpu": {child.name: session_cpu_seconds(child.process.pid) for child in swarm.children},
            "forwarders": swarm.topology.forwarder_cpu_seconds()}


def in_flight(log: Path, since: float, until: float) -> list[int]:
    """The `in flight N` values a peer logged between two wall-clock times (its log uses local time)."""
    values = []
    for line in log.read_text(errors="replace").splitlines():
        match = _IN_FLIGHT.match(line)
        if match and since <= datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S").timestamp() <= until:
            values.append(int(match[2]))
    return values


def account(swarm, before: dict, after: dict, cell) -> dict:
    """A cell's accounting: per peer, CPU share of one core and trips held (mean of its log lines); machine
    load at both ends; forwarders' CPU share; and Little's law's seconds per trip at each peer."""
    wall = max(after["at"] - before["at"], 1e-9)
    trip_rate = cell.trips / cell.window_s if cell.window_s > 0 else 0.0  # driver trips finished per second
    peers = {}
    for child in swarm.children:
        start, end = before["cpu"].get(child.name), after["cpu"].get(child.name)
        held = in_flight(child.log, before["at"], after["at"]) if child.name != "bootstrap" else []
        mean_held = statistics.mean(held) if held else None
        peers[child.name] = {
            "cpu_share": None if start is None or end is None else (end - start) / wall,
            "session_cpu_share": (after["session_cpu"][child.name] - before["session_cpu"][child.name]) / wall,
            "in_flight": held, "in_flight_mean": mean_held,
            # Little's law: trips held / trips finished per second = seconds a trip spends at this peer
            "seconds_per_trip": mean_held / trip_rate if mean_held is not None and trip_rate > 0 else None,
            "cpu_seconds_per_trip": (end - start) / (trip_rate * wall)
            if start is not None and end is not None and trip_rate > 0 else None,
        }
    forwarders = sum(after["forwarders"].get(i, 0.0) - before["forwarders"].get(i, 0.0) for i in after["forwarders"])
    return {"probe_wall_s": wall, "load_start": before["load"], "load_end": after["load"],
            "trip_rate": trip_rate, "forwarders_cpu_share": forwarders / wall, "peers": peers}
