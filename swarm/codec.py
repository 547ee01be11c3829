"""What crosses a stage boundary, in both directions: the one codec the simulator and peers share.

Forward: the sender's residual `x` becomes `c = (x − T_fixed[tok]) U` (or `x` itself in dense
mode) plus the token ids; the receiver rebuilds `x`. Backward: the receiver's gradient `g`
becomes `g U` (or `g`); the sender rebuilds `(g U) Uᵀ`, all it needs for exact parameter
gradients upstream.

Both directions are range-checked on the way out as on the way in (`swarm.wire.check_range`): a
stage never sends a row it would refuse to receive, so a refusal downstream is never its
receiver's fault.
"""

from __future__ import annotations

import torch

from swarm import subspace as ss
from swarm.manifest import Manifest
from swarm.model import SubspaceState
from swarm.wire import (
    MAX_ACTIVATION_NORM,
    MAX_GRADIENT_NORM,
    Expectation,
    Header,
    check_range,
    decode,
    encode,
    expectation_for,
)


class BoundaryCodec:
    def __init__(self, manifest: Manifest, state: SubspaceState):
        self.manifest, self.state = manifest, state
        self.compressed = manifest.mode.compressed

    def expectation(self, stage: int, kind: str) -> Expectation:
        return expectation_for(self.manifest, stage, kind, self.state.version, self.state.t_fixed_sha256)

    def _header(self, trip_id: str, stage: int, kind: str, shape, has_tokens: bool, loss=None, extra=None) -> Header:
        return Header(
            run_id=self.manifest.run_id,
            u_version=self.state.version,
            t_fixed_sha256=self.state.t_fixed_sha256,
            trip_id=trip_id,
            stage=stage,
            kind=kind,
            dtype=self.manifest.wire_dtype,
            shape=tuple(int(n) for n in shape),
            has_tokens=has_tokens,
            loss=loss,
            extra=extra or {},
        )

    def encode_forward(
        self, hidden: torch.Tensor, tokens: torch.Tensor, trip_id: str, to_stage: int, extra=None
    ) -> bytes:
        with torch.no_grad():
            hidden = hidden.detach().float()
            payload = ss.compress(hidden, tokens, self.state.basis, self.state.t_fixed) if self.compressed else hidden
            check_range(payload, MAX_ACTIVATION_NORM, "this stage's output")
        header = self._header(trip_id, to_stage, "forward", payload.shape, True, extra=extra)
        return encode(header, payload, tokens, self.manifest.model.vocab_size)

    def decode_forward(self, blob: bytes, stage: int) -> tuple[Header, torch.Tensor, torch.Tensor]:
        header, payload, tokens = decode(blob, self.expectation(stage, "forward"))
        device = self.state.basis.device
        payload, tokens = payload.to(device).float(), tokens.to(device)
        hidden = ss.decompress(payload, tokens, self.state.basis, self.state.t_fixed) if self.compressed else payload
        return header, hidden, tokens

    def encode_backward(
        self, grad: torch.Tensor, trip_id: str, to_stage: int, loss: float | None = None, extra=None
    ) -> bytes:
        with torch.no_grad():
            grad = grad.detach().float()
            payload = ss.compress_grad(grad, self.state.basis) if self.compressed else grad
            check_range(payload, MAX_GRADIENT_NORM, "this stage's input gradient")
        header = self._header(trip_id, to_stage, "backward", payload.shape, False, loss=loss, extra=extra)
        return encode(header, payload, None, self.manifest.model.vocab_size)

    def decode_backward(self, blob: bytes, stage: int) -> tuple[Header, torch.Tensor]:
        header, payload, _ = decode(blob, self.expectation(stage, "backward"))
        payload = payload.to(self.state.basis.device).float()
        grad = ss.decompress_grad(payload, self.state.basis) if self.compressed else payload
        return header, grad
