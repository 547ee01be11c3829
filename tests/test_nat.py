"""Reachability behind a home router (issue 15): the pure policy and classification, the dial-back helper's
bounds against a hostile requester, and (slow, root + iptables) a 3-stage swarm whose middle stage's only
peer sits behind an emulated NAT, with the driver behind a symmetric NAT of its own: "via relay" with no port
forward (and the stage-2 peer's trip relay counts the trips it carried), "direct" with one (the relay carries
none), "unreachable" with relays off."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pydantic.v1 as pydantic
import pytest
from builders import stage_record

from p2pio.budget import Budget
from peer.reachability import (
    DIRECT,
    GREETING,
    UNKNOWN,
    UNREACHABLE,
    VIA_RELAY,
    DialBackService,
    RateLimit,
    classify,
    greets,
    relay_options,
    relay_service_flags,
    tcp_targets,
)
from swarm.records import StagePeerRecord

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


def test_relay_policy():
    home = relay_options("auto", [], ["/ip4/0.0.0.0/tcp/0"], "192.168.1.20")
    assert home == {"use_auto_relay": True, "force_reachability": "private"}
    assert relay_options("auto", [], ["/ip4/0.0.0.0/tcp/0"], "8.8.4.4") == {"use_auto_relay": True}
    forwarded = relay_options("auto", ["/ip4/8.8.4.4/tcp/31337"], ["/ip4/0.0.0.0/tcp/31337"], "192.168.1.20")
    assert forwarded == {"use_auto_relay": True}
    assert relay_options("auto", [], ["/ip4/127.0.0.1/tcp/0"], "192.168.1.20") == {"use_auto_relay": True}
    assert relay_options("auto", [], ["/ip4/0.0.0.0/tcp/0"], None) == {"use_auto_relay": True}  # offline
    assert relay_options("on", [], [], "8.8.4.4")["force_reachability"] == "private"
    assert relay_options("off", [], ["/ip4/0.0.0.0/tcp/0"], "192.168.1.20") == {"use_auto_relay": False}
    with pytest.raises(ValueError):
        relay_options("sometimes", [], [], None)
    assert relay_service_flags(False, Budget()) == {"relayService": 0}
    assert relay_service_flags(True, Budget(4, 100 << 20, 60.0)) == {
        "relayService": 1, "relayMaxCircuits": 4, "relayDataLimit": 100 << 20, "relayTimeLimit": "60s"}


def test_classify_and_targets():
    assert classify(True, True) == classify(True, False) == DIRECT
    assert classify(False, True) == VIA_RELAY
    assert classify(False, False) == UNREACHABLE
    assert classify(None, True) == classify(None, False) == UNKNOWN
    addrs = [
        "/ip4/10.0.0.1/tcp/1/p2p/Qm",
        "/ip4/10.0.0.1/tcp/1",  # duplicate
        "/ip4/0.0.0.0/tcp/5",
        "/ip4/10.0.0.9/tcp/5/p2p/Qm/p2p-circuit",
        "/ip4/10.0.0.2/udp/5/quic",
        "/ip6/::1/tcp/7",
        "/ip4/nonsense/tcp/8",
        "/ip4/10.0.0.3/tcp/70000",
        "/dns4/example.org/tcp/9",
        "/ip4/10.0.0.1/tcp/2",
        "/ip4/10.0.0.1/tcp/3",
        "/ip4/10.0.0.1/tcp/4",
        "/ip4/10.0.0.1/tcp/5",
    ] + [f"/ip4/10.0.1.{i}/tcp/9" for i in range(10)]
    assert tcp_targets(addrs, "10.0.0.1") == [("10.0.0.1", 1), ("10.0.0.1", 2), ("10.0.0.1", 3), ("10.0.0.1", 4)]
    assert tcp_targets(addrs, "::1") == [("::1", 7)]
    # only the requester's own IP is ever dialled: not a third party's, and nothing without an IP
    assert tcp_targets(addrs, "10.0.1.3") == [("10.0.1.3", 9)]
    assert tcp_targets(addrs, "192.0.2.7") == tcp_targets(addrs, None) == tcp_targets(addrs, "nonsense") == []


def test_reachability_field_is_validated_and_optional():
    older = stage_record(0).dict()
    del older["reachability"]  # a record of a peer from before the field
    assert StagePeerRecord.parse_obj(older).reachability == ""
    assert StagePeerRecord.parse_obj({**older, "reachability": "via relay"}).reachability == VIA_RELAY
    with pytest.raises(pydantic.ValidationError):
        StagePeerRecord.parse_obj({**older, "reachability": "<script>"})
    # the relay a NATed peer names: a canonical peer id, or "" (older records have none)
    relay = "QmZ5dV2ukSB2jHZ2dfu9JmVqYLgz3UBGWvRzzTumj6HUjx"
    assert StagePeerRecord.parse_obj(older).relay == ""
    assert StagePeerRecord.parse_obj({**older, "relay": relay}).relay == relay
    for bad in ("x", "<script>", "Qm" + "1" * 44, relay[:-1], relay + " "):
        with pytest.raises(pydantic.ValidationError):
            StagePeerRecord.parse_obj({**older, "relay": bad})


def test_rate_limit_is_global_and_per_peer_and_bounded():
    limit = RateLimit(burst=2, refill_s=10.0, per_peer=30.0, max_peers=3)
    assert limit.allow("a", now=0.0) and not limit.allow("a", now=1.0)  # one per peer per 30 s
    assert limit.allow("b", now=1.0) and not limit.allow("c", now=1.0)  # the bucket is empty
    assert limit.allow("c", now=11.0)  # refilled by one
    assert limit.allow("d", now=100.0) and list(limit.last) == ["d"]  # a full table forgets expired peers
    full = RateLimit(burst=5, refill_s=1.0, per_peer=30.0, max_peers=1)
    assert full.allow("a", now=0.0) and not full.allow("b", now=1.0)  # no room: refused, memory stays bounded


class _Info:
    class peer_id:  # noqa: N801 - mimics hivemind's StreamInfo.peer_id
        @staticmethod
        def to_base58() -> str:
            return "requester"


class _Writer:
    def __init__(self):
        self.data, self.closed = b"", False

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def _serve(service: DialBackService, request: bytes) -> bytes:
    async def run() -> bytes:
        reader = asyncio.StreamReader()
        reader.feed_data(request)
        reader.feed_eof()
        writer = _Writer()
        await service.handle(_Info, reader, writer)
        assert writer.closed
        return writer.data

    return asyncio.run(run())


def test_dial_back_service_dials_only_the_requesters_ip():
    """A request naming a listener on another IP than the one it came from gets nothing dialled there."""

    async def run() -> tuple[bytes, bytes]:
        async def libp2p_like(reader, writer):
            writer.write(bytes([len(GREETING)]) + GREETING)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(libp2p_like, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        request = json.dumps({"addrs": [f"/ip4/127.0.0.1/tcp/{port}"]}).encode()
        answers = []
        async with server:
            for came_from in ("/ip4/127.0.0.1/tcp/4001", "/ip4/10.9.9.9/tcp/4001"):
                reader = asyncio.StreamReader()
                reader.feed_data(struct.pack(">I", len(request)) + request)
                reader.feed_eof()
                writer = _Writer()
                info = type("Info", (), {"peer_id": _Info.peer_id, "addr": came_from})
                await DialBackService(RateLimit(burst=10, per_peer=0.0)).handle(info, reader, writer)
                answers.append(writer.data)
        return answers[0], answers[1]

    same, other = asyncio.run(run())
    assert b"127.0.0.1" in same  # its own address, dialled and greeted
    assert other.endswith(b'{"reached": []}')  # a third party's: not dialled


def test_dial_back_service_survives_bad_requests():
    for bad in (b"", b"\xff\xff\xff\xff" + b"x" * 10, struct.pack(">I", 5) + b"{nope", struct.pack(">I", 2) + b"[]"):
        service = DialBackService(RateLimit(burst=10, per_peer=0.0))
        answer = _serve(service, bad)
        assert answer in (b"", struct.pack(">I", 15) + b'{"reached": []}'), answer
    limited = DialBackService(RateLimit(burst=1, per_peer=60.0))
    _serve(limited, struct.pack(">I", 2) + b"{}")
    assert b"busy" in _serve(limited, struct.pack(">I", 2) + b"{}")  # the second request within a minute


def test_greets_only_a_libp2p_listener():
    async def run() -> bool:
        async def silent(reader, writer):
            writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await greets("127.0.0.1", port, timeout=2.0)

    assert asyncio.run(run()) is False


# --- the swarm behind an emulated NAT (slow, root) -----------------------------------------------------


def _can_nat() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, iptables)"
    if not shutil.which("iptables") or not shutil.which("ip"):
        return "needs iptables and iproute2"
    return None


def _remove_leftovers() -> None:
    """Namespaces a killed earlier run left (benchmarks/nat.py names every one `pnat<hex>-...`)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for name in listed:
        if name.startswith("pnat"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.mark.slow
@pytest.mark.skipif(_can_nat() is not None, reason=str(_can_nat()))
def test_swarm_with_its_middle_stage_behind_nat():
    from benchmarks.nat_swarm import NatSwarm
    from swarm.presets import preset

    _remove_leftovers()
    workdir = Path(tempfile.mkdtemp(prefix="nat-swarm-"))
    swarm = NatSwarm(preset("tiny", stages=3), workdir)
    failed = True
    try:
        swarm.start()
        for public in ("stage0", "stage2"):
            swarm.wait_peer(public, lambda p: p["state"] == "online", 300, f"{public} online")
        expected = {"relay": VIA_RELAY, "forward": DIRECT, "off": UNREACHABLE}
        for mode, reachability in expected.items():
            name = f"home-{mode}"
            swarm.add_home_peer(name, mode)
            found = swarm.wait_peer(name, lambda p: p["reachability"], 300, f"{name}'s reachability")
            assert found["reachability"] == reachability, (mode, found)
            # the tracker names the relay exactly when the peer is reached through one: the public stage-2 peer
            assert found["relay"] == (swarm.peer("stage2")["peer_id"] if mode == "relay" else ""), found
            assert f"reachability: {reachability}".lower() in swarm.log(name).lower()
            before = swarm.relay_counters("stage2")
            if mode != "off":  # it serves stage 1: every trip goes through it
                swarm.wait_peer(name, lambda p: p["tokens"] > 2000, 300, f"training through {name}")
                time.sleep(12)  # the relay logs its counters every 10 s
            after = swarm.relay_counters("stage2")
            if mode == "relay":  # the driver sits behind its own symmetric NAT: the relay is the only path
                assert after["trips"] > before["trips"] and after["forward"] > before["forward"] + 2000, after
                assert "via relay" in swarm.log(name) and swarm.peer("stage0")["tokens"] > 0
            else:  # a forwarded port is dialled directly; an unreachable peer gets no trips at all
                assert after["trips"] == before["trips"], (mode, before, after)
            swarm.stop_peer(name)
        failed = False
    finally:
        swarm.close()
        if failed:
            shutil.rmtree(ARTIFACTS / "nat", ignore_errors=True)
            shutil.copytree(workdir, ARTIFACTS / "nat", dirs_exist_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)
    assert not [
        n
        for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        if n.startswith(swarm.net.tag)
    ]


@pytest.mark.slow
@pytest.mark.skipif(_can_nat() is not None, reason=str(_can_nat()))
def test_kv_reaches_a_lane_peer_only_through_its_relay():
    """Two lane peers, each behind its own symmetric NAT, that can reach each other only through the relay their
    records name: a layer's K/V goes from lane 0 to lane 1 and its gradient back, both through the relay's K/V
    channel (`peer/link.py`, `p2pio.relay_service.KV`), and arrive as sent (tests/nat_kv_node.py)."""
    from nat_kv_node import on_wire, payload

    from benchmarks.nat import Internet

    _remove_leftovers()
    net, workdir = Internet(), Path(tempfile.mkdtemp(prefix="nat-kv-"))
    children: list[subprocess.Popen] = []
    node = Path(__file__).resolve().parent / "nat_kv_node.py"
    env = {**os.environ, "PYTHONPATH": str(node.parent.parent)}

    def spawn(short: str, role: str, options: dict) -> None:
        with open(workdir / f"{role}.log", "w") as log:
            argv = ["ip", "netns", "exec", net.name(short), sys.executable, str(node), role, str(workdir),
                    json.dumps(options)]
            children.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env))

    def wait(name: str, timeout: float = 180.0) -> dict:
        deadline = time.monotonic() + timeout
        while not (workdir / name).exists():
            assert all(child.poll() is None for child in children), {
                log.name: log.read_text()[-2000:] for log in workdir.glob("*.log")}
            assert time.monotonic() < deadline, f"no {name}"
            time.sleep(0.5)
        time.sleep(0.2)  # written whole: a small file in one write
        return json.loads((workdir / name).read_text())

    try:
        address = net.public_host("r")
        spawn("r", "relay", {"address": address})
        net.home("a", 10, "symmetric")
        net.home("b", 20, "symmetric")
        spawn("a", "lane0", {"relay_address": address})
        spawn("b", "lane1", {"relay_address": address})
        lane0, lane1 = wait("lane0.result.json"), wait("lane1.result.json")
        assert lane1["received"] == on_wire(payload(0))  # lane 0's K/V, bit for bit
        assert lane0["received"] == on_wire(payload(1, "backward"))  # and lane 1's gradient of it
        for result in (lane0, lane1):  # no way straight through two symmetric NATs: the relay carried both
            assert result["relayed"] == 1 and result["direct"] == 0 and result["delivered"] >= 1, result
        for _ in range(20):  # the relay counts a circuit when the target closes it
            if wait("carried.json")["circuits"] >= 2:
                break
            time.sleep(0.5)
        assert wait("carried.json")["circuits"] >= 2
    finally:
        for child in children:
            child.kill()
            child.wait()
        net.close()
        shutil.rmtree(workdir, ignore_errors=True)


def test_p2pd_accepts_the_relay_service_flags():
    """hivemind 1.1.12 does not forward these; `daemon_flags` appends them, and p2pd must start with them."""
    from hivemind.p2p import P2P

    from peer.reachability import daemon_flags

    async def run() -> list[str]:
        with daemon_flags(relay_service_flags(True, Budget(4, 100 << 20, 60.0))):
            p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            return Path(f"/proc/{p2p._child.pid}/cmdline").read_bytes().decode().split("\0")
        finally:
            await p2p.shutdown()

    args = asyncio.run(run())
    assert "-relayService=1" in args and f"-relayDataLimit={100 << 20}" in args and "-relayTimeLimit=60s" in args
    assert P2P._make_process_args("x", a=1) == ["x", "-a=1"]  # the patch is gone outside the block


def test_via_relay_means_a_relay_holds_the_peer(caplog):
    """The record's answer and its `relay` field follow the relay client: "via relay" only while one holds us."""
    from peer.reachability import ReachabilityCheck
    from peer.relay import RelayClient

    async def nothing() -> list[str]:
        return []

    client = RelayClient(None, "ns", None, nothing)
    check = ReachabilityCheck(None, nothing, "me", ["/ip4/0.0.0.0/tcp/31337"], lambda: "[me]", client)
    assert (check.result, check.relay) == (UNKNOWN, "")
    check.dialled = False
    with caplog.at_level("INFO", logger="peer"):
        check.report()
        assert (check.result, check.relay) == (UNREACHABLE, "")
        client.relay = "QmZ5dV2ukSB2jHZ2dfu9JmVqYLgz3UBGWvRzzTumj6HUjx"
        check.report()
        check.report()  # no change, no line
        assert (check.result, check.relay) == (VIA_RELAY, client.relay)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "UNREACHABLE" in lines[0] and "reachability: via relay j6HUjx" in lines[1]
    check.dialled = True  # dialled back: direct, and no relay is named even if the client still holds one
    assert (check.result, check.relay) == (DIRECT, "")
    relays_off = ReachabilityCheck(None, nothing, "me", [], lambda: "[me]", None)
    relays_off.dialled = False
    assert (relays_off.result, relays_off.relay) == (UNREACHABLE, "")


def test_unknown_while_a_relay_is_still_being_found():
    """Not dialled back: the answer stays unknown while the check waits for a relay, then says "via relay" when
    one takes the peer (the record must never say "unreachable" in between), or "unreachable" when none does."""
    from peer.reachability import ReachabilityCheck
    from peer.relay import RelayClient

    async def nothing() -> list[str]:
        return []

    async def run() -> list[str]:
        client = RelayClient(None, "ns", None, nothing)
        check = ReachabilityCheck(None, nothing, "me", ["/ip4/0.0.0.0/tcp/31337"], lambda: "[me]", client)
        seen = []

        async def relay_accepts() -> None:
            await asyncio.sleep(0.2)
            seen.append(check.result)
            client.relay = "QmZ5dV2ukSB2jHZ2dfu9JmVqYLgz3UBGWvRzzTumj6HUjx"
            client.changed.set()

        accepting = asyncio.create_task(relay_accepts())
        await check.settle(False, relay_wait=30.0)
        await accepting
        seen.append(check.result)
        await client.stop()
        lonely = ReachabilityCheck(None, nothing, "me", [], lambda: "[me]", RelayClient(None, "ns", None, nothing))
        await lonely.settle(False, relay_wait=0.2)
        await lonely.relay_client.stop()
        return seen + [lonely.result]

    assert asyncio.run(run()) == [UNKNOWN, VIA_RELAY, UNREACHABLE]
