"""One node of the K/V-through-a-relay lab (tests/test_nat.py), run inside a network namespace of
`benchmarks/nat.py`'s `Internet`:

- `relay`: on a public address, the trip relay (`p2pio.relay_service.RelayService`) of the run;
- `lane0`, `lane1`: two lane peers of one stage, each behind its own symmetric NAT (no port forward), so
  neither can dial the other: each registers with the relay (`peer/relay.py` `RelayClient`, the K/V
  channel delivered to its `KVService`), and sends K/V through a `peer/link.py` `Link` whose records name
  the relay for the other. Lane 0 sends its K/V of one layer, lane 1 sends back the gradient; each writes
  what it received and how its link sent.

    python tests/nat_kv_node.py ROLE WORKDIR OPTIONS_JSON
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import torch
from hivemind.p2p import P2P

from p2pio.budget import Budget
from p2pio.relay_service import KV, RelayService
from peer.kv_exchange import KVService, message_limit
from peer.link import Link
from peer.relay import RelayClient, TripSender
from swarm.context_parallel import ContextParallelSpec, CPBasis
from swarm.cp_wire import CPCodec
from swarm.manifest import ModelShape

NAMESPACE = "natkv"
RELAY_PORT = 40000
SHAPE = ModelShape(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, vocab_size=256, max_seq_len=64)
SPEC = ContextParallelSpec(size=2, compression="subspace", theta_max=0.5)
SEQ, BATCH, TRIP = 24, 2, "trip-through-the-relay"


def codec() -> CPCodec:
    return CPCodec(SPEC, SHAPE, SEQ, BATCH, NAMESPACE, CPBasis.for_spec(SPEC, SHAPE, seed=5))


def payload(seed: int, kind: str = "forward") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    n = SEQ // SPEC.size
    z_k = torch.randn(BATCH, n, SPEC.r_k, generator=generator)
    z_v = torch.randn(BATCH, n, SPEC.r_v, generator=generator)
    theta = (torch.rand(BATCH, SPEC.n_theta, generator=generator) - 0.5) * (SPEC.theta_max if kind == "forward" else 3)
    return z_k, z_v, theta


def on_wire(tensors) -> list[list]:
    """What a receiver decodes (Z in bf16, θ in float32), as lists for JSON."""
    z_k, z_v, theta = tensors
    return [z_k.bfloat16().float().tolist(), z_v.bfloat16().float().tolist(), theta.tolist()]


class RelayNamed:
    """Records that name `relay` for every peer: what a lane peer behind a router announces."""

    def __init__(self, relay: str):
        self.relay = relay

    def relay_of(self, peer_id: str) -> str:
        return self.relay


async def wait_file(path: Path, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not appear")
        await asyncio.sleep(0.2)
    return json.loads(path.read_text())


def write_json(path: Path, value: dict) -> None:
    """Whole or not at all: the test polls these files, and the relay rewrites its counts every 0.5 s (a reader
    that opened one between `write_text`'s truncation and its write read nothing: a CI run failed so)."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(value))
    partial.replace(path)


async def relay(workdir: Path, options: dict) -> None:
    p2p = await P2P.create(host_maddrs=[f"/ip4/{options['address']}/tcp/{RELAY_PORT}"])
    service = RelayService(p2p, NAMESPACE, Budget(16, 64 << 20, 60.0), 1 << 20)
    await service.add_handlers()
    write_json(workdir / "relay.json", {"id": p2p.peer_id.to_base58()})
    while True:  # the test reads what the relay carried
        await asyncio.sleep(0.5)
        write_json(workdir / "carried.json", {"circuits": service.circuits, "refused": service.refused})


async def lane(role: str, workdir: Path, options: dict) -> None:
    lane_index = int(role[-1])
    relay_id = (await wait_file(workdir / "relay.json"))["id"]
    boot = [f"/ip4/{options['relay_address']}/tcp/{RELAY_PORT}/p2p/{relay_id}"]
    p2p = await P2P.create(initial_peers=boot, host_maddrs=["/ip4/0.0.0.0/tcp/0"])
    kv_codec = codec()
    service = KVService(p2p, NAMESPACE, message_limit(kv_codec, lane_index, SPEC.mode))
    service.serve(kv_codec, lane_index)
    await service.start()

    async def candidates() -> list[str]:
        return [relay_id]

    async def no_trips(_sender, _reader, writer) -> None:
        writer.close()

    client = RelayClient(p2p, NAMESPACE, no_trips, candidates)
    await client.start()
    await client.deliver(KV, service.servicer.serve_stream)
    client.hold(lambda _: None)
    await asyncio.wait_for(client.changed.wait(), 60)
    write_json(workdir / f"{role}.json", {"id": p2p.peer_id.to_base58()})
    other = (await wait_file(workdir / f"lane{1 - lane_index}.json"))["id"]
    ids = {lane_index: p2p.peer_id.to_base58(), 1 - lane_index: other}
    link = Link(TripSender(p2p, NAMESPACE + KV), RelayNamed(relay_id))
    exchange = await service.open(TRIP, [ids[0], ids[1]], link=link)
    if lane_index == 0:
        await exchange.send_forward(0, *payload(0))
        received = (await exchange.receive_backward(0, timeout=60.0))[1]
    else:
        received = (await exchange.receive_forward(0, timeout=60.0))[0]
        await exchange.send_backward(0, {0: payload(1, "backward")})
    result = {"received": on_wire(received), "direct": link.sender.direct, "relayed": link.sender.relayed,
              "delivered": client.delivered}
    write_json(workdir / f"{role}.result.json", result)
    await asyncio.sleep(3600)  # the other lane's messages may still need this peer; the test kills it


def main() -> None:
    role, workdir, options = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    asyncio.run(relay(workdir, options) if role == "relay" else lane(role, workdir, options))


if __name__ == "__main__":
    main()
