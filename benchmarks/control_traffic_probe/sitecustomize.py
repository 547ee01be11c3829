"""Counts every process's network traffic by kind for benchmarks/control_traffic.py.

Python imports `sitecustomize` at start-up from the path; the benchmark puts this folder on
PYTHONPATH of a local swarm, and sets CONTROL_TRAFFIC_DIR. Without that variable nothing happens.
It wraps, on the serving side so that every exchange is counted once (request + response sizes):
- hivemind's DHT node (lookups and stores it starts, by key; it also remembers which DHT id each
  key hashes to, so the benchmark can name the keys of the requests served) and DHT protocol
  (requests it serves, with their protobuf sizes, per DHT id; and, on the asking side, the finds it
  sends, by who asks (launcher, tracker, peer) and why: a read, or the search for the nodes a store
  goes to, where every node asked answers with the key's whole value too);
- hivemind's averagers: matchmaking (`rpc_join_group`), the all-reduce payload
  (`rpc_aggregate_part`) and state downloads (`rpc_download_state`), by protobuf size;
- our codec's decoders: every trip message received, split into header and payload bytes.
Every few seconds each process writes its counts.
"""

import collections
import contextvars
import functools
import importlib.abc
import inspect
import json
import os
import sys
import threading
import time

_COUNTS: collections.Counter = collections.Counter()
_WRITERS: set[int] = set()


def _write_forever(out_dir: str) -> None:
    pid = os.getpid()
    while True:
        time.sleep(2.0)
        with open(os.path.join(out_dir, f"{pid}.json.tmp"), "w") as file:
            json.dump(dict(_COUNTS), file)
        os.replace(os.path.join(out_dir, f"{pid}.json.tmp"), os.path.join(out_dir, f"{pid}.json"))


def note(event: str, amount: int = 1) -> None:
    if os.getpid() not in _WRITERS:  # DHT and averagers are forked processes: count each anew
        _WRITERS.add(os.getpid())
        _COUNTS.clear()
        threading.Thread(target=_write_forever, args=(os.environ["CONTROL_TRAFFIC_DIR"],), daemon=True).start()
    _COUNTS[event] += amount


def _install_hivemind(_module) -> None:
    from hivemind.averaging import averager
    from hivemind.dht import node, protocol
    from hivemind.dht.routing import DHTID

    def name_keys(keys) -> None:
        for key in keys:
            note(f"key {DHTID.generate(source=key).to_bytes().hex()} {key}", 0)

    get_many, store_many = node.DHTNode.get_many, node.DHTNode.store_many

    # who asks: the local launcher's monitoring polls the stage records too, which no real swarm has
    program = sys.argv[0] if sys.argv else ""
    role = "launcher" if program.endswith(os.path.join("launcher", "cli.py")) else "other"
    asker = "tracker" if os.path.basename(program) == "protocol-tracker" else "peer" if role == "other" else role
    purpose = contextvars.ContextVar("purpose", default="other")  # inherited by the tasks a lookup or store starts

    async def counted_get_many(self, keys, *args, **kwargs):
        name_keys(keys)
        for key in keys:
            note(f"lookup {key}")
            note(f"{role} lookup {key}")
        token = purpose.set("read")
        try:
            return await get_many(self, keys, *args, **kwargs)
        finally:
            purpose.reset(token)

    async def counted_store_many(self, keys, *args, **kwargs):
        name_keys(keys)
        for key in keys:
            note(f"store {key}")
        token = purpose.set("store")
        try:
            return await store_many(self, keys, *args, **kwargs)
        finally:
            purpose.reset(token)

    node.DHTNode.get_many, node.DHTNode.store_many = counted_get_many, counted_store_many

    def served(kind: str, request, response) -> None:
        size = request.ByteSize() + response.ByteSize()
        note("served requests")
        note("served bytes", size)
        keys = list(getattr(request, "keys", ()))
        for key in keys:  # a batched request's bytes are split evenly over its keys
            note(f"served {kind} {key.hex()}", size // len(keys))
        if not keys:
            note(f"served {kind}", size)

    def serving(kind: str, method):
        @functools.wraps(method)  # hivemind reads the request and response types from the annotations
        async def counted(self, request, context):
            response = await method(self, request, context)
            served(kind, request, response)
            return response

        return counted

    class AskingStub:
        """The client stub of one DHT request, counting the finds it sends (request + response)."""

        def __init__(self, stub):
            self._stub = stub

        def __getattr__(self, name):
            return getattr(self._stub, name)

        async def rpc_find(self, request, *args, **kwargs):
            response = await self._stub.rpc_find(request, *args, **kwargs)
            size, keys = request.ByteSize() + response.ByteSize(), list(request.keys)
            for key in keys:
                note(f"asked find {purpose.get()} {asker} {key.hex()}", size // len(keys))
            return response

    get_stub = protocol.DHTProtocol.get_stub
    protocol.DHTProtocol.get_stub = lambda self, peer: AskingStub(get_stub(self, peer))
    protocol.DHTProtocol.rpc_find = serving("find", protocol.DHTProtocol.rpc_find)
    protocol.DHTProtocol.rpc_store = serving("store", protocol.DHTProtocol.rpc_store)
    protocol.DHTProtocol.rpc_ping = serving("ping", protocol.DHTProtocol.rpc_ping)

    def streamed(kind: str, method):
        async def counted_input(stream):
            async for message in stream:
                note(kind, message.ByteSize())
                yield message

        @functools.wraps(method)
        async def counted(self, request, context):
            if hasattr(request, "__aiter__"):
                request = counted_input(request)
            else:
                note(kind, request.ByteSize())
            async for message in method(self, request, context):
                note(kind, message.ByteSize())
                yield message

        # hivemind reads the types by the name of the second argument, which is `stream` in some methods
        counted.__annotations__ = dict(counted.__annotations__)
        counted.__annotations__["request"] = counted.__annotations__[inspect.getfullargspec(method).args[1]]
        return counted

    cls = averager.DecentralizedAverager
    cls.rpc_join_group = streamed("averaging matchmaking", cls.rpc_join_group)
    cls.rpc_aggregate_part = streamed("averaging payload", cls.rpc_aggregate_part)
    cls.rpc_download_state = streamed("state download", cls.rpc_download_state)


def _install_codec(codec) -> None:
    from swarm.manifest import token_id_itemsize
    from swarm.wire_dtype import wire_dtype

    def counted(method):
        def decode(self, blob, stage):
            result = method(self, blob, stage)
            header = result[0]
            batch, seq, width = header.shape
            body = wire_dtype(header.dtype).payload_bytes(batch * seq, width)
            if header.has_tokens:
                body += batch * seq * token_id_itemsize(self.manifest.model.vocab_size)
            note(f"trip {header.kind} messages")
            note(f"trip {header.kind} header bytes", len(blob) - body)
            note(f"trip {header.kind} payload bytes", body)
            return result

        return decode

    codec.BoundaryCodec.decode_forward = counted(codec.BoundaryCodec.decode_forward)
    codec.BoundaryCodec.decode_backward = counted(codec.BoundaryCodec.decode_backward)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Wraps a module's functions right after it is first imported, so processes that never import
    hivemind or the codec (the launcher, the tracker) do not pay for importing them."""

    hooks = {"hivemind": _install_hivemind, "swarm.codec": _install_codec}

    def find_spec(self, name, path, target=None):
        if name not in self.hooks:
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util

            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        loader = spec.loader
        hook = self.hooks[name]

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                hook(module)

        spec.loader = Loader()
        return spec


if os.environ.get("CONTROL_TRAFFIC_DIR"):
    sys.meta_path.insert(0, _AfterImport())
