"""How many trips a driver keeps in flight (issue 27): as many as raise its throughput, at most `--max-inflight`.

The right number is the pipeline's bandwidth-delay product: a trip's latency (every stage's compute plus
every link's delay and transfer) over the time the slowest stage needs per trip. Fewer leave that stage
idle while trips cross the links; more only queue in front of it, holding activations in memory for nothing.
Neither term is known in advance and both move (a peer joins, a link gets slower), so the window is found
by measuring, with no timing constant: run a period at one window, then at a neighbour, and keep the
neighbour only if the throughput says so.

Why hill climbing on measured throughput rather than Little's law (window = throughput × unloaded latency):
the unloaded latency cannot be observed once the window is at or past the bandwidth-delay product, because
then every trip waits in the bottleneck's queue; the estimate then equals the window, plus the headroom it
adds, and the window climbs to the bound unless trips are periodically starved to measure it again.
Comparing throughputs needs no such drain, and a window that only adds queueing simply shows no gain.

The rule, for two neighbouring windows lo and hi = lo + 1: hi is worth its extra trip when it carries at
least half a trip's share more, throughput(hi) ≥ throughput(lo) · (1 + 1 / (2 · lo)). Below the bottleneck
one more trip adds 1 / lo (each of lo trips carried its share); past it, nothing; half of the share is the
widest margin against noise that still tells the two apart at any window. Up- and down-probes use the same
test, so two neighbours never argue. An accepted probe goes on in its direction (a fresh start climbs
quickly); a refused one returns to where it came from, and after `settle` periods there the other direction
is tried: a link that got faster is found by the up-probes, one that got slower by the down-probes.

A period is measured on trips that started at its window (those sent before a change are ignored), and
spans `rounds` times the window in completions, at least `min_trips`: several round trips, so a single
slow or fast trip moves the estimate little. Its throughput is tokens over the time from its first
completion to its last, which leaves out the time the new window took to fill.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def worth_one_more(lo_rate: float, hi_rate: float, lo: int) -> bool:
    """Whether window lo + 1 (measured `hi_rate`) carries at least half a trip's share over lo (`lo_rate`)."""
    return hi_rate >= lo_rate * (1.0 + 1.0 / (2 * lo))


@dataclass
class InflightWindow:
    """The driver's window, moved by `finished` (pure: the caller passes times, in seconds on one clock)."""

    max_window: int  # `--max-inflight`: the bound memory sets (each trip holds activations on every stage)
    start: int = 2  # two trips keep two stages busy; the climb corrects it either way
    rounds: int = 3  # completions per period, in windows
    min_trips: int = 8
    settle: int = 4  # periods at a settled window before the next probe
    window: int = field(init=False)
    since: float = field(init=False, default=float("-inf"))  # when the current window was set
    direction: int = field(init=False, default=1)  # where the next probe goes: +1 up, -1 down
    origin: tuple[int, float] | None = field(init=False, default=None)  # a probe's (window, throughput) it left
    quiet: int = field(init=False)  # periods measured at the settled window since the last probe
    _ends: list[float] = field(init=False, default_factory=list)
    _tokens: list[int] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.max_window < 1:
            raise ValueError("max_window must be at least 1")
        self.window = max(1, min(self.start, self.max_window))
        self.quiet = self.settle  # the first period is followed by a probe at once (up, unless at the bound)

    def finished(self, started: float, ended: float, tokens: int) -> int:
        """Count one completed trip (sent at `started`, answered at `ended`, carrying `tokens`); the window now."""
        if started < self.since:
            return self.window
        self._ends.append(ended)
        self._tokens.append(tokens)
        span = self._ends[-1] - self._ends[0]
        if len(self._ends) >= max(self.min_trips, self.rounds * self.window) and span > 0:
            self._measured(sum(self._tokens[1:]) / span, ended)
        return self.window

    def _measured(self, rate: float, now: float) -> None:
        """One period's throughput at the current window: settle, probe, or judge the probe under way."""
        window = self.window
        if self.origin is not None:
            other, other_rate = self.origin
            lo, lo_rate, hi_rate = (other, other_rate, rate) if other < window else (window, rate, other_rate)
            kept = lo + 1 if worth_one_more(lo_rate, hi_rate, lo) else lo
            if kept == window:  # accepted: go on the same way while the bounds allow, else settle here
                self._probe(rate, now, turn=False)
            else:  # refused: back where it came from, and the next probe tries the other way
                self.direction = -self.direction
                self._set(other, None, now)
            return
        self.quiet += 1
        if self.quiet >= self.settle:
            self._probe(rate, now, turn=True)
        else:
            self._set(window, None, now)

    def _probe(self, rate: float, now: float, turn: bool) -> None:
        """Try the neighbour in `direction`, measured `rate` here; at a bound, the other neighbour if `turn` (from
        a settled window), else settle here. With no neighbour at all (`max_window` 1) the window stays."""
        window = self.window
        if turn and not 1 <= window + self.direction <= self.max_window:
            self.direction = -self.direction
        target = window + self.direction
        if 1 <= target <= self.max_window:
            self._set(target, (window, rate), now)
        else:
            self._set(window, None, now)

    def _set(self, window: int, origin: tuple[int, float] | None, now: float) -> None:
        """Start a new period at `window`; a settled one (no `origin`) starts its count of quiet periods."""
        if origin is None and (self.origin is not None or window != self.window):
            self.quiet = 0
        self.window, self.origin, self.since = window, origin, now
        self._ends, self._tokens = [], []
