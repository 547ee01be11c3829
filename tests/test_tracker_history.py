"""The tracker's history belongs to one run: runs sharing a history file (or its default folder) stay apart,
a restart of the same run resumes its own counters, chart and remembered peers, and a file from before
run ids is migrated, not crashed on (tracker/history.py, tracker/cli.py). Real SQLite, the real app."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest
from builders import stage_record
from fastapi.testclient import TestClient

from swarm.manifest import Manifest, save_manifest
from swarm.presets import preset
from swarm.records import PeerEntry
from tracker.app import create_app
from tracker.cli import build_parser, default_history_path, main
from tracker.history import LEGACY_RUN, SCHEMA_VERSION, History, HistoryError
from tracker.service import SwarmMonitor

RUN_A = preset("tiny", stages=3)
RUN_B = preset("tiny", stages=2)  # another manifest, so another run id
COUNTERS = ("tokens_trained", "bytes_sent", "dense_equivalent_bytes")
ADDR_A = "/ip4/10.0.0.1/tcp/4000/p2p/12D3KooWrunA"
FAR = 4e9  # records that do not expire during a test
# the tables as trackers wrote them before rows carried a run id (schema version 0)
LEGACY_SCHEMA = (
    "CREATE TABLE samples (id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL, loss REAL, "
    "capacity REAL NOT NULL, tokens INTEGER NOT NULL, peers INTEGER NOT NULL, bytes_sent INTEGER NOT NULL)",
    "CREATE INDEX samples_time ON samples(time)",
    "CREATE TABLE dht_peers (maddr TEXT PRIMARY KEY, last_seen REAL NOT NULL)",
    "CREATE TABLE run_totals (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
    "CREATE TABLE peer_counters (peer TEXT NOT NULL, name TEXT NOT NULL, value INTEGER NOT NULL, "
    "seen REAL NOT NULL, PRIMARY KEY (peer, name))",
)


def training(manifest: Manifest, tokens: int) -> dict[int, list[PeerEntry]]:
    """One online peer per stage; the driver claims `tokens` and a loss, every peer a dialable address."""
    return {
        i: [
            PeerEntry(
                stage_record(
                    i,
                    f"s{i}",
                    manifest,
                    tokens=tokens,
                    bytes_out=7 * tokens,
                    loss=3.0 if i == 0 else None,
                    addrs=[f"{ADDR_A}{i}"],
                ),
                FAR,
                f"{manifest.run_id}/{i}".encode(),
            )
        ]
        for i in range(manifest.num_stages)
    }


@contextlib.contextmanager
def tracker(
    manifest: Manifest, db: Path, stages: Mapping[int, Sequence[PeerEntry]]
) -> Iterator[tuple[TestClient, SwarmMonitor]]:
    """The tracker's app and monitor on `db`, as `protocol-tracker` builds them, minus the DHT; closed after."""
    history = History(db, manifest.run_id)
    monitor = SwarmMonitor(manifest, history, lambda: stages, bootstrap=lambda: [])
    try:
        with TestClient(create_app(monitor)) as client:
            yield client, monitor
    finally:
        history.close()


def counters(body: Mapping) -> dict[str, int]:
    return {name: body["totals"][name] for name in COUNTERS}


def test_a_new_run_on_the_same_history_file_starts_from_zero_and_a_restart_resumes(tmp_path):
    db = tmp_path / "history.sqlite"
    with tracker(RUN_A, db, training(RUN_A, 4096)) as (client, monitor):
        monitor.poll_once()
        monitor.poll_once()
        run_a = client.get("/api/v1/swarm").json()
        remembered_a = monitor.history.remembered_peers()
    assert run_a["totals"]["tokens_trained"] == 4096 and len(run_a["history"]) == 2
    assert sorted(remembered_a) == [f"{ADDR_A}{i}" for i in range(3)]

    with tracker(RUN_B, db, {}) as (client, monitor):
        fresh = client.get("/api/v1/swarm").json()  # before its first poll: what the file holds for run B
        assert counters(fresh) == dict.fromkeys(COUNTERS, 0) and fresh["history"] == []
        assert monitor.history.remembered_peers() == []  # run A's peers are no bootstrap for run B
        monitor.poll_once()
        polled = client.get("/api/v1/swarm").json()
    assert counters(polled) == dict.fromkeys(COUNTERS, 0)
    assert [(row["tokens"], row["loss"]) for row in polled["history"]] == [(0, None)]  # its own chart only

    with tracker(RUN_A, db, training(RUN_A, 4096)) as (client, monitor):  # run A restarted: all of its own back
        resumed = client.get("/api/v1/swarm").json()
        assert counters(resumed) == counters(run_a)
        assert [row["time"] for row in resumed["history"]] == [row["time"] for row in run_a["history"]]
        assert sorted(monitor.history.remembered_peers()) == sorted(remembered_a)
        monitor.poll_once()  # the same counters again: credited once, not twice
        again = client.get("/api/v1/swarm").json()
    assert counters(again) == counters(run_a) and len(again["history"]) == 3


def test_runs_writing_one_file_side_by_side_each_read_their_whole_chart(tmp_path):
    """Two trackers on one file at once: each run's samples are numbered on their own, so capping and
    downsampling see one run's rows, evenly spaced from its first to its newest."""
    a, b = History(tmp_path / "h.sqlite", RUN_A.run_id, max_rows=50), History(tmp_path / "h.sqlite", RUN_B.run_id)
    for i in range(200):
        for history, tokens in ((a, i), (b, 1000 + i)):
            history.add(dict(time=1000.0 + i, loss=3.0, capacity=1.0, tokens=tokens, peers=1, bytes_sent=0))
    assert b.count() == 200 and a.count() < 200  # a's cap drops a's oldest rows, none of b's
    rows = b.read(10)
    assert len(rows) == 10 and rows[0]["tokens"] < 1000 + 20 and rows[-1]["tokens"] == 1199
    kept = [row["tokens"] for row in a.read(500)]
    assert kept == list(range(200 - len(kept), 200))
    assert a.other_runs() == 1 and b.other_runs() == 1
    a.close()
    b.close()


def test_a_history_file_from_before_run_ids_is_migrated_and_kept_apart(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("tracker"), "propagate", True)  # `main` turns it off, caplog needs it
    db = tmp_path / "old.sqlite"
    with contextlib.closing(sqlite3.connect(db)) as old, old:
        for statement in LEGACY_SCHEMA:
            old.execute(statement)
        old.execute("INSERT INTO samples (time, loss, capacity, tokens, peers, bytes_sent) VALUES (1, 3, 1, 500, 2, 9)")
        old.execute("INSERT INTO run_totals VALUES ('tokens_trained', 500)")
        old.execute("INSERT INTO peer_counters VALUES ('key', 'tokens_trained', 500, 1)")
        old.execute("INSERT INTO dht_peers VALUES (?, 1)", (ADDR_A,))
    with caplog.at_level(logging.WARNING, logger="tracker"):
        history = History(db, RUN_B.run_id)
    assert "from before run ids" in caplog.text and RUN_B.run_id in caplog.text
    assert history.count() == 0 and history.load_counters() == ({}, {}, {}) and history.remembered_peers() == []
    assert history.other_runs() == 1
    history.close()
    legacy = History(db, LEGACY_RUN)  # nothing was thrown away, only set apart
    assert legacy.count() == 1 and legacy.read(5)[0]["tokens"] == 500
    assert legacy.load_counters() == ({"tokens_trained": 500}, {"key": {"tokens_trained": 500}}, {"key": 1.0})
    assert legacy.remembered_peers() == [ADDR_A]
    legacy.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tracker"):
        History(db, RUN_B.run_id).close()  # migrated once
    assert caplog.text == ""
    with contextlib.closing(sqlite3.connect(db)) as check:
        assert check.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_an_unusable_history_file_is_a_clear_refusal(tmp_path, capsys):
    newer = tmp_path / "newer.sqlite"
    with contextlib.closing(sqlite3.connect(newer)) as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(HistoryError, match="newer protocol-tracker"):
        History(newer, RUN_A.run_id)
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"not a database" * 100)
    save_manifest(RUN_A, tmp_path / "m.json")
    assert main(["--manifest", str(tmp_path / "m.json"), "--port", "0", "--db", str(garbage)]) == 2
    err = capsys.readouterr().err
    assert f"protocol-tracker: error: cannot use {garbage} as the tracker's history" in err
    assert "Traceback" not in err


def test_a_monitor_refuses_another_runs_history(tmp_path):
    history = History(tmp_path / "h.sqlite", RUN_B.run_id)
    with pytest.raises(ValueError, match=f"history of run {RUN_B.run_id} given to the tracker of run"):
        SwarmMonitor(RUN_A, history, dict, bootstrap=list)
    history.close()


def test_the_default_history_is_per_user_and_per_run(tmp_path, monkeypatch):
    assert default_history_path("tiny-0123456789ab", {"XDG_DATA_HOME": str(tmp_path)}) == (
        tmp_path / "protocol-swarm" / "tracker-tiny-0123456789ab.sqlite"
    )
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_history_path("a/b c-0123456789ab", {}) == (
        tmp_path / "home" / ".local" / "share" / "protocol-swarm" / "tracker-a_b_c-0123456789ab.sqlite"
    )
    assert default_history_path("r-0123456789ab", {"XDG_DATA_HOME": "relative"}).is_relative_to(tmp_path / "home")
    assert build_parser().parse_args(["--manifest", "m.json"]).db is None  # resolved once the run id is known
    shown = " ".join(build_parser().format_help().split())
    assert "$XDG_DATA_HOME/protocol-swarm/tracker-<run_id>.sqlite" in shown and "keyed by run id" in shown


def test_the_tracker_opens_its_default_history_and_says_the_old_one_is_no_longer_read(
    tmp_path, monkeypatch, caplog, capsys
):
    """Without --db the tracker opens the per-user file of its run (here unusable, so it stops before its DHT
    starts) and says that the old default in the current folder, which names no run, is not read."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    save_manifest(RUN_A, tmp_path / "m.json")
    (tmp_path / "tracker-history.sqlite").write_bytes(b"")
    default = default_history_path(RUN_A.run_id)
    default.parent.mkdir(parents=True)
    default.write_bytes(b"not a database" * 100)
    logger = logging.getLogger("tracker")
    logger.addHandler(caplog.handler)  # `main` stops the logger's records from reaching caplog's root handler
    try:
        assert main(["--manifest", "m.json", "--port", "0"]) == 2
    finally:
        logger.removeHandler(caplog.handler)
    assert f"cannot use {default} as the tracker's history" in capsys.readouterr().err
    assert "tracker-history.sqlite in this folder is the history's old default and is no longer read" in caplog.text
