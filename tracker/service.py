"""The tracker's moving parts: a DHT node, a poller thread, and the latest swarm snapshot.

`dht.get` blocks, so polling runs in its own thread and request handlers only ever read the
last snapshot (a dict swapped under a lock): a slow or broken DHT makes the page stale, never
slow, and never takes the HTTP side down.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hivemind.utils.timed_storage import get_dht_time

from dhtio.identity import load_or_create_rsa_key
from dhtio.records import fetch_stages
from dhtio.validators import make_validators
from swarm.manifest import Manifest
from swarm.records import PeerEntry
from tracker.counters import advance, forget_oldest
from tracker.history import History
from tracker.rejoin_addrs import dialable_addrs
from tracker.summary import (
    DEFAULT_STALE_AFTER,
    POLL_INTERVAL,
    PeerView,
    history_sample,
    owner_fingerprint,
    run_counters,
    summarize,
    track_last_seen,
)

logger = logging.getLogger("tracker")

Fetch = Callable[[], Mapping[int, Sequence[PeerEntry]]]


class SwarmMonitor:
    """Polls the run's stage records, keeps the summary, writes history, logs changes.

    `fetch` returns {stage: [PeerEntry]} (in production `fetch_stages` on the tracker's DHT);
    it is a parameter so the same monitor serves a DHT-less app in tests of the HTTP layer.
    """

    def __init__(
        self,
        manifest: Manifest,
        history: History,
        fetch: Fetch,
        *,
        bootstrap: Callable[[], list[str]] = list,
        poll_interval: float = POLL_INTERVAL,
        stale_after: float = DEFAULT_STALE_AFTER,
        own_peer_id: str = "",
    ) -> None:
        if history.run_id != manifest.run_id:  # another run's totals and chart must never be served as this one's
            raise ValueError(f"history of run {history.run_id} given to the tracker of run {manifest.run_id}")
        self.manifest = manifest
        self.history = history
        self.poll_interval = poll_interval
        self.stale_after = stale_after
        self.started_at = time.time()
        self.polls = 0
        self.poll_failures = 0
        self.last_success: float | None = None
        self._fetch = fetch
        self._bootstrap_source = bootstrap
        self._bootstrap: list[str] = []
        self._bootstrap_at = 0.0
        self._own_peer_id = own_peer_id
        self._remembered: set[str] = set()
        self._remembered_at = 0.0
        self._last_seen: dict[bytes, tuple[float, float, float]] = {}  # expiration, last seen, first seen
        self._lock = threading.Lock()
        # the run's monotonic counters (tracker.counters), resumed from the history file
        self._run_totals, self._peer_counters, self._counters_seen = history.load_counters()
        self._summary = summarize(
            manifest, {}, get_dht_time(), stale_after=stale_after, polled=False, run_totals=self._run_totals
        )
        self._error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- reading (request handlers) ---
    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return self._summary

    def bootstrap(self) -> list[str]:
        with self._lock:
            return list(self._bootstrap)

    # --- polling ---
    def poll_once(self) -> dict[str, Any]:
        """Read the DHT once, publish a new summary and add a history row; never raises."""
        now = get_dht_time()
        self.polls += 1
        try:
            if not self._bootstrap or now - self._bootstrap_at > 60:
                addrs = [str(a) for a in self._bootstrap_source()]
                with self._lock:
                    self._bootstrap, self._bootstrap_at = addrs, now
            fetched = self._fetch()
            error = None
        except Exception as exc:  # the DHT can fail in many ways; the tracker must keep serving
            fetched, error = None, f"{type(exc).__name__}: {exc}"
            self.poll_failures += 1
        if fetched is None:
            # keep showing the last known stages, but say loudly that they may be out of date
            warning = dict(
                level="error",
                code="poll_failed",
                stage=None,
                peer=None,
                message=f"reading the DHT failed: {str(error)[:200]}",
            )
            with self._lock:
                previous = self._summary
                kept = [w for w in previous["warnings"] if w["code"] not in ("poll_failed", "no_data")]
                self._summary = {**previous, "time": now, "healthy": False, "warnings": [warning, *kept]}
                summary = self._summary
            if self._error is None:
                logger.warning("DHT poll failed: %s", error)
            self._error = error
            return summary
        if self._error is not None:
            logger.info("DHT poll recovered")
        self._error = None
        entries = [e for stage in fetched.values() for e in stage]
        seen = track_last_seen(self._last_seen, entries, now)
        self._log_changes(self._last_seen, seen, entries)
        self._last_seen = seen
        views = {
            stage: [
                PeerView(e.record, e.expiration, e.owner, seen[e.owner][1], seen[e.owner][2]) for e in stage_entries
            ]
            for stage, stage_entries in fetched.items()
        }
        current = run_counters(self.manifest, views, now)
        self._run_totals, self._peer_counters = advance(self._run_totals, self._peer_counters, current)
        self._counters_seen.update(dict.fromkeys(current, now))
        dropped = forget_oldest(self._peer_counters, self._counters_seen)
        summary = summarize(self.manifest, views, now, stale_after=self.stale_after, run_totals=self._run_totals)
        with self._lock:
            previous_healthy = self._summary["healthy"] if self.last_success is not None else None
            self._summary = summary
        self.last_success = time.time()
        if previous_healthy is not summary["healthy"]:
            empty = [w["stage"] for w in summary["warnings"] if w["code"] == "empty_stage"]
            logger.info(
                "swarm %s%s",
                "healthy" if summary["healthy"] else "unhealthy",
                f" (empty stages: {empty})" if empty else "",
            )
        try:
            self.history.save_counters(self._run_totals, current, now, dropped)
            self.history.add(history_sample(summary))
            addrs = dialable_addrs(fetched, self._own_peer_id)
            if set(addrs) != self._remembered or now - self._remembered_at > 60:
                self._remembered, self._remembered_at = set(addrs), now
                self.history.remember_peers(addrs, now)
        except Exception as exc:  # a full disk must not stop the status page
            logger.warning("history write failed: %s: %s", type(exc).__name__, exc)
        return summary

    def _log_changes(self, old: Mapping[bytes, Any], new: Mapping[bytes, Any], entries: list[PeerEntry]) -> None:
        by_owner = {e.owner: e.record for e in entries}
        for owner in new.keys() - old.keys():
            r = by_owner[owner]
            # repr() keeps untrusted names on one line and visibly quoted in the log
            logger.info(
                "peer appeared: stage %d key %s id %r name %r state %s",
                r.stage,
                owner_fingerprint(owner),
                r.peer_id[:64],
                r.public_name,
                r.state,
            )
        for owner in old.keys() - new.keys():
            logger.info("peer gone: key %s (record expired)", owner_fingerprint(owner))

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.poll_once()
            self._stop.wait(max(0.05, self.poll_interval - (time.monotonic() - started)))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tracker-poller", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def alive(self) -> bool:
        """Whether the poller is working: it succeeded recently (or has only just started)."""
        limit = max(30.0, 6 * self.poll_interval)
        reference = self.last_success if self.last_success is not None else self.started_at
        return time.time() - reference < limit


def start_dht(
    manifest: Manifest,
    *,
    identity: str | None,
    initial_peers: Sequence[str],
    host_maddrs: Sequence[str],
    announce_maddrs: Sequence[str] | None,
    remembered: Sequence[str] = (),
):
    """A DHT node that validates the run's records like every peer does (schema + owner signatures).

    The tracker never writes peer records, so its RSA signing key is throwaway; its libp2p
    identity (`identity`) is what must persist, because the peer id is part of the bootstrap
    address volunteers paste. `remembered` are peer addresses from before a restart: a fresh
    node that dials nobody would never hear of the running swarm again (peers drop an
    unreachable node from their routing tables), so it dials them first, and starts alone only
    when none answers.
    """
    from hivemind.dht import DHT

    _, validators = make_validators(manifest, load_or_create_rsa_key(None))
    common = dict(
        host_maddrs=list(host_maddrs),
        announce_maddrs=list(announce_maddrs) if announce_maddrs else None,
        identity_path=identity,
        record_validators=validators,
    )
    if remembered:
        try:
            dht = DHT(
                start=True,
                initial_peers=[*initial_peers, *remembered],
                ensure_bootstrap_success=False,
                **common,
            )
            logger.info("rejoined the swarm through %d remembered peer addresses", len(remembered))
            return dht
        except Exception as exc:  # p2pd refuses to start when no bootstrap peer answers
            logger.info("no remembered peer answered (%s); starting from the given initial peers", type(exc).__name__)
    return DHT(start=True, initial_peers=list(initial_peers), **common)


def dht_fetch(dht, manifest: Manifest) -> Fetch:
    return lambda: fetch_stages(dht, manifest)
