"""One trip, one hop at a time: what a stage does with a microbatch, on the driver and on every server.

The networked twin of `swarm/simulate.py` `run_trip`: forward through the stage's layers, pass the
boundary message to the next stage and wait for its reply (the compressed input gradient), then
backward and the optimizer step. Where `run_trip` loops over stages in one process, `Hop.hop` is
one stage's turn, and the next stage's turn happens in another peer's `Hop.hop`, reached through
`send_next`. The driver (stage 0) starts a trip with `drive`; every other stage runs `serve` on a
message its `TripServer` admitted.

A trip's activations live exactly as long as the coroutine: if the caller goes away libp2p closes
the stream, the coroutine is cancelled and the state is released. A failed next hop is retried on
another peer of the same stage while this hop still holds its activations (the policy is
`peer/routing.py` `failover`).

Collaborators are explicit: the stage's `runtime` (torch work on its one thread), the `router`
(which peer of the next stage), `link` (one message to one peer, a reply back, straight or through the
peer's relay: `peer/link.py`), `fetch` (fresh
records when the router has no candidate) and `stats` (the counters the peer announces).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from peer.audit import replies_disagree
from peer.link import Link
from peer.routing import Failover, Router
from peer.runtime import StageRuntime
from swarm.manifest import Manifest
from swarm.records import PeerEntry, plausible_loss_bound
from swarm.wire import ErrorCode, Header, WireError, encode_error, expectation_for, raise_if_error

logger = logging.getLogger("peer")

SEND_ATTEMPTS = 8  # peers of the next stage tried for one trip before giving up

Fetch = Callable[[], Awaitable[dict[int, list[PeerEntry]]]]


@dataclass
class Stats:
    """The counters a peer announces in its record and logs."""

    trips: int = 0
    tokens: int = 0
    # a driver counts a trip's boundary bytes with its tokens, when the trip ends: trips in flight and sends
    # that failed do not inflate bytes per token (failures show in `errors`)
    bytes_in: int = 0
    bytes_out: int = 0
    load: int = 0  # trips this peer is serving right now
    kv_bytes: int = 0  # K/V message bytes this peer sent in the lane trips it completed (context parallelism)
    errors: Counter = field(default_factory=Counter)
    trip_versions: Counter = field(default_factory=Counter)  # drivers: completed trips per U version
    mixed_trips: int = 0
    losses: list[float] = field(default_factory=list)
    last_loss: float | None = None
    # set while the peer leaves its stage (stopped, or moving): a failure then is the leave's doing (its trips
    # cut, p2pd gone under a group signal, trips refused as it is leaving), counted in `leaving_failures`, not `errors`
    leaving: bool = False
    leaving_failures: int = 0

    def error(self, code: ErrorCode) -> None:
        if self.leaving:
            self.leaving_failures += 1
        else:
            self.errors[code.value] += 1


def check_loss(loss: float | None, manifest: Manifest) -> float | None:
    """A loss carried back by a reply: a non-finite one (or not a number) is refused; a finite one outside
    [0, plausible_loss_bound] is dropped (None), not refused: an honest run that diverges must not get its
    peers banned, but its loss is not published either. A fake but plausible loss cannot be told from a real
    one by looking at it: audit trips (`peer/audit.py`) keep replies of unverified peers from being used."""
    if loss is None:
        return None
    if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not math.isfinite(loss):
        raise WireError(ErrorCode.NOT_FINITE, f"reported loss {loss!r} is not a finite number")
    if not 0.0 <= loss <= plausible_loss_bound(manifest):
        return None
    return float(loss)


def hop_versions(extra: dict, num_stages: int) -> list[int]:
    """The U version each downstream hop used, as it reported them: audited by the driver."""
    versions = extra.get("versions")
    if (
        not isinstance(versions, list)
        or not 1 <= len(versions) <= num_stages
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in versions)
    ):
        raise WireError(ErrorCode.MALFORMED, "backward message lacks a valid list of hop versions")
    return versions


@dataclass
class Reply:
    """What came back from the stages after this one, checked."""

    grad: torch.Tensor  # the gradient of the loss with respect to this stage's output
    loss: float | None
    versions: list[int]  # the U version of every downstream hop, the last stage first
    size: int  # bytes of the reply


@dataclass
class HopResult:
    input_grad: torch.Tensor | None  # None on stage 0: nothing upstream
    loss: float | None
    versions: list[int]  # this hop's U version last
    sent: int = 0  # bytes of the forward message to the next stage and of its reply
    received: int = 0


class Hop:
    """One stage's turn in every trip through it."""

    def __init__(
        self,
        manifest: Manifest,
        index: int,
        runtime: StageRuntime,
        router: Router,
        link: Link,
        fetch: Fetch,
        stats: Stats,
        label: str,
        trip_timeout: float,
    ):
        self.manifest, self.index, self.runtime, self.router = manifest, index, runtime, router
        self.link, self.fetch, self.stats, self.label = link, fetch, stats, label
        self.trip_timeout = trip_timeout
        self.shadows: dict[str, asyncio.Task] = {}  # peer -> the duplicate in flight to it (one at a time)

    @property
    def tokens_per_trip(self) -> int:
        return self.manifest.batch.microbatch_size * self.manifest.batch.seq_len

    def hop_timeout(self) -> float:
        """Time for the rest of the pipeline: a hop waits longer than the hop after it, so a stall far
        downstream is blamed on the stalled peer, not on the honest peers between."""
        return self.trip_timeout * max(self.manifest.num_stages - 1 - self.index, 1)

    # --- the trip ------------------------------------------------------------------------------

    async def drive(self, tokens: torch.Tensor) -> None:
        """Stage 0: one microbatch through the whole pipeline and back; its counters and its U audit."""
        version = self.runtime.stage.subspace.version
        result = await self.hop(None, tokens, version, uuid.uuid4().hex)
        stats = self.stats
        if len(set(result.versions)) == 1:
            stats.trip_versions[version] += 1
        else:
            stats.mixed_trips += 1
            logger.error("%s trip used U versions %s", self.label, result.versions)
        stats.trips += 1
        stats.tokens += tokens.numel()
        stats.bytes_out += result.sent  # a driver's byte counters are its boundary's traffic
        stats.bytes_in += result.received
        if result.loss is not None:
            stats.losses.append(result.loss)
            stats.last_loss = result.loss

    async def serve(self, blob: bytes, refuse: Callable[[ErrorCode, str, int], bytes], sender: str = "") -> bytes:
        """Stages 1…n−1: a forward message in, its backward reply out. Every failure is a coded error reply
        (`refuse`: counted and logged by the server), never an exception that could take the peer down. `sender`
        (who sent it) matters to a lane trip only (`peer/lane_trip.py`), which names its senders."""
        runtime = self.runtime
        try:
            header, hidden, tokens = runtime.codec.decode_forward(blob, stage=self.index)
        except WireError as exc:
            return refuse(exc.code, exc.message, 0)
        self.stats.load += 1
        try:
            result = await self.turn(header, hidden, tokens, sender)
            if self.index:  # stage 0 counts the trips it drives, not the chunks it serves another driver
                self.stats.trips += 1
                self.stats.tokens += tokens.numel()
            return runtime.codec.encode_backward(
                result.input_grad,
                header.trip_id,
                to_stage=max(self.index - 1, 0),  # stage 0 serves only a lane trip's driver (peer/lane_trip.py)
                loss=result.loss,
                extra={"versions": result.versions},
            )
        except WireError as exc:
            return refuse(exc.code, exc.message, exc.hops)
        except Exception as exc:  # noqa: BLE001 - a trip must never take the peer down
            logger.exception("%s trip %s failed", self.label, header.trip_id[:8])
            self.stats.error(ErrorCode.INTERNAL)
            return encode_error(ErrorCode.INTERNAL, f"{type(exc).__name__}")
        finally:
            self.stats.load -= 1

    async def turn(self, header: Header, hidden: torch.Tensor, tokens: torch.Tensor, sender: str) -> HopResult:
        """This stage's turn in a trip that arrived (a lane trip's is `LaneHop.turn`)."""
        # decode checked the version against ours; every later step re-checks it
        return await self.hop(hidden, tokens, header.u_version, header.trip_id)

    async def hop(self, hidden: torch.Tensor | None, tokens: torch.Tensor, version: int, trip_id: str) -> HopResult:
        """This stage's turn: forward, the rest of the pipeline (unless this is the tail), backward, step."""
        runtime = self.runtime
        if runtime.stage.is_tail:
            # the tail waits on nobody: forward, backward and the step in one stage-thread job, so a trip's
            # graph never outlives its job and a burst of trips holds one graph's memory, not one per trip
            def whole() -> tuple[torch.Tensor | None, float | None]:
                leaf, output, residual = runtime.forward(hidden, tokens, version)
                return self._learn(leaf, output, None, tokens, residual, version)

            input_grad, loss = await runtime.run(whole)
            return HopResult(input_grad, loss, [version])
        leaf, output, residual = await runtime.run(runtime.forward, hidden, tokens, version)
        message = await runtime.run(runtime.encode_forward, version, output, tokens, trip_id, self.index + 1)
        reply = await self.send_next(message)
        input_grad, _ = await runtime.run(self._learn, leaf, output, reply.grad, tokens, residual, version)
        return HopResult(input_grad, reply.loss, reply.versions + [version], len(message), reply.size)

    def _learn(
        self,
        leaf: torch.Tensor | None,
        output: torch.Tensor,
        grad: torch.Tensor | None,
        tokens: torch.Tensor,
        residual: torch.Tensor | None,
        version: int,
    ) -> tuple[torch.Tensor | None, float | None]:
        """Backward and the step in one job on the stage thread: no other trip's gradients in between."""
        result = self.runtime.backward(leaf, output, grad, tokens, residual, version)
        self.runtime.step(batch_size=tokens.shape[0])
        return result

    # --- the next hop ----------------------------------------------------------------------------

    def check_reply(self, reply: bytes) -> Reply:
        """Decode a backward reply and its hop-version audit (raises WireError on anything off)."""
        header, grad = self.runtime.codec.decode_backward(reply, stage=self.index)
        loss = check_loss(header.loss, self.manifest)
        return Reply(grad, loss, hop_versions(header.extra, self.manifest.num_stages), len(reply))

    async def send_next(self, message: bytes) -> Reply:
        """Send to the best verified peer of the next stage (`Router.ledger`, `peer/audit.py`) and check its
        reply; an unverified candidate (or, now and then, another verified peer) gets the same message as a
        duplicate, compared in the background. On failure ban the peer and try another
        (`Router.after_failure`). A reply that fails the checks is the next hop's fault (hops=1), so the
        peer that answered garbage is the one banned, not us upstream."""
        target, router = self.index + 1, self.router
        max_reply = expectation_for(self.manifest, self.index, "backward", 0, "").max_bytes
        failures: dict[str, int] = {}
        skip: set[str] = set()  # peers that asked us to back off during this trip
        for attempt in range(1, SEND_ATTEMPTS + 1):
            candidates = router.candidates(target)
            if not candidates:
                router.update(await self.fetch())
                candidates = router.candidates(target)
            if not candidates:
                raise WireError(ErrorCode.NO_PEER, f"stage {target} has no live compatible peer")
            ids = [e.record.peer_id for e in candidates]
            plan = router.ledger.plan([p for p in ids if p not in skip] or ids, busy=set(self.shadows))
            peer_id = plan.primary
            shadow = self._duplicate(plan.shadow, message, max_reply) if plan.shadow else None
            router.sending(peer_id)
            started = time.monotonic()
            try:
                checked = await self._ask(peer_id, message, max_reply)
                router.answered(peer_id, time.monotonic() - started, self.tokens_per_trip)
                if not router.ledger.trusted(peer_id):
                    checked.loss = None  # verified peers gone: its gradient keeps trips going, its loss is not told
                if router.ledger.clean_trip(peer_id, time.monotonic(), tofu=True):
                    logger.info("%s next hop %s verified (trust on first use)", self.label, peer_id[-6:])
                if shadow is not None:
                    self._compare_later(peer_id, checked, plan.shadow, shadow)
                return checked
            except WireError as exc:
                if shadow is not None:
                    shadow.cancel()
                    self.shadows.pop(plan.shadow, None)
                router.ledger.failed(peer_id)
                failures[peer_id] = failures.get(peer_id, 0) + 1
                action, banned = router.after_failure(peer_id, exc.code, exc.hops, len(candidates), failures[peer_id])
                if action is not Failover.BACKOFF:  # a next hop asking us to wait is not at fault: the refusal
                    self.stats.error(exc.code)  # is counted once, by the peer that refused
                self._log_failure(peer_id, exc, action, banned, attempt)
                if action is Failover.GIVE_UP:
                    raise
                if action is Failover.BACKOFF:
                    skip.add(peer_id)
                if action in (Failover.RETRY, Failover.BACKOFF):
                    # a peer that does not know us yet re-reads the DHT at most every 2 s: give it that long
                    pause = 1.0 if exc.code is ErrorCode.UNKNOWN_SENDER else 0.2
                    await asyncio.sleep(pause * failures[peer_id])
            finally:
                router.done_sending(peer_id)
        raise WireError(ErrorCode.NO_PEER, f"no peer of stage {target} answered after {SEND_ATTEMPTS} attempts")

    async def _ask(self, peer_id: str, message: bytes, max_reply: int) -> Reply:
        reply = await self.link.send(peer_id, message, self.hop_timeout(), max_reply)
        raise_if_error(reply)
        try:
            return self.check_reply(reply)
        except WireError as exc:
            raise WireError(exc.code, exc.message, hops=1) from None

    def _duplicate(self, peer_id: str, message: bytes, max_reply: int) -> asyncio.Task:
        """Send the same message to `peer_id` as an audit duplicate; its reply is only ever compared."""
        router = self.router
        router.sending(peer_id)

        async def ask() -> tuple[Reply, float]:
            started = time.monotonic()
            try:
                return await self._ask(peer_id, message, max_reply), time.monotonic() - started
            finally:
                router.done_sending(peer_id)

        task = asyncio.ensure_future(ask())
        self.shadows[peer_id] = task  # busy until its reply is compared (`_compare_later`) or it is cancelled
        return task

    def _compare_later(self, primary: str, used: Reply, shadow: str, task: asyncio.Task) -> None:
        """Once the duplicate is back, compare it with the reply we used: agreement counts toward the shadow's
        verification, disagreement costs the peer with the shorter verified history its standing and a long ban."""
        router, ledger = self.router, self.router.ledger

        def done(t: asyncio.Task) -> None:
            self.shadows.pop(shadow, None)  # a fast liar gets no second duplicate before the first is judged
            if t.cancelled():
                return
            exc = t.exception()
            if isinstance(exc, WireError):
                self.stats.error(exc.code)
                ledger.failed(shadow)
                action, banned = router.after_failure(shadow, exc.code, exc.hops, 2, 1)
                self._log_failure(shadow, exc, action, banned, 0)
                return
            if exc is not None:
                logger.warning("%s audit duplicate to %s failed: %r", self.label, shadow[-6:], exc)
                return
            reply, seconds = t.result()
            why = replies_disagree(used.grad, used.loss, reply.grad, reply.loss)
            if why is None:
                router.answered(shadow, seconds, self.tokens_per_trip)
                if ledger.clean_trip(shadow, time.monotonic(), tofu=False):
                    logger.info("%s next hop %s verified by audit trips", self.label, shadow[-6:])
                return
            loser = ledger.loser(primary, shadow)
            ledger.distrust(loser)
            banned = router.ban(loser, lied=True)
            logger.warning("%s audit: replies of %s and %s disagree (%s); %s banned %.0fs", self.label,
                           primary[-6:], shadow[-6:], why, loser[-6:], banned)

        task.add_done_callback(done)

    def _log_failure(self, peer_id: str, exc: WireError, action: Failover, banned: float, attempt: int) -> None:
        short = peer_id[-6:]
        if action is Failover.GIVE_UP:
            if banned:
                logger.warning("%s next hop %s kept refusing trips for our U version; banned %.0fs", self.label, short,
                               banned)
        elif action is Failover.BACKOFF:
            logger.debug("%s next hop %s asked us to back off (%s)", self.label, short, exc)
        elif action is Failover.RETRY:
            logger.warning("%s next hop %s failed (%s); retrying it (attempt %d)", self.label, short, exc, attempt)
        else:
            logger.warning(
                "%s next hop %s failed (%s); banned %.0fs, failing over (attempt %d)", self.label, short, exc, banned,
                attempt,
            )
