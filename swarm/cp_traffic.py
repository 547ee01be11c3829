"""The K/V messages a context-parallel trip would send, counted in one process.

The simulator runs the one-graph `swarm.cp_attention.CPAttention` (the same function as a swarm with
the graph cut at every message, tested in tests/test_context_parallel.py). While a `CPTraffic`
is entered, every attention tells it of every crossing: sender chunk j's payload and receiver
chunk c's own copy of it. After the trip's backward, `flush` encodes the forward message from the
payload and the backward message from the gradient of the receiver's copy with swarm.cp_wire's
codec (the bytes a swarm would ship), decodes both as their receivers would, and measures how
exactly the receiver's K/V, rebuilt from the decoded bytes, match the sender's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from swarm.cp_modes import DENSE_KV
from swarm.cp_wire import CPCodec, decode_kv, encode_kv
from swarm.subspace import relative_error


@dataclass
class CPTripTraffic:
    """Summed over one trip's crossings, every layer."""

    forward_bytes: int = 0
    backward_bytes: int = 0
    dense_forward_bytes: int = 0  # the same crossings as dense K/V messages (same dtype, same header)
    dense_backward_bytes: int = 0
    max_reconstruction_error: float = 0.0  # K/V rebuilt from the decoded bytes vs from the sender's payload
    kv_residuals: list[float] = field(default_factory=list)  # per crossing: ‖rebuilt − full-rank K/V‖ / ‖full‖


@dataclass
class _Crossing:
    attn: torch.nn.Module  # the CPAttention of the layer
    owner: int
    dst: int
    payload: tuple  # the sender's (Z_k or K, Z_v or V, θ or None), detached
    received: tuple  # the receiver's copies, in the graph: their gradients are the backward message
    kv_residual: float


class CPTraffic:
    """Entered around a trip's forward: taps every `attentions` module; `flush` after its backward.
    `codecs` maps a layer to the CPCodec of the stage that holds it."""

    def __init__(self, codecs: dict[int, CPCodec], attentions: list[torch.nn.Module]):
        self.codecs, self.attentions = codecs, attentions
        self._crossings: list[_Crossing] = []

    def __enter__(self) -> CPTraffic:
        for attn in self.attentions:
            attn.tap = self
        return self

    def __exit__(self, *exc) -> None:
        for attn in self.attentions:
            attn.tap = None

    def note(self, attn, owner: int, dst: int, payload: tuple, received: tuple, rebuilt: tuple, full: tuple) -> None:
        """Called by CPAttention.forward for each crossing owner → dst."""
        for tensor in received:
            if tensor is not None and tensor.requires_grad:
                tensor.retain_grad()
        with torch.no_grad():
            residual = max(relative_error(r, f) for r, f in zip(rebuilt, full, strict=True))
        detached = tuple(None if t is None else t.detach() for t in payload)
        self._crossings.append(_Crossing(attn, owner, dst, detached, received, residual))

    def flush(self) -> CPTripTraffic:
        """Encode and decode every message of the trip; forget the crossings."""
        out = CPTripTraffic()
        for crossing in self._crossings:
            attn, owner, dst = crossing.attn, crossing.owner, crossing.dst
            codec, mode, batch = self.codecs[attn.layer], attn.mode, crossing.payload[0].shape[0]
            forward = encode_kv(codec.header("forward", attn.layer, owner, owner, dst, batch, mode), *crossing.payload)
            _, z_k, z_v, theta = decode_kv(forward, codec.expectation("forward", dst, mode))
            with torch.no_grad():
                like = crossing.payload[0]  # the sender's device and dtype
                got = attn.rebuild(z_k.to(like), z_v.to(like), None if theta is None else theta.to(like), mode)
                sent = attn.rebuild(*crossing.payload, mode)
            error = max(relative_error(g, s) for g, s in zip(got, sent, strict=True))
            grads = tuple(
                None if t is None else (t.grad if t.grad is not None else torch.zeros_like(t))
                for t in crossing.received
            )
            backward = encode_kv(codec.header("backward", attn.layer, owner, dst, owner, batch, mode), *grads)
            decode_kv(backward, codec.expectation("backward", owner, mode))  # what the owner would accept
            out.forward_bytes += len(forward)
            out.backward_bytes += len(backward)
            out.max_reconstruction_error = max(out.max_reconstruction_error, error)
            out.kv_residuals.append(crossing.kv_residual)
            for kind, src, to in (("forward", owner, dst), ("backward", dst, owner)):
                header = codec.header(kind, attn.layer, owner, src, to, batch, DENSE_KV)
                zeros = torch.zeros(batch, header.chunk_len, header.width_k)
                dense = len(encode_kv(header, zeros, zeros, None))
                if kind == "forward":
                    out.dense_forward_bytes += dense
                else:
                    out.dense_backward_bytes += dense
        self._crossings.clear()
        return out
