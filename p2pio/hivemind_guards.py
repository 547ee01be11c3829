"""Guards on hivemind's own protobuf stream handlers (the averager's, the DHT's), installed once per process.

A peer's trip and K/V streams are read by `peer/transport.py` within its bounds; hivemind's handlers in the same
process keep hivemind's reader, which reads a frame's whole declared length before looking at it and logs every
garbage stream with a traceback. These replace that reader's frame read on the `P2P` class of this process
(hivemind's files are not touched) and filter its logger: a process-wide side effect, so it lives here, named, and
`TripServicer.add_p2p_handlers` installs it (idempotent).
"""

from __future__ import annotations

import asyncio
import logging
import time

from hivemind.p2p import P2P


class _QuietStreamErrors(logging.Filter):
    """hivemind's protobuf stream handlers (the averager's, the DHT's) log every garbage stream as a
    WARNING with a traceback ("Exception while receiving requests:", "Handler failed with the
    exception:" in hivemind/p2p/p2p_daemon.py). Keep one line per `interval` per message, with the
    exception's one-line summary and how many were dropped, and no traceback."""

    MESSAGES = ("Exception while receiving requests:", "Handler failed with the exception:")

    def __init__(self, interval: float = 60.0):
        super().__init__()
        self.interval, self.last, self.dropped = interval, {}, {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg not in self.MESSAGES:
            return True
        now = time.monotonic()
        if now - self.last.get(record.msg, -self.interval) < self.interval:
            self.dropped[record.msg] = self.dropped.get(record.msg, 0) + 1
            return False
        self.last[record.msg] = now
        exc = record.exc_info[1] if record.exc_info else None
        dropped = self.dropped.pop(record.msg, 0)
        record.msg = f"{record.msg} {type(exc).__name__ if exc else ''}: {str(exc)[:200]}" + (
            f" (and {dropped} more in {self.interval:.0f}s)" if dropped else ""
        )
        record.args, record.exc_info, record.exc_text, record.stack_info = None, None, None, None
        return True


def quiet_hivemind_stream_errors(interval: float = 60.0) -> None:
    """Install `_QuietStreamErrors` on hivemind's P2P logger (idempotent)."""
    target = logging.getLogger("hivemind.p2p.p2p_daemon")
    if not any(isinstance(f, _QuietStreamErrors) for f in target.filters):
        target.addFilter(_QuietStreamErrors(interval))


HIVEMIND_MAX_FRAME = 16 << 20


def limit_hivemind_frames(max_frame: int = HIVEMIND_MAX_FRAME) -> None:
    """Bound the frames hivemind's own protobuf streams read (the averager's, in both directions).

    hivemind reads a frame's declared length whole before parsing it (`P2P.receive_raw_data`,
    hivemind/p2p/p2p_daemon.py: `data = await reader.readexactly(content_length)`, then
    `protobuf.ParseFromString(...)` in `receive_protobuf`): one 256 MB frame to the averager's
    handler cost +768 MB peak RSS. This replaces that staticmethod on the `P2P` class of this
    process (hivemind's files are not touched) with one that refuses a frame over `max_frame`
    before reading its body; hivemind's handler then logs one line (see `quiet_hivemind_stream_errors`)
    and closes the stream. hivemind's largest frames here are the averager's 512 KiB tensor parts and
    64 KiB state chunks, so 16 MiB leaves a wide margin; a frame at the limit costs < 64 MB.
    Installed once per process (idempotent)."""
    if getattr(P2P.__dict__["receive_raw_data"].__func__, "frame_limit", None) is not None:
        return

    async def receive_raw_data(reader: asyncio.StreamReader) -> bytes:
        header = await reader.readexactly(P2P.HEADER_LEN)
        length = int.from_bytes(header, P2P.BYTEORDER)
        if length > max_frame:
            raise ValueError(f"a frame of {length} bytes (limit {max_frame})")
        return await reader.readexactly(length)

    receive_raw_data.frame_limit = max_frame
    P2P.receive_raw_data = staticmethod(receive_raw_data)
