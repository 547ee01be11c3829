"""Loss and throughput history in SQLite, so the charts survive a tracker restart.

One row per poll. The table is capped (oldest rows go first) and reads are downsampled in
SQL, so neither the file nor a response grows with the run's age. The same file remembers
the DHT addresses peers published, so a restarted tracker can rejoin the swarm by itself
(otherwise its fresh DHT node knows nobody, and nobody knows to tell it anything), and keeps the
run's monotonic counters with the last value credited to each peer (`tracker.counters`), so the
run's count survives a restart without counting any peer twice.
"""

from __future__ import annotations

import math
import sqlite3
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DEFAULT_MAX_ROWS = 200_000  # ~23 days at one poll every 10 s (`POLL_INTERVAL`)
MAX_REMEMBERED_PEERS = 256
RATE_WINDOW = 30.0  # seconds; three peer announce periods (ANNOUNCE_INTERVAL, 10 s)
_COLUMNS = ("time", "loss", "capacity", "tokens", "peers", "bytes_sent")


class History:
    """A thread-safe store; the poller writes, request handlers read."""

    def __init__(self, path: str | Path, max_rows: int = DEFAULT_MAX_ROWS) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self.max_rows = max_rows
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False)
        with self._lock, self._db:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # WAL stays consistent; a crash loses at most a poll
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS samples (id INTEGER PRIMARY KEY AUTOINCREMENT, "
                "time REAL NOT NULL, "
                "loss REAL, capacity REAL NOT NULL, tokens INTEGER NOT NULL, peers INTEGER NOT NULL, "
                "bytes_sent INTEGER NOT NULL)"
            )
            self._db.execute("CREATE INDEX IF NOT EXISTS samples_time ON samples(time)")
            self._db.execute("CREATE TABLE IF NOT EXISTS dht_peers (maddr TEXT PRIMARY KEY, last_seen REAL NOT NULL)")
            self._db.execute("CREATE TABLE IF NOT EXISTS run_totals (name TEXT PRIMARY KEY, value INTEGER NOT NULL)")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS peer_counters (peer TEXT NOT NULL, name TEXT NOT NULL, "
                "value INTEGER NOT NULL, seen REAL NOT NULL, PRIMARY KEY (peer, name))"
            )
        self._inserts = 0

    def add(self, sample: Mapping[str, Any]) -> None:
        with self._lock, self._db:
            self._db.execute(
                f"INSERT INTO samples ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})",
                [sample[c] for c in _COLUMNS],
            )
            self._inserts += 1
            if self._inserts % 100 == 1:
                self._db.execute("DELETE FROM samples WHERE id <= (SELECT MAX(id) FROM samples) - ?", (self.max_rows,))

    def count(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM samples").fetchone()[0]

    def read(self, points: int, since: float = 0.0) -> list[dict[str, Any]]:
        """At most `points` evenly spaced samples from `since` on, always ending with the newest."""
        if points <= 0:
            return []
        with self._lock:
            last, count = self._db.execute("SELECT MAX(id), COUNT(*) FROM samples WHERE time >= ?", (since,)).fetchone()
            if not count:
                return []
            step = max(1, math.ceil(count / points))
            rows = self._db.execute(
                f"SELECT {', '.join(_COLUMNS)} FROM samples WHERE time >= ? AND ((? - id) % ? = 0) "
                "ORDER BY id DESC LIMIT ?",
                (since, last, step, points),
            ).fetchall()
        return with_rates([dict(zip(_COLUMNS, row, strict=True)) for row in reversed(rows)])

    def remember_peers(self, maddrs: list[str], now: float) -> None:
        """Keep the most recently seen peer multiaddrs (bounded) for rejoining after a restart."""
        with self._lock, self._db:
            self._db.executemany(
                "INSERT INTO dht_peers (maddr, last_seen) VALUES (?, ?) "
                "ON CONFLICT(maddr) DO UPDATE SET last_seen = excluded.last_seen",
                [(m, now) for m in maddrs],
            )
            self._db.execute(
                "DELETE FROM dht_peers WHERE maddr NOT IN "
                "(SELECT maddr FROM dht_peers ORDER BY last_seen DESC LIMIT ?)",
                (MAX_REMEMBERED_PEERS,),
            )

    def remembered_peers(self, limit: int = 16) -> list[str]:
        with self._lock:
            rows = self._db.execute("SELECT maddr FROM dht_peers ORDER BY last_seen DESC LIMIT ?", (limit,))
            return [row[0] for row in rows.fetchall()]

    def load_counters(self) -> tuple[dict[str, int], dict[str, dict[str, int]], dict[str, float]]:
        """The run's totals, the last counters credited to each peer key, and when each key was last seen."""
        with self._lock:
            totals = dict(self._db.execute("SELECT name, value FROM run_totals").fetchall())
            rows = self._db.execute("SELECT peer, name, value, seen FROM peer_counters").fetchall()
        last: dict[str, dict[str, int]] = {}
        seen: dict[str, float] = {}
        for peer, name, value, when in rows:
            last.setdefault(peer, {})[name] = value
            seen[peer] = max(seen.get(peer, 0.0), when)
        return totals, last, seen

    def save_counters(
        self, totals: Mapping[str, int], peers: Mapping[str, Mapping[str, int]], now: float, dropped: list[str]
    ) -> None:
        """Store the run's totals and the counters just credited to `peers` (seen at `now`), in one
        transaction so totals and per-peer values never disagree after a crash; forget `dropped` keys."""
        with self._lock, self._db:
            self._db.executemany(
                "INSERT INTO run_totals (name, value) VALUES (?, ?) "
                "ON CONFLICT(name) DO UPDATE SET value = excluded.value",
                list(totals.items()),
            )
            self._db.executemany(
                "INSERT INTO peer_counters (peer, name, value, seen) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(peer, name) DO UPDATE SET value = excluded.value, seen = excluded.seen",
                [(peer, name, value, now) for peer, values in peers.items() for name, value in values.items()],
            )
            self._db.executemany("DELETE FROM peer_counters WHERE peer = ?", [(peer,) for peer in dropped])

    def close(self) -> None:
        with self._lock:
            self._db.close()


def with_rates(samples: list[dict[str, Any]], window: float = RATE_WINDOW) -> list[dict[str, Any]]:
    """Add `rate` (tokens/s trained), measured over about `window` seconds.

    Peers refresh their counters only every ~10 s while the tracker polls more often, so a
    rate between consecutive polls would alternate between zero and a spike. Each rate is
    taken from the oldest sample inside the window (or the previous one when samples are
    sparser); a drop of the counter (a driver left) gives no rate rather than a negative one.
    """
    start = 0
    for i, sample in enumerate(samples):
        while start < i - 1 and sample["time"] - samples[start]["time"] > window:
            start += 1
        rate = None
        if i > 0:
            first = samples[min(start, i - 1)]
            dt, dtokens = sample["time"] - first["time"], sample["tokens"] - first["tokens"]
            if dt > 0 and dtokens >= 0:
                rate = dtokens / dt
        sample["rate"] = rate
    return samples
