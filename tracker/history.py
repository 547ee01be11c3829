"""Loss and throughput history in SQLite, so the charts survive a tracker restart.

One row per poll. The table is capped (oldest rows go first) and reads are downsampled in
SQL, so neither the file nor a response grows with the run's age. The same file remembers
the DHT addresses peers published, so a restarted tracker can rejoin the swarm by itself
(otherwise its fresh DHT node knows nobody, and nobody knows to tell it anything), and keeps the
run's monotonic counters with the last value credited to each peer (`tracker.counters`), so the
run's count survives a restart without counting any peer twice.

Every row is keyed by the run id, and a `History` reads and writes its own run's rows only. A
file once held no run id, so a tracker started for a new run from the same folder reported the
earlier runs' tokens at its first poll, began its loss chart with their losses and dialled their
dead peers to rejoin the swarm. Keyed rows keep runs apart however the file is shared (a
`--db` pinned in a container volume while the manifest changes, a folder reused for several runs),
and a restart of the same run reads back exactly what it wrote. A file from before the key (schema
version 0) is migrated in place: its rows cannot be attributed to any run, so they are kept under
`LEGACY_RUN`, which no manifest's run id equals, and no run reads them.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger("tracker")

DEFAULT_MAX_ROWS = 200_000  # per run; ~23 days at one poll every 10 s (`POLL_INTERVAL`)
MAX_REMEMBERED_PEERS = 256  # per run
RATE_WINDOW = 30.0  # seconds; three peer announce periods (ANNOUNCE_INTERVAL, 10 s)
SCHEMA_VERSION = 1  # SQLite's user_version: 0 = rows without a run id (before it), 1 = rows keyed by run id
LEGACY_RUN = "(before run ids)"  # the key of migrated rows; a run id is `<name>-<12 hex digits>`, never this
_COLUMNS = ("time", "loss", "capacity", "tokens", "peers", "bytes_sent")
_TABLES = {  # `seq` numbers a run's samples 1, 2, 3...: capping and downsampling count a run's rows only
    "samples": "run_id TEXT NOT NULL, seq INTEGER NOT NULL, time REAL NOT NULL, loss REAL, "
    "capacity REAL NOT NULL, tokens INTEGER NOT NULL, peers INTEGER NOT NULL, bytes_sent INTEGER NOT NULL, "
    "PRIMARY KEY (run_id, seq)",
    "dht_peers": "run_id TEXT NOT NULL, maddr TEXT NOT NULL, last_seen REAL NOT NULL, PRIMARY KEY (run_id, maddr)",
    "run_totals": "run_id TEXT NOT NULL, name TEXT NOT NULL, value INTEGER NOT NULL, PRIMARY KEY (run_id, name)",
    "peer_counters": "run_id TEXT NOT NULL, peer TEXT NOT NULL, name TEXT NOT NULL, value INTEGER NOT NULL, "
    "seen REAL NOT NULL, PRIMARY KEY (run_id, peer, name)",
}
_LEGACY_COPY = {  # version 0's columns into version 1's; the old autoincrement id keeps the samples' order
    "samples": (
        "seq, time, loss, capacity, tokens, peers, bytes_sent",
        "id, time, loss, capacity, tokens, peers, bytes_sent",
    ),
    "dht_peers": ("maddr, last_seen", "maddr, last_seen"),
    "run_totals": ("name, value", "name, value"),
    "peer_counters": ("peer, name, value, seen", "peer, name, value, seen"),
}


class HistoryError(Exception):
    """The history file cannot be used (not SQLite, or written by a newer tracker); the message says which."""


class History:
    """A thread-safe store of one run's rows (`run_id`); the poller writes, request handlers read."""

    def __init__(self, path: str | Path, run_id: str, max_rows: int = DEFAULT_MAX_ROWS) -> None:
        self.path = str(path)
        self.run_id = run_id
        self.max_rows = max_rows
        self._lock = threading.Lock()
        self._inserts = 0
        try:
            if self.path != ":memory:":
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, check_same_thread=False)
        except (OSError, sqlite3.DatabaseError) as exc:  # an unwritable folder: a reason not to start, not a crash
            raise HistoryError(f"cannot open {self.path} for the tracker's history: {exc}") from exc
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # WAL stays consistent; a crash loses at most a poll
            self._prepare()
        except HistoryError:
            self._db.close()
            raise
        except sqlite3.DatabaseError as exc:  # not SQLite, or tables no version of the tracker wrote
            self._db.close()
            raise HistoryError(f"cannot use {self.path} as the tracker's history: {exc}") from exc

    def _prepare(self) -> None:
        """Create the tables, or migrate a file from before run ids, in one transaction: a second tracker
        opening the same file waits for it (BEGIN IMMEDIATE) and then finds the current schema."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise HistoryError(
                    f"{self.path} was written by a newer protocol-tracker (history schema {version}, this one "
                    f"reads {SCHEMA_VERSION}); upgrade, or give --db another file"
                )
            existing = {row[0] for row in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            legacy = sorted(existing & _TABLES.keys()) if version == 0 else []
            for table in legacy:
                self._db.execute(f"ALTER TABLE {table} RENAME TO legacy_{table}")
            for table, columns in _TABLES.items():
                self._db.execute(f"CREATE TABLE IF NOT EXISTS {table} ({columns})")
            self._db.execute("CREATE INDEX IF NOT EXISTS samples_run_time ON samples(run_id, time)")
            for table in legacy:
                into, taken = _LEGACY_COPY[table]
                self._db.execute(
                    f"INSERT INTO {table} (run_id, {into}) SELECT ?, {taken} FROM legacy_{table}", (LEGACY_RUN,)
                )
                self._db.execute(f"DROP TABLE legacy_{table}")
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        if legacy:
            logger.warning(
                "%s held history from before run ids; it cannot tell which run it belongs to, so it is kept "
                "apart (as run %r) and run %s starts its own",
                self.path,
                LEGACY_RUN,
                self.run_id,
            )

    def add(self, sample: Mapping[str, Any]) -> None:
        with self._lock, self._db:
            self._db.execute(
                f"INSERT INTO samples (run_id, seq, {', '.join(_COLUMNS)}) "
                f"SELECT ?, COALESCE(MAX(seq), 0) + 1, {', '.join('?' * len(_COLUMNS))} FROM samples WHERE run_id = ?",
                [self.run_id, *(sample[c] for c in _COLUMNS), self.run_id],
            )
            self._inserts += 1
            if self._inserts % 100 == 1:
                self._db.execute(
                    "DELETE FROM samples WHERE run_id = ? AND seq <= "
                    "(SELECT MAX(seq) FROM samples WHERE run_id = ?) - ?",
                    (self.run_id, self.run_id, self.max_rows),
                )

    def count(self) -> int:
        """This run's samples."""
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM samples WHERE run_id = ?", (self.run_id,)).fetchone()[0]

    def other_runs(self) -> int:
        """How many other runs (the legacy rows included) keep samples in this file, for the start's log line."""
        with self._lock:
            query = "SELECT COUNT(DISTINCT run_id) FROM samples WHERE run_id != ?"
            return self._db.execute(query, (self.run_id,)).fetchone()[0]

    def read(self, points: int, since: float = 0.0) -> list[dict[str, Any]]:
        """At most `points` evenly spaced samples from `since` on, always ending with the newest."""
        if points <= 0:
            return []
        with self._lock:
            last, count = self._db.execute(
                "SELECT MAX(seq), COUNT(*) FROM samples WHERE run_id = ? AND time >= ?", (self.run_id, since)
            ).fetchone()
            if not count:
                return []
            step = max(1, math.ceil(count / points))
            rows = self._db.execute(
                f"SELECT {', '.join(_COLUMNS)} FROM samples WHERE run_id = ? AND time >= ? AND ((? - seq) % ? = 0) "
                "ORDER BY seq DESC LIMIT ?",
                (self.run_id, since, last, step, points),
            ).fetchall()
        return with_rates([dict(zip(_COLUMNS, row, strict=True)) for row in reversed(rows)])

    def remember_peers(self, maddrs: list[str], now: float) -> None:
        """Keep the most recently seen peer multiaddrs (bounded) for rejoining after a restart."""
        with self._lock, self._db:
            self._db.executemany(
                "INSERT INTO dht_peers (run_id, maddr, last_seen) VALUES (?, ?, ?) "
                "ON CONFLICT(run_id, maddr) DO UPDATE SET last_seen = excluded.last_seen",
                [(self.run_id, m, now) for m in maddrs],
            )
            self._db.execute(
                "DELETE FROM dht_peers WHERE run_id = ? AND maddr NOT IN "
                "(SELECT maddr FROM dht_peers WHERE run_id = ? ORDER BY last_seen DESC LIMIT ?)",
                (self.run_id, self.run_id, MAX_REMEMBERED_PEERS),
            )

    def remembered_peers(self, limit: int = 16) -> list[str]:
        with self._lock:
            rows = self._db.execute(
                "SELECT maddr FROM dht_peers WHERE run_id = ? ORDER BY last_seen DESC LIMIT ?", (self.run_id, limit)
            )
            return [row[0] for row in rows.fetchall()]

    def load_counters(self) -> tuple[dict[str, int], dict[str, dict[str, int]], dict[str, float]]:
        """The run's totals, the last counters credited to each peer key, and when each key was last seen."""
        with self._lock:
            totals = dict(
                self._db.execute("SELECT name, value FROM run_totals WHERE run_id = ?", (self.run_id,)).fetchall()
            )
            rows = self._db.execute(
                "SELECT peer, name, value, seen FROM peer_counters WHERE run_id = ?", (self.run_id,)
            ).fetchall()
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
                "INSERT INTO run_totals (run_id, name, value) VALUES (?, ?, ?) "
                "ON CONFLICT(run_id, name) DO UPDATE SET value = excluded.value",
                [(self.run_id, name, value) for name, value in totals.items()],
            )
            self._db.executemany(
                "INSERT INTO peer_counters (run_id, peer, name, value, seen) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT(run_id, peer, name) DO UPDATE SET value = excluded.value, seen = excluded.seen",
                [
                    (self.run_id, peer, name, value, now)
                    for peer, values in peers.items()
                    for name, value in values.items()
                ],
            )
            self._db.executemany(
                "DELETE FROM peer_counters WHERE run_id = ? AND peer = ?", [(self.run_id, peer) for peer in dropped]
            )

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
