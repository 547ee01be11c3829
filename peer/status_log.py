"""What a peer tells its operator: a progress line every few seconds, and a heartbeat file for health checks
(with context parallelism read back by `swarm.context_parallel.kv_bytes_per_token`)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from peer.refusals import RefusalLog
from peer.stats import Stats

logger = logging.getLogger("peer")


async def log_progress(
    stats: Stats, epoch: Callable[[], int], refusal_log: RefusalLog, label: Callable[[], str], interval: float
) -> None:
    """Every `interval` seconds: tokens/s since the last line, loss, wire bytes per token, counters, and the
    refusals noted since (aggregated per sender)."""
    last_tokens, last_time = stats.tokens, time.monotonic()
    while True:
        await asyncio.sleep(interval)
        now, tokens = time.monotonic(), stats.tokens
        rate = (tokens - last_tokens) / max(now - last_time, 1e-9)
        per_token = (stats.bytes_in + stats.bytes_out) / max(tokens, 1)
        loss = f"{stats.last_loss:.3f}" if stats.last_loss is not None else "-"
        logger.info(
            "%s %.0f tokens/s, loss %s, %.1f wire bytes/token, epoch %d, trips %d, in flight %d, errors %s",
            label(),
            rate,
            loss,
            per_token,
            epoch(),
            stats.trips,
            stats.load,
            dict(stats.errors) or 0,
        )
        for line in refusal_log.flush(now):
            logger.warning("%s %s", label(), line)
        last_tokens, last_time = tokens, now


async def write_heartbeats(
    path: Path, describe: Callable[[], dict], label: Callable[[], str], interval: float
) -> None:
    """Proof of life for container health checks: rewritten atomically while the event loop runs."""
    while True:
        tmp = path.with_suffix(path.suffix + ".tmp")
        try:
            tmp.write_text(json.dumps(describe()))
            os.replace(tmp, path)
        except OSError as exc:
            logger.warning("%s cannot write heartbeat %s: %s", label(), path, exc)
        await asyncio.sleep(interval)

