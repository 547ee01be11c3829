"""Attacks on a live swarm, one after another, and what each costs the honest peers (issue 12).

A real swarm of `protocol-peer` processes on loopback (2 stages × 1 peer: a driver and the peer
under attack, stage 1) trains while an attacker — its own hivemind identity, DHT node and P2P
in this process — tries, in turn: hijacking stage 1 with a record that claims 1e12 tokens/s and
answers zero gradients with a fake loss; a record that names the honest peer's id; well-formed
trips from an identity with no record; poison values (a stage-0 record, then trips whose
activations are finite but huge); slowloris; an empty-chunk flood; a 256 MB frame; garbage
frames; and a mixed fuzz of 10,000 mutated trips. Per attack it reports the codes the attacker
got back, the driver's tokens/s during the attack as a ratio to the quiet window before it, the
attacked peer's RSS (and peak) before and after, and the bytes its log grew by.

    python -m benchmarks.attacks [--compression none] [--seconds 30] [--fuzz 10000] [--only WORD ...] [--json OUT]

The table it prints is the one in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import torch
from hivemind.dht import DHT
from hivemind.p2p import P2P, PeerID
from hivemind.utils.timed_storage import get_dht_time

from benchmarks import attack_clients as raw
from dhtio.identity import load_identity_key
from dhtio.records import announce, fetch_stages
from dhtio.validators import make_validators
from launcher.supervisor import LocalSwarm
from peer.transport import TripServicer, send_trip
from swarm.codec import BoundaryCodec
from swarm.manifest import Manifest
from swarm.model import PipelineStage
from swarm.presets import preset
from swarm.records import SOFTWARE_VERSION, StagePeerRecord
from swarm.wire import WireError, encode, raise_if_error

FAKE_LOSS = 0.0123


def _code(reply: bytes) -> str:
    try:
        raise_if_error(reply)
    except WireError as exc:
        return exc.code.value
    return "accepted"


def progress_epoch(dht: DHT, manifest: Manifest, stage: int) -> int:
    """The epoch a liar claims for its replies, so that the drivers' audits compare them (peer/audit.py
    AUDIT_MAX_LAG): the stage's epoch now, estimated from the optimizer progress records its peers publish in
    the DHT (hivemind's progress tracker: epoch, samples, rate, time) as hivemind's tracker estimates it. A lone
    peer publishes seldom, so the newest record's epoch alone lags tens of epochs in a stage of short epochs."""
    found = dht.get(f"{manifest.optimizer_run_id(stage)}_progress", latest=True)
    entries = found.value.values() if found is not None and isinstance(found.value, dict) else []
    reports = [entry.value for entry in entries if isinstance(entry.value, dict)]
    target, now = manifest.batch.target_batch_size * manifest.lanes, get_dht_time()
    estimates = [
        report["epoch"] + int((report["samples_accumulated"] + report["samples_per_second"] * max(now - report["time"],
                                                                                                   0.0)) // target)
        for report in reports
        if all(isinstance(report.get(key), (int, float)) for key in
               ("epoch", "samples_accumulated", "samples_per_second", "time"))
    ]
    return max(estimates, default=0)


class Attacker:
    """A hostile volunteer: its own identity, a DHT node that signs its records, a P2P for streams."""

    def __init__(self, swarm: LocalSwarm, workdir: Path):
        self.manifest = swarm.manifest
        identity = workdir / f"attacker-{uuid.uuid4().hex[:6]}.id"
        P2P.generate_identity(str(identity))
        self.signer, validators = make_validators(self.manifest, load_identity_key(identity))
        self.dht = DHT(
            start=True,
            initial_peers=swarm.bootstrap,
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            identity_path=str(identity),
            record_validators=validators,
        )
        self.p2p: P2P | None = None
        self.stages = [PipelineStage(self.manifest, i) for i in range(self.manifest.num_stages)]
        self.codecs = [BoundaryCodec(self.manifest, stage.subspace) for stage in self.stages]

    @property
    def peer_id(self) -> str:
        return str(self.dht.peer_id)

    async def start(self) -> None:
        self.p2p = await self.dht.replicate_p2p()

    def record(self, stage: int, throughput: float, peer_id: str | None = None) -> StagePeerRecord:
        subspace = self.stages[stage].subspace
        return StagePeerRecord(
            peer_id=peer_id or self.peer_id, state="online", stage=stage, throughput=float(throughput), load=0,
            u_version=subspace.version, u_sha256=subspace.basis_sha256, t_fixed_sha256=subspace.t_fixed_sha256,
            software_version=SOFTWARE_VERSION, public_name="attacker", addrs=[], trips=0, tokens=0, bytes_in=0,
            bytes_out=0, errors=0, loss=None, optimizer_epoch=0,
        )

    async def announce(self, record: StagePeerRecord) -> bool:
        return await asyncio.to_thread(announce, self.dht, self.manifest, self.signer, record)

    def forward_message(self, scale: float | None = None) -> bytes:
        """A well-formed trip for stage 1, computed by a real stage 0; `scale` replaces its payload by a
        finite but huge value, encoded past the sender-side range check as a hostile peer would."""
        batch = self.manifest.batch
        tokens = torch.randint(0, self.manifest.model.vocab_size, (batch.microbatch_size, batch.seq_len))
        codec, trip = self.codecs[0], uuid.uuid4().hex
        with torch.no_grad():
            hidden, _ = self.stages[0].forward_with_residual(None, tokens)
        if scale is None:
            return codec.encode_forward(hidden, tokens, trip, to_stage=1)
        width = self.manifest.k if codec.compressed else self.manifest.model.d_model
        payload = torch.zeros(tokens.shape[0], tokens.shape[1], width)
        payload[0, 0, 0] = scale
        header = codec._header(trip, 1, "forward", payload.shape, True)
        return encode(header, payload, tokens, self.manifest.model.vocab_size)

    async def send(self, target: str, message: bytes, timeout: float = 30.0) -> str:
        try:
            reply = await send_trip(self.p2p, PeerID.from_base58(target), self.manifest.run_id, message, timeout,
                                    1 << 24)
        except WireError as exc:
            return exc.code.value
        return _code(reply)

    async def serve_fake_gradients(self) -> Counter:
        """Answer every trip with a zero gradient and FAKE_LOSS, as a hijacker would, claiming stage 1's epoch
        (`progress_epoch`, read every 0.5 s)."""
        served: Counter = Counter()
        codec = self.codecs[1]
        claimed = {"epoch": 0, "read": -float("inf")}

        async def stage_epoch() -> int:
            if time.monotonic() - claimed["read"] > 0.5:
                claimed["read"] = time.monotonic()
                claimed["epoch"] = await asyncio.to_thread(progress_epoch, self.dht, self.manifest, 1)
            return claimed["epoch"]

        async def on_trip(blob: bytes, remote: PeerID) -> bytes:
            served["trips"] += 1
            header, hidden, _ = codec.decode_forward(blob, stage=1)
            extra = {"versions": [header.u_version], "epochs": [await stage_epoch()]}
            return codec.encode_backward(torch.zeros_like(hidden), header.trip_id, to_stage=0, loss=FAKE_LOSS,
                                         extra=extra)

        await TripServicer(on_trip, max_bytes=1 << 24).add_p2p_handlers(self.p2p, namespace=self.manifest.run_id)
        return served

    def shutdown(self) -> None:
        self.dht.shutdown()


class Observer:
    """The attacked peer's process and log, and the driver's token counter, read from outside."""

    def __init__(self, swarm: LocalSwarm):
        self.swarm = swarm
        self.target = next(c for c in swarm.children if c.name == "stage1-peer0")
        self.pid = self.target.process.pid

    def records(self) -> dict:
        return {e.record.public_name: e.record for es in fetch_stages(self.swarm.dht, self.swarm.manifest).values()
                for e in es}

    def target_id(self) -> str:
        return self.records()["stage1-peer0"].peer_id

    def memory_mb(self) -> tuple[float, float]:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{self.pid}/status").read_text().splitlines())
        return int(status["VmRSS"].split()[0]) / 1024, int(status["VmHWM"].split()[0]) / 1024

    def log_bytes(self) -> int:
        return self.target.log.stat().st_size

    async def watch(self, seconds: float, losses: list) -> dict:
        """Driver tokens/s over `seconds` (from the first to the last change of its record), and trips per peer."""
        marks, trips_first, trips_last = [], None, None
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            records = await asyncio.to_thread(self.records)
            driver = records.get("stage0-peer0")
            if driver is not None:
                if not marks or driver.tokens != marks[-1][1]:
                    marks.append((time.monotonic(), driver.tokens))
                if driver.loss is not None:
                    losses.append(driver.loss)
                honest = records.get("stage1-peer0")
                counts = (driver.trips, honest.trips if honest else 0)
                trips_first = trips_first or counts
                trips_last = counts
            await asyncio.sleep(0.5)
        rate = (marks[-1][1] - marks[0][1]) / max(marks[-1][0] - marks[0][0], 1e-9) if len(marks) > 1 else 0.0
        driver_trips = (trips_last[0] - trips_first[0]) if trips_first else 0
        honest_trips = (trips_last[1] - trips_first[1]) if trips_first else 0
        return {"tokens_per_s": rate, "driver_trips": driver_trips, "honest_trips": honest_trips}


async def _during(observer: Observer, seconds: float, attack) -> tuple[dict, object]:
    losses: list = []
    task = asyncio.create_task(attack())
    watched = await observer.watch(seconds, losses)
    try:
        result = await asyncio.wait_for(task, timeout=max(5.0, seconds))
    except asyncio.TimeoutError:
        result = "still running when the window closed"
    watched["fake_loss_published"] = any(abs(v - FAKE_LOSS) < 1e-6 for v in losses)
    return watched, result


async def _repeat(fn, seconds: float) -> Counter:
    codes: Counter = Counter()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        codes[await fn()] += 1
    return codes


async def run_attacks(args: argparse.Namespace, swarm: LocalSwarm, workdir: Path) -> list[dict]:
    observer = Observer(swarm)
    target = observer.target_id()
    handle = f"{swarm.manifest.run_id}::TripServicer.rpc_trip"  # the trip handler's stream protocol
    rows = []
    window = args.seconds

    async def cell(name: str, make_attack, seconds: float = window) -> None:
        if args.only and not any(word in name for word in args.only):
            return
        quiet, _ = await _during(observer, min(seconds, 20.0), lambda: asyncio.sleep(0))
        rss0, peak0 = observer.memory_mb()
        log0 = observer.log_bytes()
        started = time.monotonic()
        watched, result = await _during(observer, seconds, make_attack)
        rss1, peak1 = observer.memory_mb()
        row = {
            "attack": name,
            "result": result if isinstance(result, (dict, str)) else dict(result),
            "tokens_per_s_quiet": round(quiet["tokens_per_s"], 1),
            "tokens_per_s_attack": round(watched["tokens_per_s"], 1),
            "throughput_ratio": round(watched["tokens_per_s"] / max(quiet["tokens_per_s"], 1e-9), 3),
            "honest_share_of_driver_trips": round(watched["honest_trips"] / max(watched["driver_trips"], 1), 3),
            "fake_loss_published": watched["fake_loss_published"],
            "rss_mb": [round(rss0, 1), round(rss1, 1)],
            "peak_rss_increase_mb": round(peak1 - peak0, 1),
            "log_bytes": observer.log_bytes() - log0,
            "seconds": round(time.monotonic() - started, 1),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)

    stranger = Attacker(swarm, workdir)
    await stranger.start()
    async def impersonate():
        stored = await stranger.announce(stranger.record(1, 1e12, peer_id=target))
        return {"record_stored": stored}

    await cell("record naming the honest peer's id", impersonate)

    await cell("unknown sender", lambda: _repeat(lambda: stranger.send(target, stranger.forward_message()), window))

    insider = Attacker(swarm, workdir)
    await insider.start()

    async def insider_keeps_announcing() -> None:  # a live stage-0 record: the target admits its streams
        while True:
            await insider.announce(insider.record(0, 100.0))
            await asyncio.sleep(5)

    insider_announcing = asyncio.create_task(insider_keeps_announcing())
    await asyncio.sleep(6)  # the target refreshes its view of the DHT

    async def poison():
        codes: Counter = Counter()
        for scale in (3.3e38, 1e30, 1e12, 1e6):
            codes[f"{scale:g}: " + await insider.send(target, insider.forward_message(scale))] += 1
        return codes

    await cell("poison values (stage-0 record)", poison, 15.0)

    async def slowloris():
        held = await raw.slowloris(insider.p2p, PeerID.from_base58(target), streams=20, handle=handle)
        replies = await asyncio.gather(*(raw.read_until_closed(r, window) for r, _ in held))
        for _, writer in held:
            writer.close()
        return Counter(raw.reply_text(r)[:60] or "closed" for r in replies)

    await cell("slowloris (20 streams)", slowloris)
    victim = PeerID.from_base58(target)
    await cell("empty-chunk flood", lambda: raw.empty_chunk_flood(insider.p2p, victim, 100_000, handle=handle))
    await cell("256 MB frame", lambda: raw.oversized_frame(insider.p2p, victim, 256 << 20, handle=handle))

    async def garbage():
        return {name: (await raw.garbage(insider.p2p, PeerID.from_base58(target), blob, handle))[:60]
                for name, blob in raw.GARBAGE.items()}

    await cell("garbage frames", garbage, 15.0)

    async def fuzz():
        rng, codes = random.Random(0), Counter()
        base = insider.forward_message()
        # made once: a forward pass per trip would block this event loop (and the observer) for minutes
        poisoned = [insider.forward_message(v) for v in (float("inf"), float("nan"), 1e38, -1e20)]
        semaphore = asyncio.Semaphore(16)

        async def one() -> None:
            message = bytearray(base)
            kind = rng.randrange(4)
            if kind == 0:
                for _ in range(rng.randint(1, 8)):
                    message[rng.randrange(len(message))] = rng.randrange(256)
            elif kind == 1:
                message = message[: rng.randrange(len(message))]
            elif kind == 2:
                message += os.urandom(rng.randint(1, 4096))
            else:
                message = bytearray(rng.choice(poisoned))
            async with semaphore:
                codes[await insider.send(target, bytes(message), timeout=30)] += 1

        await asyncio.gather(*(one() for _ in range(args.fuzz)))
        return codes

    await cell(f"mixed fuzz ({args.fuzz} trips)", fuzz, window * 2)

    hijacker = Attacker(swarm, workdir)
    await hijacker.start()
    served = await hijacker.serve_fake_gradients()

    async def keep_announcing() -> None:
        while True:
            await hijacker.announce(hijacker.record(1, 1e12))
            await asyncio.sleep(5)

    announcing = asyncio.create_task(keep_announcing())
    await asyncio.sleep(20)  # the bar counts after the first minute of routing; give it a head start

    async def hijack():
        before = served["trips"]
        await asyncio.sleep(window * 2)
        return {"trips_drawn_by_attacker": served["trips"] - before}

    await cell("hijack by claimed throughput (1e12), fast fake answers", hijack, window * 2)
    announcing.cancel()

    insider_announcing.cancel()
    for attacker in (hijacker, stranger, insider):
        with contextlib.suppress(Exception):
            await attacker.p2p.shutdown()
        attacker.shutdown()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compression", default="none", choices=("none", "boundary", "subspace"))
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each attack window")
    parser.add_argument("--fuzz", type=int, default=10_000, help="mutated trips in the fuzz run")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--only", nargs="+", metavar="WORD", help="run only the attacks whose name has one of these")
    args = parser.parse_args()
    torch.set_num_threads(1)
    manifest = preset("tiny", stages=2, compression=args.compression)
    workdir = Path(tempfile.mkdtemp(prefix="protocol-attacks-"))
    peer_args = ["--log-interval", "5"]
    swarm = LocalSwarm(manifest, 1, workdir, max_inflight=2, with_tracker=False, extra_peer_args=peer_args)
    try:
        swarm.start()
        deadline = time.monotonic() + 180
        while not all(any(e.record.state == "online" for e in v) for v in swarm.poll().values()) or len(
            swarm.poll()
        ) < manifest.num_stages:
            swarm.check_children()
            if time.monotonic() > deadline:
                raise RuntimeError("the swarm did not come online")
            time.sleep(1)
        rows = asyncio.run(run_attacks(args, swarm, workdir))
        swarm.check_children()
    finally:
        swarm.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\n| attack ({args.compression}) | what the peer did | honest tok/s vs quiet | peer RSS MB before → after "
          "| peak RSS +MB | log bytes |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['attack']} | {json.dumps(row['result'])[:160]} | {row['throughput_ratio']:.2f} | "
              f"{row['rss_mb'][0]} → {row['rss_mb'][1]} | {row['peak_rss_increase_mb']} | {row['log_bytes']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
