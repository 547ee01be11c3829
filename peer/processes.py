"""The processes below a peer: hivemind's DHT and averager processes and p2pd.

They are started with the stop signals ignored, so a signal to the whole process group reaches
only the peer, which then leaves in order and stops them itself; what is left at exit is killed.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path


@contextlib.contextmanager
def stop_signals_ignored_by_children():
    """SIGINT and SIGTERM ignored while child processes are forked (hivemind's DHT, its averagers): they
    inherit it, so a signal to the whole process group (Ctrl-C, systemd's KillMode) reaches only us,
    and we stop them in order. p2pd, exec'd by the DHT process, keeps SIGINT ignored too (Go respects
    an inherited SIG_IGN for SIGINT) but dies on SIGTERM; the leave tolerates that (bounded DHT calls).
    Our own handlers are restored afterwards (a signal arriving meanwhile is lost: send it again)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc), children before their own children; [] if unknown."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop(0)
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                children = Path(f"/proc/{parent}/task/{task}/children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.append(child)
                    queue.append(child)
    return found


def kill_descendants() -> None:
    """SIGKILL what is left below us (DHT and averager processes, p2pd): they ignore the stop signals."""
    for pid in descendants(os.getpid()):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # reap our own children (grandchildren are reparented)
        try:
            if os.waitpid(-1, os.WNOHANG) == (0, 0):
                time.sleep(0.02)
        except ChildProcessError:
            break


def stop_dht_and_children(dht) -> None:
    """Stop the DHT (and with it p2pd) and anything else still running below us; the exit cannot hang
    on a child that ignores the stop signals."""
    dht.shutdown_timeout = 3.0
    with contextlib.suppress(Exception):
        dht.shutdown()  # it ignores SIGTERM: if it did not stop in time, it is killed below
    kill_descendants()
    with contextlib.suppress(Exception):
        dht.join(2.0)
    for child in multiprocessing.active_children():  # reaps what was killed
        child.join(0.5)
