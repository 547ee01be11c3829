"""The unix sockets of hivemind's libp2p daemons, in a directory of this process's own, removed when it ends.

hivemind 1.1.12's `P2P` names its unix sockets after `P2P._UNIX_SOCKET_PREFIX`, `/tmp/hivemind-`: two for every
daemon it starts (`P2P.create`: p2pd's control socket `hivemind-p2pd-<id>.sock` and the client's callback socket
`hivemind-p2pclient-<id>.sock`) and one for every replica (`P2P.replicate`: `DHT.replicate_p2p`, and each of
hivemind's averager processes). It deletes them only in `P2P._terminate`, p2pd's own socket only while p2pd
still runs, so a process that exits by `os._exit` (a peer always does), a DHT process terminated after its
grace, an averager killed at exit, or a daemon that died of a group signal first leaves them in /tmp: a machine
that restarted its peer a few dozen times held 169.

Here the prefix points into a fresh directory made for this process. hivemind forks its DHT and averager
processes, so they inherit the prefix and their sockets land there too, and p2pd is told the path on its command
line. Removing that directory removes exactly what this process and its children created, never another
process's sockets, whatever path each exit took; a SIGKILL leaves the directory behind (in $TMPDIR, which
`launcher/supervisor.py` points at a directory of the swarm's own, removed when it stops).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from hivemind.p2p import P2P

HIVEMIND_PREFIX = P2P._UNIX_SOCKET_PREFIX  # "/unix/tmp/hivemind-": where hivemind puts them by default
# the longest socket name hivemind makes, "hivemind-p2pclient-" + secrets.token_urlsafe(8) (11 chars) + ".sock",
# must fit in a unix socket path: 108 bytes with the terminating NUL
LONGEST_NAME = len("hivemind-p2pclient-") + 11 + len(".sock")
MAX_SOCKET_PATH = 107
DIR_NAME = len("/protocol-p2p-") + 8  # what each directory `make_socket_dir` makes adds to the path (mkdtemp: 8)

_own: tuple[int, Path] | None = None  # (pid, directory) once `use_own_socket_dir` made one in this process


def make_socket_dir(nested: int = 0) -> Path:
    """A new private directory (mode 0700) in $TMPDIR, or in /tmp when socket paths under $TMPDIR would be
    longer than a unix socket path may be; with room for `nested` more such directories inside it (a child
    process given it as $TMPDIR makes its own)."""
    base = tempfile.gettempdir()
    if len(os.path.abspath(base)) + (1 + nested) * DIR_NAME + 1 + LONGEST_NAME > MAX_SOCKET_PATH:
        base = "/tmp"
    return Path(tempfile.mkdtemp(prefix="protocol-p2p-", dir=base))


def _prefix(directory: Path) -> str:
    return f"/unix{directory}/hivemind-"


@contextlib.contextmanager
def sockets_in(directory: Path) -> Iterator[None]:
    """hivemind daemons and replicas created, or forked, inside the block put their sockets in `directory`; the
    prefix is put back after it. For a process that must not move the sockets of anything else it runs (the
    launcher's bootstrap DHT, started inside a test process): the DHT process forked in the block keeps it."""
    previous = P2P._UNIX_SOCKET_PREFIX
    P2P._UNIX_SOCKET_PREFIX = _prefix(directory)
    try:
        yield
    finally:
        P2P._UNIX_SOCKET_PREFIX = previous


def use_own_socket_dir() -> Path:
    """Point this process's hivemind sockets, and those of the processes it forks from now on, at a private
    directory (made on the first call; later calls return it). `remove_own_socket_dir` deletes it."""
    global _own
    if _own is None or _own[0] != os.getpid():  # a forked child never takes over its parent's directory
        _own = (os.getpid(), make_socket_dir())
        P2P._UNIX_SOCKET_PREFIX = _prefix(_own[1])
    return _own[1]


def remove_own_socket_dir() -> None:
    """Delete the directory `use_own_socket_dir` made, with every socket in it, and put hivemind's prefix back.
    Call it on every exit path, after the daemons stopped (or were killed); a no-op in a process that made none,
    including the children forked from the one that did, so a child's exit cannot pull its parent's sockets."""
    global _own
    if _own is None or _own[0] != os.getpid():
        return
    shutil.rmtree(_own[1], ignore_errors=True)
    P2P._UNIX_SOCKET_PREFIX = HIVEMIND_PREFIX
    _own = None
