"""Run-level counters that never go back, as pure functions of what each peer's record counted.

A peer's record carries its own counters (tokens, bytes), which vanish with the record when the
peer dies or moves, and start over from zero when it restarts. Summing the records online now
(the `online` block of the summary) therefore falls whenever a driver leaves. The run's totals are
instead accumulated from each peer's *increments*: the tracker remembers the last value it credited
to every peer key, adds what a counter grew by since, and when a counter is lower than remembered
(the peer restarted with the same key) adds the new value, counted from zero. A peer that leaves
keeps its contribution in the totals. The service persists totals and the remembered values in the
history's SQLite file (`tracker.history`), so a restarted tracker neither loses the run's count nor
counts the peers' counters a second time.
"""

from __future__ import annotations

from collections.abc import Mapping

COUNTERS = ("tokens_trained", "bytes_sent", "dense_equivalent_bytes")
MAX_REMEMBERED_KEYS = 4096  # peer keys whose last counters are kept (the most recently seen)

PeerCounters = Mapping[str, Mapping[str, int]]  # peer key -> {counter name: value}


def counter_gain(before: int | None, now: int) -> int:
    """What a peer's counter added since it was last credited: the growth, or all of `now` after a restart
    (a counter lower than before started over from zero). Never negative."""
    now = max(0, int(now))
    if before is None or now < before:
        return now
    return now - before


def advance(
    totals: Mapping[str, int], last: Mapping[str, Mapping[str, int]], current: PeerCounters
) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """The run totals after crediting `current` (the peers' counters in this poll), and the peers' counters
    to remember from now on. Peers absent from `current` keep their remembered values (a peer whose record
    lapsed for a poll and comes back with its counter still running is not counted twice)."""
    out = {name: int(totals.get(name, 0)) for name in COUNTERS}
    remembered = {key: dict(values) for key, values in last.items()}
    for key, counts in current.items():
        before = last.get(key, {})
        for name in COUNTERS:
            if name in counts:
                out[name] += counter_gain(before.get(name), counts[name])
        remembered[key] = {name: max(0, int(counts[name])) for name in COUNTERS if name in counts}
    return out, remembered


def forget_oldest(
    last: dict[str, dict[str, int]], seen: dict[str, float], keep: int = MAX_REMEMBERED_KEYS
) -> list[str]:
    """Drop all but the `keep` most recently seen keys from `last` and `seen` (in place), so a run with
    endless churn of fresh identities holds bounded memory; returns the keys dropped. A dropped key that
    comes back is credited its whole counter again, which only the oldest, long-gone peers risk."""
    if len(last) <= keep:
        return []
    dropped = sorted(last, key=lambda key: seen.get(key, 0.0))[: len(last) - keep]
    for key in dropped:
        last.pop(key, None)
        seen.pop(key, None)
    return dropped
