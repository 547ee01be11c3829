"""Counts every process's hivemind DHT operations for benchmarks/control_traffic.py.

Python imports `sitecustomize` at start-up from the path; the benchmark puts this folder on
PYTHONPATH of a local swarm, and sets CONTROL_TRAFFIC_DIR. Without that variable nothing happens.
It wraps hivemind's DHT node (lookups and stores it starts, by key) and DHT protocol (requests it
serves, with their protobuf sizes), and every few seconds writes the counts of each process.
"""

import collections
import json
import os
import threading
import time


def _install(out_dir: str) -> None:
    from hivemind.dht import node, protocol
    from hivemind.proto import dht_pb2

    counts: collections.Counter = collections.Counter()
    writer_pids: set[int] = set()

    def write_forever() -> None:
        pid = os.getpid()
        while True:
            time.sleep(2.0)
            with open(os.path.join(out_dir, f"{pid}.json.tmp"), "w") as file:
                json.dump(dict(counts), file)
            os.replace(os.path.join(out_dir, f"{pid}.json.tmp"), os.path.join(out_dir, f"{pid}.json"))

    def note(event: str, amount: int = 1) -> None:
        if os.getpid() not in writer_pids:  # DHT and averagers are forked processes: count each anew
            writer_pids.add(os.getpid())
            counts.clear()
            threading.Thread(target=write_forever, daemon=True).start()
        counts[event] += amount

    get_many, store_many = node.DHTNode.get_many, node.DHTNode.store_many

    async def counted_get_many(self, keys, *args, **kwargs):
        for key in keys:
            note(f"lookup {key}")
        return await get_many(self, keys, *args, **kwargs)

    async def counted_store_many(self, keys, *args, **kwargs):
        for key in keys:
            note(f"store {key}")
        return await store_many(self, keys, *args, **kwargs)

    rpc_find, rpc_store = protocol.DHTProtocol.rpc_find, protocol.DHTProtocol.rpc_store

    async def counted_rpc_find(self, request: dht_pb2.FindRequest, context) -> dht_pb2.FindResponse:
        response = await rpc_find(self, request, context)
        note("served requests")
        note("served bytes", request.ByteSize() + response.ByteSize())
        return response

    async def counted_rpc_store(self, request: dht_pb2.StoreRequest, context) -> dht_pb2.StoreResponse:
        response = await rpc_store(self, request, context)
        note("served requests")
        note("served bytes", request.ByteSize() + response.ByteSize())
        return response

    node.DHTNode.get_many, node.DHTNode.store_many = counted_get_many, counted_store_many
    protocol.DHTProtocol.rpc_find, protocol.DHTProtocol.rpc_store = counted_rpc_find, counted_rpc_store


if os.environ.get("CONTROL_TRAFFIC_DIR"):
    _install(os.environ["CONTROL_TRAFFIC_DIR"])
