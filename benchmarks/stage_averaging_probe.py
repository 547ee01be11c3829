"""Probe: a local swarm d0 d1 (stage 0) a1 b1 (stage 1), tiny preset; tokens over a window, state loads, bans,
shared state hashes between replicas, each replica's state hashes, and the CPU seconds each process tree used
over the window (the machine's cores are what the stages' trips and the averaging share).
Usage: [PYTHONPATH=tree] TESTS=tree/tests python probe.py SECONDS OUT"""
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, os.environ["TESTS"])
from harness import entries_by_name, online, swarm_of

import peer
from swarm.presets import preset

manifest = preset("tiny", stages=2)
if os.environ.get("TARGET"):
    batch = manifest.batch.model_copy(update={"target_batch_size": int(os.environ["TARGET"])})
    manifest = manifest.model_copy(update={"batch": batch})
out = Path(sys.argv[2])
shutil.rmtree(out, ignore_errors=True)
names = ["d0", "d1", "a1", "b1"]


def cpu_seconds():
    """CPU seconds of this probe's descendants, by (peer, role): the peer process, its p2pd, its other children
    (hivemind's DHT and averager processes, in the order they were started)."""
    procs = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        procs[int(pid)] = (int(stat[1]), (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK"), cmd)
    out = {}
    for pid, (ppid, _, cmd) in procs.items():
        if ppid == os.getpid():
            words = cmd.split()
            named = "--public-name" in words  # a peer; else the bootstrap DHT's process or torch's
            peer_name = words[words.index("--public-name") + 1] if named else words[min(1, len(words) - 1)][-20:]
            out[(peer_name, "peer")] = procs[pid][1]
            kids = sorted(k for k, v in procs.items() if v[0] == pid)
            for i, k in enumerate(kids):  # each with its own children (the DHT's p2pd)
                tree = [k] + [g for g, v in procs.items() if v[0] == k]
                out[(peer_name, "p2pd" if "p2pd" in procs[k][2] else f"child{i}")] = sum(procs[g][1] for g in tree)
    return out
with swarm_of(manifest, name="probe") as swarm:
    for n, s in [("d0", "0"), ("d1", "0"), ("a1", "1"), ("b1", "1")]:
        swarm.spawn_peer(n, s)
    while not online(swarm, names):
        time.sleep(1)
    time.sleep(15)
    def tokens():
        return sum(e.record.tokens for e in entries_by_name(swarm).values() if e.record.stage == 0)
    start, t0, cpu0 = tokens(), time.monotonic(), cpu_seconds()
    time.sleep(int(sys.argv[1]))
    cpu1 = cpu_seconds()
    cpu = {f"{k[0]}/{k[1]}": round(v - cpu0.get(k, 0.0), 1) for k, v in sorted(cpu1.items())}
    entries = entries_by_name(swarm)
    rate = (tokens() - start) / (time.monotonic() - t0)
    shared = {s: len(set(entries[a].record.state_hashes) & set(entries[b].record.state_hashes))
              for s, (a, b) in {0: ("d0", "d1"), 1: ("a1", "b1")}.items()}
    epochs = {n: entries[n].record.optimizer_epoch for n in names}
    hashes = {n: [h[:12] for h in entries[n].record.state_hashes] for n in names}
    shutil.copytree(swarm.workdir, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("checkpoints"))
logs = "".join((out / f"{n}.log").read_text() for n in names)
print(json.dumps(dict(code=str(Path(peer.__file__).parent.parent), tokens_per_s=round(rate), epochs=epochs,
                      shared_state_hashes=shared, took_state=logs.count("took state"), bans=logs.count("banned peer"),
                      no_group=logs.count("could not find a group"), cpu=cpu, hashes=hashes)))
