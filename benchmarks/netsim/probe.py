"""Measurements run inside a netsim host's namespace: ICMP echo round trips and a bulk TCP transfer.

    ip netns exec H python -m benchmarks.netsim.probe ping 10.77.0.2 --count 20
    ip netns exec H python -m benchmarks.netsim.probe sink --port 5201 --skip 2
    ip netns exec H python -m benchmarks.netsim.probe send 10.77.0.2 --port 5201 --seconds 6

The machine has no `ping` or `iperf`, so these stand in for them, standard library only. Each prints one
JSON object. `ping` uses a raw ICMP socket (the peer's kernel answers, no server needed); `sink` counts
the bytes it receives after `--skip` seconds (TCP's slow start left out) and reports their rate.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import time


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def ping(address: str, count: int, interval: float, timeout: float) -> list[float | None]:
    """Round-trip times in ms, None for an echo that got no reply within `timeout` seconds."""
    ident = os.getpid() & 0xFFFF
    rtts: list[float | None] = []
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as sock:
        for seq in range(count):
            header = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
            payload = b"netsim-probe-pad" * 3
            packet = struct.pack("!BBHHH", 8, 0, _checksum(header + payload), ident, seq) + payload
            sent = time.perf_counter()
            sock.sendto(packet, (address, 0))
            rtt = None
            while rtt is None and (left := timeout - (time.perf_counter() - sent)) > 0:
                sock.settimeout(left)
                try:
                    reply = sock.recv(2048)
                except TimeoutError:
                    break
                ihl = (reply[0] & 0x0F) * 4
                kind, _, _, rid, rseq = struct.unpack("!BBHHH", reply[ihl:ihl + 8])
                if kind == 0 and rid == ident and rseq == seq:
                    rtt = (time.perf_counter() - sent) * 1e3
            rtts.append(rtt)
            time.sleep(max(interval - (time.perf_counter() - sent), 0.0))
    return rtts


def sink(port: int, skip: float) -> dict:
    """Accept one connection and count its bytes; the rate over [first byte + skip, end]."""
    with socket.create_server(("0.0.0.0", port)) as server:
        print(json.dumps({"listening": port}), flush=True)
        conn, _ = server.accept()
        with conn:
            total = counted = 0
            first = start = None
            end = time.perf_counter()
            while chunk := conn.recv(1 << 16):
                end = time.perf_counter()
                if first is None:
                    first = end
                total += len(chunk)
                if end - first >= skip:
                    if start is None:
                        start = end
                    else:
                        counted += len(chunk)
    window = end - start if start is not None else 0.0
    return {"bytes": total, "window_s": window, "mbit_s": 8e-6 * counted / window if window > 0 else 0.0}


def send(address: str, port: int, seconds: float) -> dict:
    block = b"\0" * (1 << 16)
    sent = 0
    with socket.create_connection((address, port), timeout=30) as conn:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            conn.sendall(block)
            sent += len(block)
    return {"bytes": sent}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ping")
    p.add_argument("address")
    p.add_argument("--count", type=int, default=10)
    p.add_argument("--interval", type=float, default=0.1)
    p.add_argument("--timeout", type=float, default=2.0)
    s = sub.add_parser("sink")
    s.add_argument("--port", type=int, default=5201)
    s.add_argument("--skip", type=float, default=2.0)
    t = sub.add_parser("send")
    t.add_argument("address")
    t.add_argument("--port", type=int, default=5201)
    t.add_argument("--seconds", type=float, default=6.0)
    args = parser.parse_args(argv)
    if args.command == "ping":
        result = {"rtt_ms": ping(args.address, args.count, args.interval, args.timeout)}
    elif args.command == "sink":
        result = sink(args.port, args.skip)
    else:
        result = send(args.address, args.port, args.seconds)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
