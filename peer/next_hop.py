"""The next hop: which peer of the next stage gets this stage's part of a trip, and whether its reply is believed.

`NextHop.send` is a pipeline trip's: the best verified peer of the next stage (`peer/routing.py` `Router`, its
`Ledger` in `peer/audit.py`) gets the message, an unverified candidate (or, now and then, another verified one) a
duplicate compared in the background, and a failure bans the peer and tries another (`Router.after_failure`).
`NextHop.ask` is a lane trip's (`peer/lane_trip.py`): its group names the next peer, so there is no failover
(the driver runs the trip again with another group). One lane hop cannot be duplicated alone (its duplicate's
peer would need the other lanes' K/V of the same trip), so the driver forks whole stages now and then
(`peer/lane_claim.py`); a fork's message comes here beside the trip's, and its reply is compared like a pipeline
duplicate's, against the same `Ledger`. As in a pipeline trip, only a trusted peer's loss goes back up.

Either way the bytes go over the stage's `Link` (`peer/link.py`) and the reply is checked here (`check_reply`:
the backward message, its loss, its hop versions) before the trip uses it; a reply that fails the checks is the
next hop's fault (hops=1), so the peer that answered garbage is the one banned, not us upstream.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import torch

from peer.audit import (
    AUDIT_MAX_LAG,
    COSINE_MIN,
    LOSS_GAP_MAX,
    LOSS_WINDOW,
    agreement,
    epoch_lag,
    loss_gap_of_lag,
    loss_rtol,
    replies_disagree,
)
from peer.link import Link
from peer.routing import Failover, Router
from peer.runtime import StageRuntime
from peer.stats import Stats
from swarm.manifest import Manifest
from swarm.records import PeerEntry, plausible_loss_bound
from swarm.wire import ErrorCode, WireError, expectation_for, raise_if_error

logger = logging.getLogger("peer")

# the verdict logged for a comparison that is not judged (a verdict on its pair landed while it was in flight)
NOT_JUDGED = "not judged, a verdict on the pair landed meanwhile"
# ...and for a loss gap between two verified peers that is not a verdict yet (`Ledger.losses_apart`)
LOSS_GAP_WEIGHED = "a loss gap weighed, not a verdict on its own"
SEND_ATTEMPTS = 8  # peers of the next stage tried for one trip before giving up

Fetch = Callable[[], Awaitable[dict[int, list[PeerEntry]]]]


def check_loss(loss: float | None) -> float | None:
    """A loss carried back by a reply, as sent: a non-finite one (or not a number) is refused. A finite one is
    kept whatever its value, for an audit to compare (a liar must not skip the loss check by sending one
    out of bounds); what is published passes `plausible_loss` too."""
    if loss is None:
        return None
    if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not math.isfinite(loss):
        raise WireError(ErrorCode.NOT_FINITE, f"reported loss {loss!r} is not a finite number")
    return float(loss)


def plausible_loss(loss: float | None, manifest: Manifest) -> float | None:
    """The loss to publish: one outside [0, plausible_loss_bound] is dropped (None), not refused: an honest run
    that diverges must not get its peers banned, but its loss is not published either. A fake but plausible
    loss cannot be told from a real one by looking at it: audit trips (`peer/audit.py`) keep replies of
    unverified peers from being used."""
    return loss if loss is not None and 0.0 <= loss <= plausible_loss_bound(manifest) else None


def _hop_counts(extra: dict, key: str, lengths: range) -> list[int]:
    """A header list of one non-negative int per downstream hop, its length in `lengths`; else MALFORMED."""
    values = extra.get(key)
    if (
        not isinstance(values, list)
        or len(values) not in lengths
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)
    ):
        raise WireError(ErrorCode.MALFORMED, f"backward message lacks a valid list of hop {key}")
    return values


def hop_versions(extra: dict, num_stages: int) -> list[int]:
    """The U version each downstream hop used, as it reported them: audited by the driver."""
    return _hop_counts(extra, "versions", range(1, num_stages + 1))


def hop_epochs(extra: dict, hops: int) -> list[int]:
    """The epoch of each downstream hop's weights, as they reported them (one per hop version): what an audit
    compares replies at (`peer/audit.py`)."""
    return _hop_counts(extra, "epochs", range(hops, hops + 1))


@dataclass
class Reply:
    """What came back from the stages after this one, checked."""

    grad: torch.Tensor  # the gradient of the loss with respect to this stage's output
    loss: float | None
    versions: list[int]  # the U version of every downstream hop, the last stage first
    epochs: list[int]  # the epoch of every downstream hop's weights, in the same order
    size: int  # bytes of the reply


class NextHop:
    """This stage's next hop in every trip through it (module docstring)."""

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
        # a trip's tokens through this stage: a lane carries one chunk of each sequence (1 lane without context
        # parallelism); what a service time is measured against (`Router.answered`)
        self.tokens_per_trip = manifest.batch.microbatch_size * manifest.batch.seq_len // manifest.lanes
        self.max_reply = expectation_for(manifest, index, "backward", 0, "").max_bytes
        self.shadows: dict[str, asyncio.Task] = {}  # peer -> the duplicate in flight to it (one at a time)

    def timeout(self) -> float:
        """Time for the rest of the pipeline: a hop waits longer than the hop after it, so a stall far
        downstream is blamed on the stalled peer, not on the honest peers between."""
        return self.trip_timeout * max(self.manifest.num_stages - 1 - self.index, 1)

    def check_reply(self, reply: bytes) -> Reply:
        """Decode a backward reply and its hop-version audit (raises WireError on anything off)."""
        header, grad = self.runtime.codec.decode_backward(reply, stage=self.index)
        loss = check_loss(header.loss)
        versions = hop_versions(header.extra, self.manifest.num_stages)
        return Reply(grad, loss, versions, hop_epochs(header.extra, len(versions)), len(reply))

    async def send(self, message: bytes) -> Reply:
        """A pipeline trip: to the best verified peer of the next stage, an audit duplicate beside it, failover
        on a failure (module docstring)."""
        target, router, max_reply = self.index + 1, self.router, self.max_reply
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
            plan = router.ledger.plan([p for p in ids if p not in skip] or ids, busy=set(self.shadows),
                                      now=time.monotonic())
            peer_id = plan.primary
            shadow = self._duplicate(plan.shadow, message, max_reply) if plan.shadow else None
            router.sending(peer_id)
            started = time.monotonic()
            try:
                checked = await self._ask(peer_id, message, max_reply)
                router.answered(peer_id, time.monotonic() - started, self.tokens_per_trip)
                if shadow is not None:
                    self._compare_later(peer_id, checked, plan.shadow, shadow)
                return self._believe(peer_id, checked)
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

    async def ask(self, peer_id: str, message: bytes, duplicate: tuple[str, bytes] | None = None) -> Reply:
        """A lane trip's next stage: to the peer its group names, no failover; any failure there (unreachable too)
        is one hop down, and a peer this hop banned for lying is refused (the driver strikes the group and picks
        another). `duplicate` (peer, message) is the trip's audit fork (`peer/lane_claim.py`): sent beside (never
        to a liar), cancelled if this lane fails, its reply only compared (`_compare_later`); the reply used is
        believed (its loss published) only if trusted."""
        liars = self.router.liars()
        if peer_id in liars:
            raise WireError(ErrorCode.NO_PEER, f"the group names {peer_id[-6:]}, banned here for lying", hops=1)
        fork = None
        if duplicate is not None and duplicate[0] not in liars:  # a liar's honest answer must not clear its ban
            fork = self._duplicate(*duplicate, self.max_reply, register=False)
        try:
            reply = await self._handed(peer_id, message)  # its loss as sent: a fork compares it, `_believe` filters
        except BaseException:  # refused, failed or cancelled: the fork cannot complete without this lane
            if fork is not None:
                fork.cancel()
            raise
        if fork is not None and duplicate[0] != peer_id:
            self._compare_later(peer_id, reply, duplicate[0], fork, lane_fork=True)
        elif fork is not None:  # the fork kept this lane's peer: it serves both trips, there is nothing to compare
            fork.add_done_callback(_retrieve)
        return self._believe(peer_id, reply)

    async def hand(self, peer_id: str, message: bytes) -> Reply:
        """A lane trip's message to a named peer, its reply checked and its loss as published; nothing audited or
        believed here (the driver hands its stage-0 lane partners their chunks this way: peers of its own stage, not
        its next hops)."""
        reply = await self._handed(peer_id, message)
        return replace(reply, loss=plausible_loss(reply.loss, self.manifest))

    async def _handed(self, peer_id: str, message: bytes) -> Reply:
        """`hand`'s reply with its loss as sent (`check_loss`): what an audit fork compares."""
        started = time.monotonic()
        try:
            reply = await self._ask(peer_id, message, self.max_reply)
        except WireError as exc:
            raise WireError(exc.code, exc.message, max(exc.hops, 1)) from None
        self.router.answered(peer_id, time.monotonic() - started, self.tokens_per_trip)
        return reply

    def _believe(self, peer_id: str, checked: Reply) -> Reply:
        """The reply as the trip uses it: only a trusted peer's plausible loss is published (verified, or trust on
        first use while nobody is verified); an untrusted one's gradient keeps trips going when no trusted peer is
        left, its loss is not told. `checked` itself keeps its loss as sent, for an audit to compare. A clean
        answer while nobody is verified counts toward trust on first use."""
        ledger = self.router.ledger
        trusted = ledger.trusted(peer_id)
        if ledger.clean_trip(peer_id, time.monotonic(), tofu=True):
            logger.info("%s next hop %s verified (trust on first use)", self.label, peer_id[-6:])
        return replace(checked, loss=plausible_loss(checked.loss, self.manifest) if trusted else None)

    async def _ask(self, peer_id: str, message: bytes, max_reply: int) -> Reply:
        reply = await self.link.send(peer_id, message, self.timeout(), max_reply)
        raise_if_error(reply)
        try:
            return self.check_reply(reply)
        except WireError as exc:
            raise WireError(exc.code, exc.message, hops=1) from None

    def _duplicate(self, peer_id: str, message: bytes, max_reply: int, register: bool = True) -> asyncio.Task:
        """Send the same message to `peer_id` as an audit duplicate; its reply is only ever compared. A pipeline
        duplicate keeps its peer busy for `plan` (`register`); a lane fork's peer is the driver's choice."""
        router = self.router
        router.sending(peer_id)

        async def ask() -> tuple[Reply, float]:
            started = time.monotonic()
            try:
                return await self._ask(peer_id, message, max_reply), time.monotonic() - started
            finally:
                router.done_sending(peer_id)

        task = asyncio.ensure_future(ask())
        if register:
            self.shadows[peer_id] = task  # busy until its reply is compared (`_compare_later`) or it is cancelled
        return task

    def _compare_later(
        self, primary: str, used: Reply, shadow: str, task: asyncio.Task, lane_fork: bool = False
    ) -> None:
        """Once the duplicate is back, compare it with the reply we used. Only a verified peer's reply can check
        another's: a match counts toward the unverified one's verification, a mismatch costs it its standing and
        a long ban; between two verified peers the shorter verified history loses. Two unverified replies (a lane
        fork's, which the driver chose) prove nothing either way. A duplicate that failed bans its peer as a failed
        trip would, except a lane fork's (`lane_fork`): the driver shaped it, and a hostile driver must not get
        honest peers banned by naming them in forks that cannot succeed. A lane fork's replies are not weighed for
        drift (`Ledger.drift`), and their losses may be further apart (`LANE_LOSS_RTOL`): honest lane peers' replies
        drift apart (benchmarks/RESULTS.md). The cosines of two verified peers and of lane forks are weighed over the
        pair's last few for a sign flip (`Ledger.flip`); a peer being verified is refused at one below the floor. So
        are two verified peers' pipeline losses for a gap (`Ledger.losses_apart`): a gap weighed is neither a match
        nor a verdict. A comparison is not judged if a verdict on either peer landed while it was in flight
        (`Ledger.verdicts_on`)."""
        router, ledger = self.router, self.router.ledger
        standing = ledger.verdicts_on(primary, shadow)

        def done(t: asyncio.Task) -> None:
            if self.shadows.get(shadow) is t:
                del self.shadows[shadow]  # a fast liar gets no second duplicate before the first is judged
            if t.cancelled():
                return
            exc = t.exception()
            if isinstance(exc, WireError):
                self.stats.error(exc.code)
                ledger.failed(shadow)
                if not lane_fork:
                    action, banned = router.after_failure(shadow, exc.code, exc.hops, 2, 1)
                    self._log_failure(shadow, exc, action, banned, 0)
                else:
                    logger.info("%s audit fork to %s failed: %s", self.label, shadow[-6:], exc)
                return
            if exc is not None:
                logger.warning("%s audit duplicate to %s failed: %r", self.label, shadow[-6:], exc)
                return
            reply, seconds = t.result()
            seen = agreement(used.grad, used.loss, reply.grad, reply.loss)
            lag = epoch_lag(used.epochs, reply.epochs)
            judged = ledger.verdicts_on(primary, shadow) == standing
            rtol = loss_rtol(used.loss, used.epochs, reply.loss, reply.epochs, lane_fork)
            # between two verified peers (and on lane forks) a sign flip is judged over the pair's last few cosines
            # (`Ledger.flip`); a peer not verified yet is refused at one, so that it cannot be verified on windows
            # split among several primaries
            both_verified = ledger.verified(primary) and ledger.verified(shadow)
            settled = lane_fork or both_verified
            cosine_min = -math.inf if settled else COSINE_MIN
            # between two verified peers a pipeline loss gap is judged over the pair's last few (`Ledger.losses_apart`)
            windowed = both_verified and not lane_fork and lag is not None and lag <= AUDIT_MAX_LAG and judged
            loss_judged = ledger.losses_apart(primary, shadow, seen, rtol) if windowed else True
            why = replies_disagree(used.grad, used.loss, reply.grad, reply.loss, cosine_min,
                                   rtol if loss_judged else math.inf, seen)
            gap = seen.loss_rdiff is not None and seen.loss_rdiff > rtol
            weighed = gap and not loss_judged
            if windowed and gap and loss_judged and seen.loss_rdiff <= LOSS_GAP_MAX:  # `why` is the loss's (first)
                why += f", the pair's second gap in its last {LOSS_WINDOW} comparisons"
            logger.debug("%s audit of %s against %s: loss rdiff %s, cosine %s, norms %.4g %.4g, epochs apart %s, %s%s",
                         self.label, shadow[-6:], primary[-6:], seen.loss_rdiff, seen.cosine, *seen.norms, lag,
                         "" if judged else f"{NOT_JUDGED}: ", why or (
                             f"{LOSS_GAP_WEIGHED}: losses {used.loss:.4g} and {reply.loss:.4g} differ by more than "
                             f"{rtol:.0%}" if weighed else "agree"))
            if not judged:
                return
            verified = {peer for peer in (primary, shadow) if ledger.verified(peer)}
            if not verified:
                return
            if lag is None:
                why = why or "the replies cover different hops"
            elif lag > AUDIT_MAX_LAG or (
                loss_judged and loss_gap_of_lag(seen, rtol, used.loss, used.epochs, reply.loss, reply.epochs)
            ):
                # too far apart to compare losses (`loss_rtol`), or losses a little past the slack the way a copy that
                # fell behind while the loss falls fast gives them (between two verified peers, once the gap is
                # judged): while the lag is excused, no verdict on a gradient that passes (a zero, non-finite or, for
                # a loss gap, negated one is refused)
                gradient = replies_disagree(used.grad, used.loss, reply.grad, reply.loss, cosine_min, math.inf, seen)
                if gradient is None and self._lag_excused(ledger.loser(primary, shadow), lag, why):
                    return
                why = why or f"weights {lag} epochs apart, past the grace"
            why = why or ledger.flip(primary, shadow, seen)
            if not lane_fork and not weighed:
                why = why or ledger.drift(primary, shadow, seen, lag)
            if why is None and weighed:
                return  # a gap weighed is neither a match (no drift, no service time) nor a verdict yet
            if why is None:
                router.answered(shadow, seconds, self.tokens_per_trip)
                for checked in {primary, shadow} - verified:
                    if ledger.clean_trip(checked, time.monotonic(), tofu=False):
                        logger.info("%s next hop %s verified by audit trips", self.label, checked[-6:])
                return
            loser = ledger.loser(primary, shadow)
            ledger.distrust(loser)
            banned = router.ban(loser, lied=True)
            logger.warning("%s audit: replies of %s and %s disagree (%s); %s banned %.0fs", self.label,
                           primary[-6:], shadow[-6:], why, loser[-6:], banned)

        task.add_done_callback(done)

    def _lag_excused(self, suspect: str, lag: int, gap: str | None) -> bool:
        """Two replies too many epochs apart to compare, or whose losses (`gap`) are apart as the older weights' are
        (`peer/audit.py`): no verdict on `suspect` (the peer an audit would blame) while its lag is excused;
        meanwhile it is not verified, so not used."""
        ledger = self.router.ledger
        first = suspect not in ledger.lagging_since
        if not ledger.excuse_lag(suspect, time.monotonic()):
            return False
        if ledger.verified(suspect):
            ledger.distrust(suspect)  # verified again once its replies compare
        ledger.failed(suspect)  # matches on either side of an uncompared reply are not consecutive
        if first:
            logger.info("%s audit: %s answered with weights %d epochs from the reply it is checked against (%s); no "
                        "verdict, and its replies not used, for up to %.0f s while it catches up", self.label,
                        suspect[-6:], lag, gap or "losses not compared", ledger.lag_grace)
        return True

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


def _retrieve(task: asyncio.Task) -> None:
    """A fork's reply nobody compares: its failure is the fork's, noted at DEBUG and dropped."""
    if not task.cancelled() and task.exception() is not None:
        logger.debug("an audit fork's uncompared trip failed: %s", task.exception())
