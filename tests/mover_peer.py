"""A real peer daemon whose move policy is forced: it moves to the other stage of a 2-stage run every
`--dwell` seconds online, `--moves` times, then leaves. Everything a move does (leave, release the
stage, build the next) is the daemon's own (`peer/stage_service.py` `StageService`). After each move
it prints one JSON line with its resident memory, threads and child processes, for
tests/test_stage_moves.py.

    python tests/mover_peer.py --manifest M --initial-peers ADDR --moves 5 --dwell 8
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import threading
import time
import weakref

from peer.daemon import PeerDaemon
from peer.lanes import Slot
from peer.options import PeerOptions
from peer.placement import Hysteresis
from peer.stage_service import PeerParts
from swarm.manifest import load_manifest


def rss_mib(pid: int) -> float:
    """Resident memory of `pid` from /proc (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def descendants(root: int) -> list[int]:
    """Every process below `root`, from the parent ids in /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def state_pool(runtime) -> str:
    """The thread-name prefix of a stage's hivemind state averager's step executor: one unnamed pool per stage
    (`ThreadPoolExecutor-N`), whose worker starts at the stage's first state round."""
    return runtime.optimizer.state_averager.step_executor._thread_name_prefix


class Mover(PeerDaemon):
    def __init__(self, *args, moves: int, dwell: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.moves_left, self.dwell, self.moved = moves, dwell, 0
        self.released: list[weakref.ref] = []  # the stages this peer left: each must be collected
        self.released_pools: list[str] = []  # their state averagers' thread pools: each must have stopped

    async def move_target(self) -> Slot | None:
        if time.monotonic() - self.service.online_since < self.dwell:
            return None
        self.released.append(weakref.ref(self.service.runtime))  # the stage this move leaves
        self.released_pools.append(state_pool(self.service.runtime))
        return 1 - self.service.index, 0

    async def serve(self, parts: PeerParts, slot: Slot) -> Slot | None:
        target = await super().serve(parts, slot)
        if target is None:
            return None
        self.moved += 1
        gc.collect()  # a task dropped while pending is reported here, by asyncio's logger
        kids = descendants(os.getpid())
        print(
            json.dumps(
                dict(
                    moves=self.moved,
                    rss_mib=rss_mib(os.getpid()),
                    children=len(kids),
                    children_rss_mib=sum(rss_mib(pid) for pid in kids),
                    threads=threading.active_count(),
                    thread_names=sorted(t.name for t in threading.enumerate()),
                    tasks=len(asyncio.all_tasks()),
                    runtimes_alive=sum(ref() is not None for ref in self.released),
                    released_pools=self.released_pools,
                )
            ),
            flush=True,
        )
        if self.moved >= self.moves_left:
            self.stopping.set()
            return None
        return target


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--manifest", required=True)
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--moves", type=int, default=5)
    parser.add_argument("--dwell", type=float, default=8.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    options = PeerOptions(
        stage="auto",
        initial_peers=args.initial_peers,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        device="cpu",
        public_name="mover",
        max_inflight=1,
        rebalance_interval=2.0,
        hysteresis=Hysteresis(min_dwell=0.0, recheck_delay=1.0),
        drain_timeout=10.0,
    )
    daemon = Mover(load_manifest(args.manifest), options, moves=args.moves, dwell=args.dwell)
    daemon.start_dht()
    loop = asyncio.new_event_loop()
    loop.run_until_complete(daemon.main())
    gc.collect()
    left = sorted(str(task.get_coro()) for task in asyncio.all_tasks(loop))
    print(json.dumps(dict(exit=True, tasks_left=left)), flush=True)
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
