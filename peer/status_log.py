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
# every line a peer logs (`peer/cli.py`); benchmarks/netsim/trip_time.py reads the progress lines back
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


async def log_progress(
    stats: Stats, epoch: Callable[[], int], refusal_log: RefusalLog, label: Callable[[], str], interval: float
) -> None:
    """Every `interval` seconds: tokens/s since the last line, loss, wire bytes per token, counters, and the
    refusals noted since (aggregated per sender)."""
    last_tokens, last_time, last_times = stats.tokens, time.monotonic(), time_sums(stats)
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
        times = time_sums(stats)
        if split := time_split(last_times, times, now - last_time):
            logger.info("%s where trips' time went: %s", label(), split)
        for line in refusal_log.flush(now):
            logger.warning("%s %s", label(), line)
        last_tokens, last_time, last_times = tokens, now, times


TimeSums = dict[str, tuple[float, int]]  # (seconds, events) of each place a trip's time goes (`Stats`)


def time_sums(stats: Stats) -> TimeSums:
    return {name: (s.total, s.count) for name, s in (
        ("queued", stats.stage_queued), ("busy", stats.stage_busy), ("reply", stats.reply_wait),
        ("kv", stats.kv_wait), ("served", stats.served))}


def time_split(before: TimeSums, after: TimeSums, seconds: float) -> str:
    """One interval's split, "" if nothing ran: the share of the interval the stage thread worked, and the mean
    of each wait (per job for the thread's queue, per trip for a reply or a served trip, per layer for K/V)."""
    delta = {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in after}
    if not any(count for _, count in delta.values()):
        return ""

    def mean_ms(key: str, per: str) -> str:
        total, count = delta[key]
        return f"{1000 * total / count:.0f} ms/{per}" if count else "-"

    busy = delta["busy"][0] / max(seconds, 1e-9)
    return (f"stage thread busy {100 * busy:.0f}%, queued {mean_ms('queued', 'job')}; reply wait "
            f"{mean_ms('reply', 'trip')}; K/V wait {mean_ms('kv', 'layer')}; served {mean_ms('served', 'trip')}")


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

