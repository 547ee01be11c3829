"""The peer's lifecycle: join the DHT, claim a stage, serve trips, announce, rebalance, leave.

A trip is one nested call chain: stage i receives a forward message, runs its layers, calls a
peer of stage i+1 and awaits its reply (the compressed input gradient), runs backward and
answers with its own input gradient. The trip's activations therefore live exactly as long as
the handler coroutine; when the caller goes away libp2p closes the stream, the coroutine is
cancelled and the state is released. A failed next hop is retried on another peer of the
same stage while this hop still holds its activations.

Who may send what. A forward trip for stage s is accepted only from a libp2p peer id (authenticated
by libp2p: `remote`) that holds a live record of this run for stage s−1 (for s = 1 that is a driver);
anyone else is answered `unknown_sender` before the message is decoded, and counted. A backward
reply is read only from the stream this peer opened to the peer it chose (`send_trip` dials that
peer id, and libp2p authenticates the peer at the other end), so nobody else can answer for it.
Known senders are held to a token bucket and an in-flight cap (`sender_limits`), and every refusal
is logged once per sender per interval (`peer.refusals`), not once per trip.

Stopping. SIGINT or SIGTERM, to the process or to its whole process group (Ctrl-C, systemd):
the peer leaves its stage, saves its checkpoint and exits; a second SIGINT exits at once. The
DHT's child process is started with both signals ignored, so a group signal cannot kill it under
the parent, and p2pd dying first only makes the leave's DHT calls time out (they are bounded).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import math
import multiprocessing
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from hivemind.dht import DHT
from hivemind.p2p import P2P, PeerID
from hivemind.utils.timed_storage import get_dht_time

from dhtio.records import announce, fetch_stages
from peer.placement import choose_stage, should_move
from peer.refusals import RefusalLog, SenderLimits
from peer.routing import Router
from peer.runtime import StageRuntime, pick_device
from peer.transport import TripServicer, send_trip
from swarm.manifest import Manifest
from swarm.records import (
    ANNOUNCE_INTERVAL,
    SOFTWARE_VERSION,
    StagePeerRecord,
    claimed_throughput,
    load_identity_key,
    make_validators,
    plausible_loss_bound,
    plausible_throughput,
)
from swarm.wire import ErrorCode, WireError, encode_error, expectation_for, raise_if_error

logger = logging.getLogger("peer")

SENDER_REFRESH_INTERVAL = 2.0  # at most one DHT read per this many seconds on behalf of unknown senders
LEAVE_DHT_TIMEOUT = 5.0  # a DHT call while leaving gives up after this (p2pd may already be gone)
SIGNAL_DRAIN_TIMEOUT = 15.0  # stopped by a signal: trips in flight get at most this long (exit within 30 s)


@dataclass
class PeerOptions:
    stage: str = "auto"
    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    identity: str | None = None
    device: str = "auto"
    public_name: str = ""
    checkpoint_dir: str | None = None
    max_inflight: int = 4
    data: str | None = None
    trip_timeout: float = 60.0
    placement_delay: float = 3.0
    rebalance_interval: float = 60.0
    drain_timeout: float = 30.0
    log_interval: float = 5.0
    fault_t_fixed_seed: int | None = None
    checkpoint_every: int = 50
    heartbeat_file: str | None = None


@dataclass
class Stats:
    trips: int = 0
    tokens: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    errors: Counter = field(default_factory=Counter)
    trip_versions: Counter = field(default_factory=Counter)  # drivers: completed trips per U version
    mixed_trips: int = 0
    losses: list[float] = field(default_factory=list)
    last_loss: float | None = None

    def error(self, code: ErrorCode) -> None:
        self.errors[code.value] += 1


def check_loss(loss: float | None, manifest: Manifest) -> float | None:
    """A loss carried back by a reply: None, or finite within [0, plausible_loss_bound]; anything else is
    refused (a fake but plausible loss cannot be told from a real one; routing keeps liars to few trips)."""
    if loss is None:
        return None
    bound = plausible_loss_bound(manifest)
    if not (isinstance(loss, (int, float)) and math.isfinite(loss) and 0.0 <= loss <= bound):
        raise WireError(ErrorCode.OUT_OF_RANGE, f"reported loss {loss!r} is outside [0, {bound:.1f}]")
    return float(loss)


T = TypeVar("T")


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


@contextlib.contextmanager
def stop_signals_ignored_by_children():
    """SIGINT and SIGTERM ignored while child processes are forked (hivemind's DHT, its averagers): they
    inherit it, so a signal to the whole process group (Ctrl-C, systemd's KillMode) reaches only us,
    and we stop them in order. p2pd, exec'd by the DHT process, keeps SIGINT ignored too (Go respects
    an inherited SIG_IGN for SIGINT) but dies on SIGTERM; the leave tolerates that (bounded DHT calls).
    Our own handlers are restored afterwards (a signal arriving meanwhile is lost: send it again)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc), children before their own children; [] if unknown."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop(0)
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                children = Path(f"/proc/{parent}/task/{task}/children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.append(child)
                    queue.append(child)
    return found


def kill_descendants() -> None:
    """SIGKILL what is left below us (DHT and averager processes, p2pd): they ignore the stop signals."""
    for pid in descendants(os.getpid()):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # reap our own children (grandchildren are reparented)
        try:
            if os.waitpid(-1, os.WNOHANG) == (0, 0):
                time.sleep(0.02)
        except ChildProcessError:
            break


class StageMove(Exception):
    def __init__(self, target: int):
        super().__init__(f"moving to stage {target}")
        self.target = target


class PeerDaemon:
    def __init__(self, manifest: Manifest, options: PeerOptions):
        self.manifest, self.options = manifest, options
        self.stats = Stats()
        self.runtime: StageRuntime | None = None
        self.index: int | None = None
        self.state = "joining"
        self.load = 0
        self.throughput = 0.0
        self.stopping = asyncio.Event()
        self.dht: DHT | None = None
        self.p2p = None
        self.router: Router | None = None
        self.rng = random.Random()
        self.refusal_log = RefusalLog(interval=max(6 * options.log_interval, 10.0), started=time.monotonic())
        self.sender_limits = self._sender_limits()
        self._sender_refresh_at = -float("inf")
        self._sender_refresh_lock: asyncio.Lock | None = None
        self._temp_identity: Path | None = None
        self._stop_signals: list[float] = []

    def _sender_limits(self) -> SenderLimits:
        """Per-sender limits, sized so honest traffic never meets them.

        In flight: half of the global cap (`overload_cap`), so one sender can never take every slot;
        an honest driver keeps `--max-inflight` trips in flight (default 4, an eighth of it for a
        2-stage run and less for longer ones), and an honest relay only carries more when this peer
        is near its global cap anyway. Rate: a sender refills a slot only when we answered, so honest
        trips arrive no faster than we complete them (plus a few quick retries after refusals); the
        bucket allows 4× our measured rate, at least 20 trips/s, in bursts of twice the in-flight cap.
        The rate is set once the stage's throughput is measured (`serve`)."""
        cap = max(self.overload_cap // 2, 1)
        return SenderLimits(rate=20.0, burst=2.0 * cap, max_inflight=cap)

    @property
    def overload_cap(self) -> int:
        return 4 * max(self.options.max_inflight, 1) * self.manifest.num_stages

    # --- identity and logging -------------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        return str(self.dht.peer_id)

    @property
    def label(self) -> str:
        name = self.options.public_name or self.peer_id[-6:]
        return f"[{name} stage {self.index if self.index is not None else '?'}]"

    # --- start-up ---------------------------------------------------------------------------------

    def start_dht(self) -> None:
        """Join the DHT. Records are signed with the libp2p identity key itself, so they are bound to this
        peer id (swarm.records); without --identity a fresh one is made for this run in a private
        temporary directory. The DHT's child process (and the p2pd it starts) inherit SIGINT and SIGTERM
        ignored: a signal to the whole process group reaches only this process, which then leaves
        in order and stops them itself."""
        identity = self.options.identity
        kwargs: dict = dict(
            start=True,
            host_maddrs=self.options.host_maddrs,
            initial_peers=self.options.initial_peers,
        )
        if identity is None:
            import tempfile

            self._temp_identity = Path(tempfile.mkdtemp(prefix="protocol-peer-id-"))
            identity = str(self._temp_identity / "identity")
        if not os.path.exists(identity):
            Path(identity).parent.mkdir(parents=True, exist_ok=True)
            P2P.generate_identity(identity)
            kwargs["check_if_identity_free"] = False  # made just now: nobody else can hold it
        self.signer, validators = make_validators(self.manifest, load_identity_key(identity))
        kwargs["record_validators"] = validators
        kwargs["identity_path"] = identity
        if self.options.announce_maddrs:
            kwargs["announce_maddrs"] = self.options.announce_maddrs
        with stop_signals_ignored_by_children():
            self.dht = DHT(**kwargs)

    async def _fetch(self) -> dict:
        return await asyncio.to_thread(fetch_stages, self.dht, self.manifest)

    def _online_loads(self, stages: dict, t_fixed: str) -> dict[int, list[float]]:
        """Claimed throughputs of other online peers per stage, each clamped to the stage's plausible bound."""
        return {
            stage: [
                claimed_throughput(e.record, self.manifest)
                for e in entries
                if e.record.state == "online"
                and e.record.t_fixed_sha256 == t_fixed
                and e.record.peer_id != self.peer_id
            ]
            for stage, entries in stages.items()
        }

    async def pick_stage(self) -> int:
        if self.options.stage != "auto":
            return int(self.options.stage)
        await asyncio.sleep(self.rng.uniform(0, self.options.placement_delay))  # against a herd of newcomers
        stages = await self._fetch()
        loads = self._online_loads(stages, self.manifest.t_fixed_sha256)
        stage = choose_stage(loads, self.manifest.num_stages, self.rng)
        logger.info(
            "%s placement: stage totals %s -> stage %d",
            self.label,
            {s: round(sum(v), 1) for s, v in loads.items()},
            stage,
        )
        return stage

    # --- the trip service -------------------------------------------------------------------------

    async def handle_trip(self, blob: bytes, remote: PeerID) -> bytes:
        self.stats.bytes_in += len(blob)
        sender = remote.to_base58()
        reply = await self._admit(sender)
        if reply is None:
            try:
                reply = await self._serve_trip(blob, sender)
            finally:
                self.sender_limits.release(sender)
        self.stats.bytes_out += len(reply)
        return reply

    def _refuse(self, sender: str, code: ErrorCode, message: str, hops: int = 0) -> bytes:
        """Count a refusal and note it for the aggregated log line; the reply to send back."""
        self.stats.error(code)
        if hops == 0:  # refusals relayed from further down are the next hop's, logged there
            self.refusal_log.note(sender, code.value)
        return encode_error(code, message, hops)

    def _upstream(self) -> set[str]:
        """Peer ids with a live record of this run for the stage before ours (for stage 1: the drivers)."""
        router, now = self.router, get_dht_time()
        if router is None or not self.index:
            return set()
        return {e.record.peer_id for e in router.stages.get(self.index - 1, []) if e.expiration > now}

    def admit_stream(self, peer: PeerID) -> ErrorCode | None:
        """The transport asks this before reading a stream: a sender that is not upstream of us is refused
        at once, unless a DHT re-read is due (then `handle_trip` reads the message and checks again after
        re-reading, so a peer that joined a moment ago is served). Everything else is decided there."""
        if self.router is None or not self.index or self.state != "online":
            return None
        if peer.to_base58() in self._upstream():
            return None
        if time.monotonic() - self._sender_refresh_at >= SENDER_REFRESH_INTERVAL:
            return None
        return ErrorCode.UNKNOWN_SENDER

    async def _admit(self, sender: str) -> bytes | None:
        """None if `sender` may send us a trip now (its slot then taken), else the refusal. Nothing of the
        message is read before this: an unknown sender costs a set lookup and, at most once per
        SENDER_REFRESH_INTERVAL for all of them together, a DHT read (so an honest peer that joined
        seconds ago is refused at most until that read)."""
        runtime = self.runtime
        if runtime is None or self.state != "online":
            return self._refuse(sender, ErrorCode.LEAVING, f"peer is {self.state}, not serving")
        if runtime.stage.is_head:
            return self._refuse(sender, ErrorCode.WRONG_STAGE, "stage 0 drives trips and accepts none")
        if sender not in self._upstream():
            if self._sender_refresh_lock is None:
                self._sender_refresh_lock = asyncio.Lock()
            async with self._sender_refresh_lock:
                if time.monotonic() - self._sender_refresh_at >= SENDER_REFRESH_INTERVAL and self.router is not None:
                    self._sender_refresh_at = time.monotonic()
                    try:
                        self.router.update(await asyncio.wait_for(self._fetch(), 5.0))
                    except Exception as exc:  # noqa: BLE001 - refuse now; the next miss reads again
                        logger.warning("%s could not read the DHT for a sender check: %s", self.label, exc)
            if sender not in self._upstream():
                return self._refuse(
                    sender, ErrorCode.UNKNOWN_SENDER, f"no live record of stage {self.index - 1} for this peer id"
                )
        why = self.sender_limits.admit(sender, time.monotonic())
        if why is not None:
            return self._refuse(sender, ErrorCode.OVERLOADED, why)
        return None

    async def _serve_trip(self, blob: bytes, sender: str) -> bytes:
        runtime = self.runtime
        if runtime is None or self.state != "online":  # it may have changed while the sender was checked
            return self._refuse(sender, ErrorCode.LEAVING, f"peer is {self.state}, not serving")
        if self.load >= self.overload_cap:
            return self._refuse(sender, ErrorCode.OVERLOADED, f"{self.load} trips in flight")
        try:
            header, hidden, tokens = runtime.codec.decode_forward(blob, stage=self.index)
        except WireError as exc:
            return self._refuse(sender, exc.code, exc.message)
        self.load += 1
        try:
            version = header.u_version  # decode checked it against ours; every later step re-checks
            leaf, output, residual = await runtime.run(runtime.forward, hidden, tokens, version)
            batch = tokens.shape[0]
            if runtime.stage.is_tail:
                grad, loss = await runtime.run(runtime.backward, leaf, output, None, tokens, batch, None, version)
                versions = [version]
            else:
                message = await runtime.run(
                    runtime.encode_forward, version, output, tokens, header.trip_id, self.index + 1
                )
                reply_header, grad_in, downstream = await self.forward_to_next(message, self.backward_checker(runtime))
                versions = downstream + [version]
                loss = reply_header.loss
                grad, _ = await runtime.run(runtime.backward, leaf, output, grad_in, tokens, batch, residual, version)
            self.stats.trips += 1
            self.stats.tokens += tokens.numel()
            return runtime.codec.encode_backward(
                grad, header.trip_id, to_stage=self.index - 1, loss=loss, extra={"versions": versions}
            )
        except WireError as exc:
            return self._refuse(sender, exc.code, exc.message, exc.hops)
        except Exception as exc:  # noqa: BLE001 - a trip must never take the peer down
            logger.exception("%s trip %s failed", self.label, header.trip_id[:8])
            self.stats.error(ErrorCode.INTERNAL)
            return encode_error(ErrorCode.INTERNAL, f"{type(exc).__name__}")
        finally:
            self.load -= 1

    @property
    def tokens_per_trip(self) -> int:
        return self.manifest.batch.microbatch_size * self.manifest.batch.seq_len

    def hop_timeout(self) -> float:
        """Time for the rest of the pipeline: a hop waits longer than the hop after it, so a stall far
        downstream is blamed on the stalled peer, not on the honest peers between."""
        return self.options.trip_timeout * max(self.manifest.num_stages - 1 - self.index, 1)

    async def forward_to_next(self, message: bytes, check_reply: Callable[[bytes], T]) -> T:
        """Send to the best peer of the next stage and check its reply; on failure ban that peer and
        try another. `check_reply` decodes and validates the reply, so a peer that answers garbage
        is the one banned, not us upstream."""
        target = self.index + 1
        router = self.router  # a stage move replaces the router; this trip keeps its own
        expect = expectation_for(self.manifest, self.index, "backward", 0, "")
        failures: dict[str, int] = {}
        for tried in range(1, 9):
            candidates = router.candidates(target)
            if not candidates:
                router.update(await self._fetch())
                candidates = router.candidates(target)
            if not candidates:
                raise WireError(ErrorCode.NO_PEER, f"stage {target} has no live compatible peer")
            peer_id = candidates[0].record.peer_id
            router.inflight[peer_id] = router.inflight.get(peer_id, 0) + 1
            started = time.monotonic()
            try:
                reply = await send_trip(
                    self.p2p,
                    PeerID.from_base58(peer_id),
                    self.manifest.run_id,
                    message,
                    timeout=self.hop_timeout(),
                    max_reply=expect.max_bytes,
                )
                raise_if_error(reply)
                try:
                    checked = check_reply(reply)
                except WireError as exc:  # the next hop's reply is at fault: upstream must not blame us
                    raise WireError(exc.code, exc.message, hops=1) from None
                # what we measured of it, not what it claims, decides how many trips it gets (routing)
                router.observe(peer_id, time.monotonic() - started, self.tokens_per_trip)
                router.forgive(peer_id)
                return checked
            except WireError as exc:
                self.stats.error(exc.code)
                if exc.code in (ErrorCode.NO_PEER, ErrorCode.WRONG_VERSION):
                    # the stage behind it is empty, or U is switching: the driver retries the trip.
                    # A next hop that keeps its own U apart from ours for long is banned, unless it is
                    # the stage's only peer; refusals it relays from further down do not count
                    stuck = exc.code == ErrorCode.WRONG_VERSION and exc.hops == 1 and len(candidates) > 1
                    if stuck and (seconds := router.refused(peer_id)):
                        logger.warning(
                            "%s next hop %s kept refusing trips for our U version; banned %.0fs",
                            self.label,
                            peer_id[-6:],
                            seconds,
                        )
                    raise
                failures[peer_id] = failures.get(peer_id, 0) + 1
                if len(candidates) == 1 and failures[peer_id] < 3:
                    # the stage's only peer: a transient failure (a stream reset at first contact)
                    # should not empty the stage for a whole ban period; try it again shortly
                    logger.warning(
                        "%s next hop %s failed (%s); retrying it (attempt %d)", self.label, peer_id[-6:], exc, tried
                    )
                    await asyncio.sleep(0.2 * failures[peer_id])
                    continue
                router.failed(peer_id)
                seconds = router.ban(peer_id)
                logger.warning(
                    "%s next hop %s failed (%s); banned %.0fs, failing over (attempt %d)",
                    self.label,
                    peer_id[-6:],
                    exc,
                    seconds,
                    tried,
                )
            finally:
                router.inflight[peer_id] -= 1
                if router.inflight[peer_id] <= 0:
                    del router.inflight[peer_id]
        raise WireError(ErrorCode.NO_PEER, f"no peer of stage {target} answered after 8 attempts")

    def backward_checker(self, runtime: StageRuntime) -> Callable[[bytes], tuple]:
        """Decode a backward reply and its hop-version audit (raises WireError on anything off)."""

        def check(reply: bytes) -> tuple:
            header, grad = runtime.codec.decode_backward(reply, stage=self.index)
            check_loss(header.loss, self.manifest)
            return header, grad, hop_versions(header.extra, self.manifest.num_stages)

        return check

    # --- announcing, routing and rebalancing --------------------------------------------------------

    def record(self) -> StagePeerRecord:
        runtime = self.runtime
        subspace = runtime.stage.subspace
        losses = self.stats.losses
        loss = sum(losses) / len(losses) if losses else self.stats.last_loss
        self.stats.last_loss, self.stats.losses = loss, []
        return StagePeerRecord(
            peer_id=self.peer_id,
            state=self.state,
            stage=self.index,
            throughput=float(self.throughput),
            load=self.load,
            u_version=subspace.version,
            u_sha256=subspace.basis_sha256,
            t_fixed_sha256=subspace.t_fixed_sha256,
            software_version=SOFTWARE_VERSION,
            public_name=self.options.public_name[:64],
            addrs=[str(a) for a in self.dht.get_visible_maddrs()][:8],
            trips=self.stats.trips,
            tokens=self.stats.tokens,
            bytes_in=self.stats.bytes_in,
            bytes_out=self.stats.bytes_out,
            errors=sum(self.stats.errors.values()),
            loss=None if loss is None else float(loss),
            optimizer_epoch=runtime.epoch,
            state_sha256=runtime.state_sha256,
            state_hashes=list(runtime.state_hashes),
            loaded_state=runtime.loaded_state,
            trip_versions=[f"{v}:{n}" for v, n in sorted(self.stats.trip_versions.items())][-16:],
            mixed_trips=self.stats.mixed_trips,
        )

    async def announce_now(self, timeout: float | None = None) -> None:
        record = self.record()
        try:
            await asyncio.wait_for(
                asyncio.to_thread(announce, self.dht, self.manifest, self.signer, record), timeout=timeout
            )
        except Exception as exc:  # noqa: BLE001 - the DHT may be briefly unreachable; retry next round
            logger.warning("%s announce failed: %s", self.label, exc or type(exc).__name__)

    async def announce_loop(self) -> None:
        while True:
            await self.announce_now()
            await asyncio.sleep(ANNOUNCE_INTERVAL)

    async def refresh_loop(self) -> None:
        while True:
            try:
                self.router.update(await self._fetch())
            except Exception as exc:  # noqa: BLE001
                logger.warning("%s could not read the DHT: %s", self.label, exc)
            await asyncio.sleep(3.0)

    async def rebalance_loop(self) -> None:
        while True:
            await asyncio.sleep(self.options.rebalance_interval * self.rng.uniform(0.8, 1.2))
            try:
                stages = await self._fetch()
            except Exception as exc:  # noqa: BLE001 - try again next round
                logger.warning("%s could not read the DHT for rebalancing: %s", self.label, exc)
                continue
            loads = self._online_loads(stages, self.runtime.stage.subspace.t_fixed_sha256)
            loads.setdefault(self.index, []).append(self.throughput)
            target = should_move(loads, self.manifest.num_stages, self.index, self.throughput)
            if target is not None:
                logger.info("%s rebalancing: moving to stage %d", self.label, target)
                raise StageMove(target)

    async def log_loop(self) -> None:
        last_tokens, last_time = self.stats.tokens, time.monotonic()
        while True:
            await asyncio.sleep(self.options.log_interval)
            now, tokens = time.monotonic(), self.stats.tokens
            rate = (tokens - last_tokens) / max(now - last_time, 1e-9)
            per_token = (self.stats.bytes_in + self.stats.bytes_out) / max(tokens, 1)
            loss = f"{self.stats.last_loss:.3f}" if self.stats.last_loss is not None else "-"
            logger.info(
                "%s %.0f tokens/s, loss %s, %.1f wire bytes/token, epoch %d, trips %d, in flight %d, errors %s",
                self.label,
                rate,
                loss,
                per_token,
                self.runtime.epoch,
                self.stats.trips,
                self.load,
                dict(self.stats.errors) or 0,
            )
            for line in self.refusal_log.flush(now):
                logger.warning("%s %s", self.label, line)
            last_tokens, last_time = tokens, now

    # --- serving one stage -------------------------------------------------------------------------

    async def serve(self, index: int) -> int | None:
        """Serve `index` until stopped (returns None) or a rebalance says move (returns the target)."""
        self.index, self.state = index, "joining"
        device = pick_device(self.options.device)
        with stop_signals_ignored_by_children():  # hivemind's averagers are child processes
            runtime = StageRuntime(
                self.manifest,
                index,
                self.dht,
                device,
                self.label,
                self.options.checkpoint_dir,
                self.options.fault_t_fixed_seed,
                checkpoint_every=self.options.checkpoint_every,
            )
        self.runtime = runtime
        subspace = runtime.stage.subspace
        bounds = {s: plausible_throughput(self.manifest, s) for s in range(self.manifest.num_stages)}
        self.router = Router(subspace.t_fixed_sha256, self.peer_id, claim_bounds=bounds)
        self.throughput = await runtime.run(runtime.measure_throughput)
        self.sender_limits.rate = max(20.0, 4.0 * self.throughput / self.tokens_per_trip)
        await self.announce_now()
        stages = await self._fetch()
        peers_here = [
            e
            for e in stages.get(index, [])
            if e.record.peer_id != self.peer_id
            and e.record.state == "online"
            and e.record.t_fixed_sha256 == subspace.t_fixed_sha256
        ]
        sync = None
        if self.manifest.subspace_update_interval and self.manifest.compression != "none":
            from peer.subspace_sync import SubspaceSync

            sync = SubspaceSync(self)
            self.router.update(stages)
            await sync.catch_up()  # before loading state: donors' tensors live in the current span(U)
        if peers_here:
            loaded = await runtime.run(runtime.load_from_peers)
            logger.info(
                "%s %s state from %d peer(s) of the stage (epoch %d)",
                self.label,
                "loaded" if loaded else "could not load",
                len(peers_here),
                runtime.epoch,
            )
        elif not await runtime.run(runtime.load_checkpoint):
            logger.info("%s starting stage %d from the seed", self.label, index)
        self.router.update(stages)
        self.state = "online"
        await self.announce_now()
        logger.info(
            "%s online: %.0f tokens/s measured, layers %s",
            self.label,
            self.throughput,
            list(self.manifest.layers_of(index)),
        )
        tasks = [asyncio.create_task(coro) for coro in (self.announce_loop(), self.refresh_loop(), self.log_loop())]
        if self.options.stage == "auto":
            tasks.append(asyncio.create_task(self.rebalance_loop()))
        if sync is not None:
            tasks.append(asyncio.create_task(sync.run()))
        driver = None
        if runtime.stage.is_head:
            from peer.driver import Driver

            driver = Driver(self)
            tasks.append(asyncio.create_task(driver.run()))
        stop = asyncio.create_task(self.stopping.wait())
        target = None
        try:
            done, _ = await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stop and task.exception() is not None:
                    if isinstance(task.exception(), StageMove):
                        target = task.exception().target
                    else:
                        raise task.exception()
        finally:
            await self.leave(tasks + [stop], driver)
        return target

    async def leave(self, tasks: list[asyncio.Task], driver) -> None:
        """Announce LEAVING, stop driving, let trips in flight finish, checkpoint, release the stage."""
        self.state = "leaving"
        if driver is not None:
            driver.stop()
        await self.announce_now(timeout=LEAVE_DHT_TIMEOUT)  # p2pd may be gone already (a group SIGTERM)
        drain = self.options.drain_timeout
        if self._stop_signals:
            drain = min(drain, SIGNAL_DRAIN_TIMEOUT)
        deadline = time.monotonic() + drain
        while (self.load > 0 or (driver is not None and driver.inflight > 0)) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        runtime, self.runtime = self.runtime, None
        if runtime is not None:
            await runtime.run(runtime.save_checkpoint)  # queued behind any backward still running
            runtime.shutdown()
        logger.info(
            "%s left the stage (trips %d, tokens %d, errors %s)",
            self.label,
            self.stats.trips,
            self.stats.tokens,
            dict(self.stats.errors) or 0,
        )

    async def heartbeat_loop(self) -> None:
        """Proof of life for container health checks: rewritten atomically while the event loop runs."""
        path = Path(self.options.heartbeat_file)
        while True:
            payload = {"time": time.time(), "state": self.state, "stage": self.index, "peer_id": self.peer_id}
            tmp = path.with_suffix(path.suffix + ".tmp")
            try:
                tmp.write_text(json.dumps(payload))
                os.replace(tmp, path)
            except OSError as exc:
                logger.warning("%s cannot write heartbeat %s: %s", self.label, path, exc)
            await asyncio.sleep(min(self.options.log_interval, 30.0))

    async def main(self) -> None:
        loop = asyncio.get_running_loop()
        heartbeat = asyncio.create_task(self.heartbeat_loop()) if self.options.heartbeat_file else None
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_stop_signal, sig)
        self.p2p = await self.dht.replicate_p2p()
        hooks = inspect.signature(TripServicer).parameters
        extra = {}
        if "admit" in hooks:  # refuse known strangers before a byte of their stream is read
            extra["admit"] = self.admit_stream
        if "on_refused_from" in hooks:
            extra["on_refused_from"] = lambda code, peer: self.refusal_log.note(peer.to_base58(), code.value)
        servicer = TripServicer(
            self.handle_trip,
            max_bytes=expectation_for(self.manifest, 0, "forward", 0, "").max_bytes,
            on_refused=self.stats.error,
            **extra,
        )
        await servicer.add_p2p_handlers(self.p2p, namespace=self.manifest.run_id)
        logger.info(
            "peer %s joined run %s; visible at %s",
            self.peer_id,
            self.manifest.run_id,
            " ".join(str(a) for a in self.dht.get_visible_maddrs()),
        )
        try:
            index = await self.pick_stage_or_stop()
            while index is not None and not self.stopping.is_set():
                index = await self.serve(index)
        finally:
            if heartbeat is not None:
                heartbeat.cancel()
            await asyncio.to_thread(self.stop_processes)

    async def pick_stage_or_stop(self) -> int | None:
        pick = asyncio.create_task(self.pick_stage())
        stop = asyncio.create_task(self.stopping.wait())
        await asyncio.wait([pick, stop], return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not pick.done():
            pick.cancel()
            return None
        return pick.result()

    def _on_stop_signal(self, sig: int) -> None:
        """First SIGINT/SIGTERM: leave in order. A second SIGINT (not an echo of the first through a child,
        hence the half second) or a third signal of any kind: exit now."""
        now = time.monotonic()
        if not self.stopping.is_set():
            self._stop_signals = [now]
            logger.info(
                "%s %s: leaving the stage (checkpoint, then exit); Ctrl-C again to exit at once",
                self.label,
                signal.Signals(sig).name,
            )
            self.stopping.set()
            return
        self._stop_signals.append(now)
        if (sig == signal.SIGINT and now - self._stop_signals[0] > 0.5) or len(self._stop_signals) >= 3:
            logger.warning("%s %s again: exiting now, without leaving in order", self.label, signal.Signals(sig).name)
            logging.shutdown()
            kill_descendants()
            os._exit(130)

    def stop_processes(self) -> None:
        """Stop the DHT (and with it p2pd) and anything else still running below us; the exit cannot hang
        on a child that ignores the stop signals."""
        self.dht.shutdown_timeout = 3.0
        with contextlib.suppress(Exception):
            self.dht.shutdown()  # it ignores SIGTERM: if it did not stop in time, it is killed below
        kill_descendants()
        with contextlib.suppress(Exception):
            self.dht.join(2.0)
        for child in multiprocessing.active_children():  # reaps what was killed
            child.join(0.5)
        if self._temp_identity is not None:
            import shutil

            shutil.rmtree(self._temp_identity, ignore_errors=True)
