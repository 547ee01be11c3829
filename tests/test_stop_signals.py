"""The peer never ignores its stop signals, and its children do not die of them (L2): real forks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from peer.processes import stop_signals_ignored_by_children


def _child_survives(sig: int) -> bool:
    """Fork; the child sends itself `sig` and reports whether it lived through it."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.kill(os.getpid(), sig)
        os.write(write, b"1")
        os._exit(0)
    os.close(write)
    data = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    return data == b"1"


def test_children_survive_stop_signals_and_a_signal_in_the_block_reaches_the_parent_after_it():
    got: list[int] = []
    before = {s: signal.signal(s, lambda sig, frame: got.append(sig)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with stop_signals_ignored_by_children():
            assert _child_survives(signal.SIGTERM) and _child_survives(signal.SIGINT)
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # what DecentralizedAverager.run_in_background does
            os.kill(os.getpid(), signal.SIGTERM)  # a group SIGTERM while the stage runtime is being built
            assert got == []
        assert got == [signal.SIGTERM]  # raised again once our handlers are back, not lost
        assert signal.getsignal(signal.SIGINT) is before[signal.SIGINT] or callable(signal.getsignal(signal.SIGINT))
        os.kill(os.getpid(), signal.SIGINT)
        assert got == [signal.SIGTERM, signal.SIGINT]  # hivemind's SIG_IGN did not stick
    finally:
        for sig, old in before.items():
            signal.signal(sig, old)


_FREE_AFTER_KILL = """
import gc
import torch
import hivemind.utils.mpfuture  # noqa: F401  (hivemind's file-backed tensor sharing: starts torch_shm_manager)
from peer.processes import descendants, kill_descendants, is_torch_shm_manager
import os
shared = torch.zeros(1000).share_memory_()
assert any(is_torch_shm_manager(pid) for pid in descendants(os.getpid()))
kill_descendants()
del shared
gc.collect()
print("freed", flush=True)
"""


def test_a_shared_tensor_freed_after_the_children_are_killed_does_not_abort_the_peer():
    """CI saw a peer abort at exit in a C++ destructor: it had killed torch's shared-memory manager with its other
    children, then freed a shared tensor, which messages the manager."""
    done = subprocess.run([sys.executable, "-c", _FREE_AFTER_KILL], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "freed", done.stderr[-2000:]
