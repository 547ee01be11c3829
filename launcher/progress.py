"""What `protocol-swarm local` watches while the swarm trains: the peers' records and the tracker's page."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from swarm.records import PeerEntry

TRACKER_PROBE_INTERVAL = 5.0


@dataclass
class TrackerProbe:
    """What the tracker actually served during the run, fetched over HTTP like a browser would.

    The page counts when it answers 200 and names this run; the API when `/api/v1/swarm` answers
    200 with this run's id and one row per stage; `healthy_seen` when the API once reported every
    stage served. Failures before the first success are the tracker starting up, not errors.
    """

    url: str
    run_id: str
    num_stages: int
    page_fetches: int = 0
    api_fetches: int = 0
    healthy_seen: bool = False
    last_error: str | None = None
    last_probe: float = -float("inf")

    def probe(self, timeout: float = 5.0) -> None:
        import httpx

        self.last_probe = time.monotonic()
        try:
            page = httpx.get(self.url + "/", timeout=timeout)
            if page.status_code == 200 and self.run_id in page.text:
                self.page_fetches += 1
            else:
                self.last_error = f"GET / answered {page.status_code}"
            api = httpx.get(self.url + "/api/v1/swarm", params={"history": 0}, timeout=timeout)
            body = api.json() if api.status_code == 200 else {}
            if body.get("run_id") == self.run_id and len(body.get("stages", [])) == self.num_stages:
                self.api_fetches += 1
                self.healthy_seen = self.healthy_seen or body.get("healthy") is True
            else:
                self.last_error = f"GET /api/v1/swarm answered {api.status_code}"
        except (httpx.HTTPError, ValueError) as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"

    def due(self) -> bool:
        return time.monotonic() - self.last_probe >= TRACKER_PROBE_INTERVAL

    @property
    def ok(self) -> bool:
        return self.page_fetches > 0 and self.api_fetches > 0


@dataclass
class Progress:
    started: float = field(default_factory=time.monotonic)
    online_at: float | None = None
    loss_first: float | None = None
    loss_last: float | None = None
    loss_history: list[float] = field(default_factory=list)
    entries: dict[str, PeerEntry] = field(default_factory=dict)  # peer_id → latest record
    token_marks: list[tuple[float, int]] = field(default_factory=list)  # (when, driver tokens) at each change

    def observe(self, stages: dict[int, list[PeerEntry]]) -> None:
        for entries in stages.values():
            for entry in entries:
                self.entries[entry.record.peer_id] = entry
        tokens = self.driver_tokens()
        if tokens and (not self.token_marks or tokens != self.token_marks[-1][1]):
            self.token_marks.append((time.monotonic(), tokens))
        losses = [e.record.loss for e in stages.get(0, []) if e.record.loss is not None]
        if losses:
            loss = sum(losses) / len(losses)
            if not self.loss_history or loss != self.loss_history[-1]:
                self.loss_history.append(loss)
            if self.loss_first is None:
                self.loss_first = loss
            self.loss_last = loss

    def slowest_epoch(self, stages: dict[int, list[PeerEntry]], num_stages: int) -> int:
        per_stage = [max((e.record.optimizer_epoch for e in stages.get(s, [])), default=0) for s in range(num_stages)]
        return min(per_stage)

    def driver_tokens(self) -> int:
        return sum(e.record.tokens for e in self.entries.values() if e.record.stage == 0)

    def tokens_per_second(self) -> float:
        """From the first to the last change of the drivers' counters: records are a few seconds stale."""
        if len(self.token_marks) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self.token_marks[0], self.token_marks[-1]
        return (n1 - n0) / max(t1 - t0, 1e-9)

    def wire_bytes_per_token(self) -> float:
        """Bytes through one boundary (both directions) per token, as the drivers counted them."""
        drivers = [e.record for e in self.entries.values() if e.record.stage == 0 and e.record.tokens]
        return sum(r.bytes_in + r.bytes_out for r in drivers) / max(sum(r.tokens for r in drivers), 1)
