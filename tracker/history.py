"""Loss and throughput history in SQLite, so the charts survive a tracker restart.

One row per poll. The table is capped (oldest rows go first) and reads are downsampled in
SQL, so neither the file nor a response grows with the run's age. The same file remembers
the DHT addresses peers published, so a restarted tracker can rejoin the swarm by itself
(otherwise its fresh DHT node knows nobody, and nobody knows to tell it anything).
"""

from __future__ import annotations

import math
import sqlite3
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DEFAULT_MAX_ROWS = 200_000  # ~11 days at one poll every 5 s
MAX_REMEMBERED_PEERS = 256
RATE_WINDOW = 30.0  # seconds; six peer announce periods (ANNOUNCE_INTERVAL, 5 s)
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
