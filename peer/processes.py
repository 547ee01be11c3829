"""The processes below a peer: hivemind's DHT and averager processes and p2pd.

They are started with the stop signals ignored (they alone: the peer keeps its handlers), so a signal
to the whole process group reaches only the peer, which then leaves in order and stops them itself;
what is left at exit is killed. A hard-exit timer armed at the first stop signal bounds the exit. Every
way out removes the hivemind sockets this process and its children made (`p2pio/sockets.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from p2pio.sockets import remove_own_socket_dir

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def stop_signals_ignored_by_children():
    """Children forked inside this block (hivemind's DHT, its averagers) do not die of SIGINT or SIGTERM, so
    a signal to the whole process group (Ctrl-C, systemd's KillMode) stops only us, and we stop them in order.

    Meanwhile this process's stop signals are not ignored but *remembered*: the handler in the block only
    notes the signal, the forked children inherit that harmless handler (hivemind's DHT and averager
    processes set SIGINT ignored themselves), and at the end of the block our own handlers are put back
    (also over the SIG_IGN that hivemind's `DecentralizedAverager.run_in_background` sets in the parent) and
    every signal noted meanwhile is raised again. So a group SIGTERM while a stage runtime is being built
    (seconds: a state download) is handled once the build returns, not lost. p2pd, exec'd by the DHT
    process, gets the default action back on exec and dies on a group signal; the leave tolerates that
    (bounded DHT calls)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    previous = {sig: signal.signal(sig, lambda sig, frame: noted.append(sig)) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(noted):  # once each, in order
            signal.raise_signal(sig)


def arm_hard_exit(seconds: float, message: str) -> threading.Timer:
    """After `seconds`, log `message`, kill what is below us and exit (status 1), from a daemon thread: it
    fires even if the event loop is blocked (a hivemind join, a stuck DHT call), so a peer told to stop
    exits whatever hangs."""

    def expire() -> None:
        logging.getLogger("peer").warning("%s", message)
        exit_now(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    return timer


def exit_now(code: int) -> NoReturn:
    """End this process with status `code` now: flush the logs, kill what is still below us, remove our hivemind
    sockets. Without interpreter shutdown: a DHT call abandoned at its timeout may hold a worker thread that
    it would join forever."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    kill_descendants()
    remove_own_socket_dir()  # after the kill: nothing of ours is left to listen on them
    os._exit(code)


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


def is_torch_shm_manager(pid: int) -> bool:
    """Whether `pid` is torch's shared-memory manager (hivemind shares tensors through files, which starts it)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "torch_shm_manager"[:15]  # comm keeps 15 chars
    except OSError:
        return False


def kill_descendants() -> None:
    """SIGKILL what is left below us (DHT and averager processes, p2pd): they ignore the stop signals.

    Not torch's shared-memory manager: it leaves by itself once its last client has gone, unlinking the shared
    files, and this process still frees shared tensors after the kill; each free is a message to the manager,
    and a message to a killed one aborts the process from a C++ destructor ("terminate called after throwing
    an instance of 'std::system_error' ... Broken pipe")."""
    for pid in descendants(os.getpid()):
        if is_torch_shm_manager(pid):
            continue
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
    """Stop the DHT (and with it p2pd), if one was started, and anything else still running below us, then
    remove our hivemind sockets; the exit cannot hang on a child that ignores the stop signals."""
    if dht is not None:
        dht.shutdown_timeout = 3.0
        with contextlib.suppress(Exception):
            dht.shutdown()  # it ignores SIGTERM: if it did not stop in time, it is killed below
    kill_descendants()
    if dht is not None:
        with contextlib.suppress(Exception):
            dht.join(2.0)
    for child in multiprocessing.active_children():  # reaps what was killed
        child.join(0.5)
    remove_own_socket_dir()


def close_abandoned_loops() -> int:
    """Cancel the pending tasks of event loops nobody runs any more, run each loop until they finish, and close it;
    returns how many tasks were cancelled. Call it off every running loop (from a worker thread).

    hivemind's `ProgressTracker` runs its own loop in a thread and leaves its shutdown-checker task pending
    there when it stops; with the thread gone nobody runs that loop again, and when the task is collected
    asyncio reports "Task was destroyed but it is pending!" (once per stage the peer served). A loop that is
    neither running nor closed, with pending tasks, is one of those: `run_until_complete` lets the cancelled
    tasks unwind (their `finally` blocks run) before the loop is closed and its resources freed."""
    abandoned: dict[asyncio.AbstractEventLoop, list[asyncio.Task]] = {}
    # every task of every loop, where all_tasks() reads them (a WeakSet named so up to Python 3.11, then
    # split into scheduled and eager tasks)
    every = getattr(asyncio.tasks, "_all_tasks", None) or getattr(asyncio.tasks, "_scheduled_tasks", ())
    for task in list(every):
        loop = task.get_loop()
        if not task.done() and not loop.is_running() and not loop.is_closed():
            abandoned.setdefault(loop, []).append(task)
    cancelled = 0
    for loop, tasks in abandoned.items():
        for task in tasks:
            task.cancel()
        cancelled += len(tasks)
        try:
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()
        except RuntimeError as exc:  # started by another thread meanwhile: then it is not abandoned
            logging.getLogger("peer").debug("left an event loop alone: %s", exc)
    return cancelled


def release_freed_memory() -> None:
    """Give the heap that a released stage freed back to the OS (glibc keeps freed arenas otherwise, so a peer
    that moved between stages would keep the peak of every stage it served). A no-op off glibc."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class StopSignals:
    """A peer's SIGINT/SIGTERM handler. The first: set `stopping` (leave in order) and arm the hard-exit timer
    (exit within `hard_exit_after` s whatever hangs). A second SIGINT or a third signal of any kind: exit now.
    Signals within half a second of the first are echoes of a group signal through a child and do not count."""

    def __init__(self, stopping: asyncio.Event, label: Callable[[], str], hard_exit_after: float):
        self.stopping, self.label, self.hard_exit_after = stopping, label, hard_exit_after
        self.received: list[float] = []  # monotonic times of the signals that counted

    def handle(self, sig: int) -> None:
        now, name = time.monotonic(), signal.Signals(sig).name
        if not self.stopping.is_set():
            self.received = [now]
            message = "%s %s: leaving the stage (checkpoint, then exit); Ctrl-C again to exit at once"
            logging.getLogger("peer").info(message, self.label(), name)
            self.stopping.set()
            after = self.hard_exit_after
            arm_hard_exit(after, f"{self.label()} still not stopped {after:.0f}s after the signal: exiting now")
            return
        if now - self.received[0] <= 0.5:
            return  # an echo: children forked with our handlers share our signal wake-up pipe
        self.received.append(now)
        if sig == signal.SIGINT or len(self.received) >= 3:
            logging.getLogger("peer").warning("%s %s again: exiting now, without leaving in order", self.label(), name)
            exit_now(130)
