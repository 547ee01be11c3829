"""A stage move releases the old stage (issue 14): a real peer daemon moved 5 times between the stages of a
live 2-stage swarm (tests/mover_peer.py forces the move policy, the rest is the daemon's) keeps its memory,
threads and child processes bounded, lets every stage it left be collected, and leaves no task pending."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from launcher.supervisor import LocalSwarm, stop_process_groups
from swarm.presets import preset

MOVES = 5
REPO = Path(__file__).resolve().parents[1]
POOL_BOUND = min(32, (os.cpu_count() or 1) + 4)  # concurrent.futures' default max_workers, asyncio's default executor's


def thread_families(names: list[str]) -> tuple[Counter, list[str]]:
    """(workers per thread-pool executor, by name prefix; every other thread) from thread names."""
    pools: Counter = Counter()
    others = []
    for name in names:
        worker = re.fullmatch(r"(asyncio|ThreadPoolExecutor-\d+)_\d+", name)
        if worker:
            pools[worker[1]] += 1
        else:
            others.append(name)
    return pools, others


@pytest.mark.slow
def test_five_moves_release_every_stage(tmp_path: Path):
    swarm = LocalSwarm(preset("tiny", stages=2), 1, tmp_path, max_inflight=1, with_tracker=False)
    log = tmp_path / "mover.log"
    mover = None
    try:
        swarm.start()
        with log.open("wb") as err:
            mover = subprocess.Popen(
                [sys.executable, str(REPO / "tests" / "mover_peer.py"), "--manifest", str(swarm.manifest_path),
                 "--initial-peers", *swarm.bootstrap, "--moves", str(MOVES)],
                stdout=subprocess.PIPE, stderr=err, start_new_session=True, cwd=REPO,
                env={"OMP_NUM_THREADS": "1", **os.environ},
            )
        out, _ = mover.communicate(timeout=480)
    finally:
        stop_process_groups([mover] if mover is not None else [], grace=10.0)
        swarm.stop()
    rows = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    moves = [r for r in rows if "moves" in r]
    text = log.read_text(errors="replace")
    assert len(moves) == MOVES and rows[-1].get("exit"), text[-3000:]
    assert "Task was destroyed but it is pending" not in text
    assert all(r["runtimes_alive"] == 0 for r in moves)  # every stage left was collected
    first, last = moves[0], moves[-1]
    # A leaked stage grows memory at every move (before the fix: 493 -> 673 MiB over 5 moves, ~45 MiB each, so
    # ~135 MiB from move 2 to move 5). The allocator also moves by itself, up and down (CI: +58 MiB once at move 2;
    # a loaded run: +50 MiB once between moves 2 and 5; another: two rises of >10 MiB and dips, +12 MiB net), so
    # the check is the net growth after move 2 (the peer has held both stages), against two leaked moves' worth.
    rss = [r["rss_mib"] for r in moves]
    assert rss[-1] - rss[1] <= 90, moves
    assert last["children"] == first["children"], moves
    # Threads: a leaked stage keeps its threads or its executor. Executor workers are started lazily, up to the
    # executor's bound, when the load makes calls overlap (a CI run: 8 threads at move 1, 10 at move 5), so they
    # are checked per executor against that bound, and every other thread by count. Each stage has an unnamed
    # pool (its state averager's): none of a stage left may run (a CI run had move 5's still running, stopped
    # only once the garbage collector took it, until the stage's shutdown stopped it)
    first_pools, first_others = thread_families(first["thread_names"])
    last_pools, last_others = thread_families(last["thread_names"])
    assert not any(set(r["released_pools"]) & set(thread_families(r["thread_names"])[0]) for r in moves), moves
    assert set(last_pools) == set(first_pools) and max(last_pools.values()) <= POOL_BOUND, moves
    assert len(last_others) <= len(first_others) + 1, moves
    assert last["tasks"] <= first["tasks"], moves
