"""Refusing trips cheaply and quietly: per-sender admission limits and an aggregated refusal log.

Both are pure (the caller passes the clock), so their rules are unit-tested without a swarm.

`SenderLimits`: a token bucket and an in-flight cap per sender, applied to senders that passed the
record check, before any decoding. `RefusalLog`: a hostile sender must not be able to fill a
volunteer's disk, so refusals are counted per sender and code and written as one line per sender
per interval (at most `max_senders` + 1 lines per interval, whatever the attack).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

OTHERS = "(other senders)"


@dataclass
class _Bucket:
    tokens: float
    updated: float
    inflight: int = 0


def fair_share(total_cap: int, load: int, active: int) -> int:
    """How many trips one sender may have in flight at a peer that takes `total_cap` at once.

    Below half the cap nobody is limited (a lone relay carrying several drivers' trips may use it
    all); from `total_cap / 2` in flight on, a sender gets its equal share of the cap among the senders
    with trips in flight (`active`, itself included), at least 1. An honest sender sends a trip only
    when an earlier one was answered, so it is refused only when the peer is at least half full *and*
    it holds more than its share, i.e. when it would be taking slots another sender needs."""
    if load < total_cap / 2:
        return total_cap
    return max(1, total_cap // max(active, 1))


@dataclass
class SenderLimits:
    """At most `max_inflight` trips of one sender at once, and on average `rate` trips/s (bursts of `burst`).

    With `total_cap` set, the in-flight cap is that sender's `fair_share` of `total_cap` instead, recomputed
    at every admission from what all senders have in flight (`max_inflight` then bounds it as well)."""

    rate: float
    burst: float
    max_inflight: int
    buckets: dict[str, _Bucket] = field(default_factory=dict)
    total_cap: int | None = None

    def cap_for(self, sender: str) -> int:
        """The in-flight cap of `sender` now."""
        if self.total_cap is None:
            return self.max_inflight
        load = sum(b.inflight for b in self.buckets.values())
        mine = self.buckets.get(sender)
        active = sum(1 for b in self.buckets.values() if b.inflight) + int(mine is None or not mine.inflight)
        return min(self.max_inflight, fair_share(self.total_cap, load, active))

    def admit(self, sender: str, now: float) -> str | None:
        """None if the trip may proceed (then `release` it when done), else why not."""
        cap = self.cap_for(sender)
        bucket = self.buckets.get(sender)
        if bucket is None:
            if len(self.buckets) >= 4096:
                self._prune(now)
            bucket = self.buckets[sender] = _Bucket(tokens=self.burst, updated=now)
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.updated) * self.rate)
        bucket.updated = now
        if bucket.inflight >= cap:
            return f"{bucket.inflight} trips of this sender in flight (at most {cap} now)"
        if bucket.tokens < 1.0:
            return f"more than {self.rate:.0f} trips/s from this sender"
        bucket.tokens -= 1.0
        bucket.inflight += 1
        return None

    def release(self, sender: str) -> None:
        bucket = self.buckets.get(sender)
        if bucket is not None and bucket.inflight > 0:
            bucket.inflight -= 1

    def _prune(self, now: float) -> None:
        """Forget senders with nothing in flight whose bucket has refilled (they lose nothing)."""
        self.buckets = {
            s: b for s, b in self.buckets.items() if b.inflight or b.tokens + (now - b.updated) * self.rate < self.burst
        }


@dataclass
class RefusalLog:
    """Counts refusals by sender and code; `flush` returns one line per sender once per `interval`."""

    interval: float = 30.0
    max_senders: int = 32
    started: float = 0.0
    counts: dict[str, Counter] = field(default_factory=dict)

    def note(self, sender: str, code: str) -> None:
        if sender not in self.counts and len(self.counts) >= self.max_senders:
            sender = OTHERS  # memory and lines stay bounded however many identities an attacker makes
        self.counts.setdefault(sender, Counter())[code] += 1

    def flush(self, now: float) -> list[str]:
        if now - self.started < self.interval:
            return []
        seconds = now - self.started
        lines = []
        for sender, codes in sorted(self.counts.items(), key=lambda item: -sum(item[1].values())):
            detail = ", ".join(f"{code} {n}" for code, n in codes.most_common())
            lines.append(f"refused {sum(codes.values())} trip(s) from {sender} in {seconds:.0f}s: {detail}")
        self.counts, self.started = {}, now
        return lines
