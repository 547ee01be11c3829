"""One context-parallel lane of one stage for one trip: the computation a lane peer runs, step by step.

Lane c of a stage holds chunk c (n tokens) of every sequence of a trip. Per layer it projects its
chunk (`payload`: what it sends to lanes > c), waits for lanes < c, then attends and runs the MLP
(`complete`). Backward is cut per layer (`backward_layer`): lane c gets the gradients of its own
payload from lanes > c, sums them, and returns the gradients of what it received to lanes < c. The
calls are synchronous and short, so a peer's event loop can wait for messages between them; nothing
here touches the network. `swarm.cp_wire.wire_step` (the simulator's wire path) drives P of these
in one process, so the per-chunk, per-layer logic exists once.

Every layer of a lane is its own graph: the layer's input is a leaf, received Z and θ are leaves (their
gradients are the backward messages), and a layer's graph is freed as soon as its backward is done.
Parameter gradients go to a per-trip buffer (`torch.autograd.grad`), not to `.grad`: a peer interleaves
many trips and optimizer steps on one thread, and a step must never see half a trip. `apply_grads`
adds the whole trip at once. If such a step changed the weights in place between a layer's forward and
its backward, autograd refuses the saved graph and the lane recomputes that layer alone, from its kept
input and received messages, with the current weights (`PipelineStage.backward_or_recompute`, the
stage's one rule for a stale graph). Hooks registered on a Parameter (the constrained
tensors' gradient projection of `PipelineStage`) run under `autograd.grad` as under `.backward`, so the
buffer holds projected gradients; the projection is linear, so the lanes' sum equals the one-graph
gradient.

The stage is a `swarm.model.PipelineStage` whose layers' attention is a `swarm.cp_attention.CPAttention`
(a run's stage, or `swarm.cp_model.CPDecoder`, the whole model as one stage).
"""

from __future__ import annotations

import torch

from swarm.cp_attention import CPAttention
from swarm.model import PipelineStage, predicted_loss
from swarm.wire import ErrorCode, WireError

KV = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # Z_k, Z_v, θ (or K, V, None dense); or their gradients


def _leaf(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().requires_grad_(True)


def _or_zeros(grads, received: torch.Tensor | None) -> torch.Tensor | None:
    """The next gradient of a received tensor from `grads` (zeros if it did not reach the loss); None for none."""
    if received is None:
        return None
    grad = next(grads)
    return grad if grad is not None else torch.zeros_like(received)


class _Layer:
    """One layer's graph: the input leaf, what was sent, what was received, the output."""

    def __init__(self, x_in, q, k_full, v_full, payload, theta):
        self.x_in, self.q, self.k_full, self.v_full, self.payload, self.theta = x_in, q, k_full, v_full, payload, theta
        self.received: dict[int, KV] = {}
        self.out: torch.Tensor | None = None


class LaneTrip:
    """Lane `lane` of `stage` for one trip. `tokens`: the chunk's tokens (B, n), always (the head embeds
    them, the boundary projection anchors on them, the tail predicts them); `hidden`: the chunk's
    boundary input (B, n, d) on every stage but the head. The order of calls is the swarm's: per layer
    `payload` then `complete`, then `output` (or `loss` on the tail), `backward_output` (not on the tail),
    per layer from the top `backward_layer`, then `input_grad` and `apply_grads`."""

    def __init__(self, stage: PipelineStage, lane: int, tokens: torch.Tensor, hidden: torch.Tensor | None = None):
        self.stage, self.lane, self.tokens = stage, lane, tokens
        blocks = list(stage.layers)
        if not blocks or not all(isinstance(block.attn, CPAttention) for block in blocks):
            raise ValueError("a lane runs a stage with layers whose attention is context-parallel")
        self.attns = {block.attn.layer: (block, block.attn) for block in blocks}
        self.order = [block.attn.layer for block in blocks]
        self.spec = blocks[0].attn.spec
        self.size = self.spec.size
        if not 0 <= lane < self.size:
            raise ValueError(f"lane {lane} out of range 0..{self.size - 1}")
        self.modes = {layer: attn.mode for layer, (_, attn) in self.attns.items()}  # fixed for the whole trip
        param = next(stage.parameters())
        self.dtype, self.device = param.dtype, param.device
        layer_params = {id(p) for block in blocks for p in block.parameters()}
        self.edge_params = [p for p in stage.parameters() if p.requires_grad and id(p) not in layer_params]
        self.grads: dict[torch.nn.Parameter, torch.Tensor] = {}  # this trip's parameter gradients
        self.layers: dict[int, _Layer] = {}
        self.batch, self.chunk_len = tokens.shape
        if self.size * self.chunk_len > stage.rope_cos.shape[0]:
            raise ValueError(f"{self.size} chunks of {self.chunk_len} tokens exceed the model's context")
        if stage.is_head:
            self.input = None
        else:
            if hidden is None:
                raise ValueError("a lane of a stage other than the head needs its chunk's boundary input")
            if tuple(hidden.shape[:2]) != (self.batch, self.chunk_len):
                raise ValueError(f"input of shape {tuple(hidden.shape)} does not match the chunk's tokens")
            self.input = _leaf(hidden.to(self.device, self.dtype))
        self.entered = stage.enter(self.input, tokens)  # the entry step's graph: embedding(s) on the input
        self.hidden = _leaf(self.entered)
        self.done = 0  # layers completed forward
        self.top: torch.Tensor | None = None  # the last layer's output, leaf of the finishing step
        self.boundary: torch.Tensor | None = None  # the boundary output until its gradient arrives
        self.out_grad: torch.Tensor | None = None  # ∂L/∂(input of the layer whose backward is next)

    # -------------------------------------------------------------- forward

    def _block(self, layer: int) -> tuple:
        if layer not in self.attns:
            raise RuntimeError(f"layer {layer} is not one of this stage's layers {self.order}")
        return self.attns[layer]

    def payload(self, layer: int) -> KV | None:
        """Norm and projections of this chunk at `layer`; returns what lanes > c receive (Z_k, Z_v, θ
        compressed; K, V, None dense), detached, or None when this lane sends nothing (the last lane,
        unless its own block is rebuilt from its message)."""
        self._block(layer)
        if self.done == len(self.order) or layer != self.order[self.done] or layer in self.layers:
            raise RuntimeError(f"payload({layer}) out of order: {self.done} of layers {self.order} are complete")
        segment = self.layers[layer] = self._project(layer, self.hidden)
        if segment.payload is None:
            return None
        theta = None if segment.theta is None else segment.theta.detach()
        return segment.payload[0].detach(), segment.payload[1].detach(), theta

    def complete(self, layer: int, received: dict[int, KV]) -> None:
        """Rebuild every earlier lane's K/V from its message, attend at the right RoPE offsets, run the MLP."""
        self._block(layer)
        segment = self.layers.get(layer)
        if segment is None or segment.out is not None:
            raise RuntimeError(f"complete({layer}) needs payload({layer}) first, once")
        self._check(received, range(self.lane), self._widths(layer), "forward", layer)
        for src in range(self.lane):
            segment.received[src] = tuple(
                None if t is None else _leaf(t.to(self.device, self.dtype)) for t in received[src]
            )
        self._attend(layer, segment)
        self.hidden = _leaf(segment.out)
        self.done += 1

    def _project(self, layer: int, x_in: torch.Tensor) -> _Layer:
        block, attn = self.attns[layer]
        mode = self.modes[layer]
        q, k_full, v_full, theta = attn.project(block.attn_norm(x_in), mode)
        sent = attn.payload(k_full, v_full, theta, mode) if attn.sends(self.lane, mode) else None
        return _Layer(x_in, q, k_full, v_full, sent, theta)

    def _attend(self, layer: int, segment: _Layer) -> None:
        block, attn = self.attns[layer]
        mode = self.modes[layer]
        blocks = [attn.rebuild(*segment.received[src], mode) for src in range(self.lane)]
        p_k, p_v = segment.payload if segment.payload is not None else (None, None)
        blocks.append(attn.own_block(segment.k_full, segment.v_full, p_k, p_v, segment.theta, mode, True))
        x = segment.x_in + attn.attend(segment.q, blocks, self.stage.rope_cos, self.stage.rope_sin)
        segment.out = x + block.mlp(block.mlp_norm(x))
        segment.q = segment.k_full = segment.v_full = None  # held by the graph where needed, not by us

    def _recompute(self, layer: int) -> _Layer:
        """The layer's forward again, from its kept input and received leaves, with the current weights:
        an optimizer step between this trip's forward and backward changed them in place, and autograd
        refuses a graph whose saved weights changed. What this lane sent is not sent again (the runtime's
        whole-stage recompute makes the same compromise); the PCA statistics do not count it twice."""
        old, attn = self.layers[layer], self.attns[layer][1]
        stats, attn.stats = attn.stats, None
        try:
            segment = self._project(layer, old.x_in)
        finally:
            attn.stats = stats
        segment.received = old.received
        self._attend(layer, segment)
        self.layers[layer] = segment
        return segment

    def _finish(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.done != len(self.order):
            raise RuntimeError(f"{len(self.order) - self.done} layers are not complete yet")
        self.top = self.hidden
        return self.stage.finish(self.top, self.tokens)

    def output(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Not on the tail: the chunk's boundary output (detached) and the residual the boundary projection
        removed (for a subspace update; None when U does not move)."""
        if self.stage.is_tail:
            raise RuntimeError("the tail ends with loss(), not output()")
        self.boundary, residual = self._finish()
        return self.boundary.detach(), residual

    def backward_output(self, grad: torch.Tensor) -> None:
        """Not on the tail: ∂L/∂(boundary output) from the next stage's lane of this chunk."""
        if self.boundary is None:
            raise RuntimeError("backward_output needs output() first")
        if tuple(grad.shape) != tuple(self.boundary.shape):
            raise WireError(ErrorCode.WRONG_SHAPE, f"gradient {tuple(grad.shape)} for {tuple(self.boundary.shape)}")
        self._edge_backward(self.boundary, grad.to(self.device, self.boundary.dtype))
        self.boundary = None

    def loss(self, next_tokens: torch.Tensor | None, seq_len: int) -> float:
        """The tail: this chunk's share of the sequence's mean next-token loss, and its backward to the
        last layer. The chunk's targets are its tokens after the first and `next_tokens` (B,), the first
        token of the next chunk (None on the last lane); dividing the summed loss by the whole sequence's
        B·(seq_len − 1) predictions makes the lanes' losses sum to the sequence's mean loss."""
        if not self.stage.is_tail:
            raise RuntimeError("only the tail computes a loss")
        if seq_len != self.chunk_len * self.size:
            raise ValueError(f"a sequence of {seq_len} tokens is not {self.size} chunks of {self.chunk_len}")
        last = self.lane == self.size - 1
        if (next_tokens is None) != last:
            raise ValueError("every lane but the last needs the first token of the next chunk")
        logits, _ = self._finish()
        targets = self.tokens[:, 1:]
        if next_tokens is not None:
            targets = torch.cat([targets, next_tokens.reshape(-1, 1).to(targets)], dim=1)
        value = predicted_loss(logits, targets, reduction="sum") / (self.batch * (seq_len - 1))
        self._edge_backward(value, None)
        return float(value.detach())

    def _edge_backward(self, root: torch.Tensor, grad: torch.Tensor | None) -> None:
        """Backward through the finishing step (boundary projection, or norm, LM head and loss)."""
        found = torch.autograd.grad(root, [self.top, *self.edge_params], grad, allow_unused=True)
        self.out_grad = found[0]
        self._keep(self.edge_params, found[1:])
        self.top = None

    # -------------------------------------------------------------- backward

    def backward_layer(self, layer: int, grads: dict[int, KV]) -> dict[int, KV]:
        """Backward of `layer` given ∂L/∂(this lane's payload) from every lane > c (summed here); returns
        ∂L/∂(what lane j sent) for every j < c, to send back to j. Frees the layer's graph."""
        block, _ = self._block(layer)
        if self.out_grad is None or not self.layers or layer != max(self.layers, key=self.order.index):
            raise RuntimeError(f"backward_layer({layer}) out of order")
        segment = self.layers[layer]
        receivers = range(self.lane + 1, self.size) if segment.payload is not None else range(0)
        self._check(grads, receivers, self._widths(layer), "backward", layer)
        width = 2 if segment.theta is None else 3
        summed = [sum(grads[dst][i].to(self.device, self.dtype) for dst in receivers) for i in range(width) if grads]
        params = [p for p in block.parameters() if p.requires_grad]
        found = self.stage.backward_or_recompute(
            lambda stale: self._layer_grads(self._recompute(layer) if stale else segment, summed, params)
        )
        segment = self.layers[layer]  # the recomputed one, if the saved graph was stale
        self.out_grad = found[0]  # never None: the residual path
        rest = iter(found[1:])
        back = {src: tuple(_or_zeros(rest, t) for t in segment.received[src]) for src in sorted(segment.received)}
        self._keep(params, list(rest))
        del self.layers[layer]
        return back

    def _layer_grads(self, segment: _Layer, summed: list, params: list) -> tuple:
        """∂/∂(layer input, received leaves by sender, parameters) of the layer's output (gradient
        `out_grad`) and of this lane's payload (gradients `summed`, when it has receivers)."""
        roots, root_grads = [segment.out], [self.out_grad]
        if summed:
            roots += [*segment.payload, segment.theta][: len(summed)]
            root_grads += summed
        leaves = [t for src in sorted(segment.received) for t in segment.received[src] if t is not None]
        return torch.autograd.grad(roots, [segment.x_in, *leaves, *params], root_grads, allow_unused=True)

    def input_grad(self) -> torch.Tensor | None:
        """After every layer's backward: ∂L/∂(chunk input) to send upstream, or None at the head; the
        entry step's embedding gradients go to the trip's buffer here."""
        if self.layers or self.out_grad is None:
            raise RuntimeError("input_grad needs every layer's backward first")
        grad, self.out_grad = self.out_grad, None
        inputs = [] if self.input is None else [self.input]
        found = torch.autograd.grad(self.entered, [*inputs, *self.edge_params], grad, allow_unused=True)
        self._keep(self.edge_params, found[len(inputs):])
        self.entered = None
        return found[0] if inputs else None

    def _keep(self, params, found) -> None:
        for param, grad in zip(params, found, strict=True):
            if grad is not None:
                self.grads[param] = grad if param not in self.grads else self.grads[param] + grad

    def apply_grads(self) -> None:
        """Add this trip's parameter gradients to `.grad`, all at once (then the buffer is empty)."""
        with torch.no_grad():
            for param, grad in self.grads.items():
                if param.grad is None:
                    param.grad = grad.detach().clone()
                else:
                    param.grad += grad
        self.grads = {}

    # -------------------------------------------------------------- checks

    def _widths(self, layer: int) -> tuple[int, int, int]:
        """Values per token of a message's K and V parts, θ values per sequence."""
        return self.spec.message_widths(self.modes[layer], self.attns[layer][1].d_kv)

    def _check(self, messages: dict[int, KV], lanes: range, widths, kind: str, layer: int) -> None:
        """The messages of `layer` are exactly one per lane of `lanes`, each of the run's shapes."""
        if set(messages) != set(lanes):
            missing, extra = sorted(set(lanes) - set(messages)), sorted(set(messages) - set(lanes))
            raise WireError(
                ErrorCode.MALFORMED, f"layer {layer} {kind}: lane {self.lane} lacks lanes {missing}, got extra {extra}"
            )
        width_k, width_v, n_theta = widths
        expected = ((self.batch, self.chunk_len, width_k), (self.batch, self.chunk_len, width_v))
        for other, message in messages.items():
            if not isinstance(message, tuple) or len(message) != 3:
                raise WireError(ErrorCode.MALFORMED, f"layer {layer} {kind} from lane {other} is not (K, V, θ)")
            z_k, z_v, theta = message
            shapes = tuple(None if t is None else tuple(t.shape) for t in (z_k, z_v))
            theta_shape = None if theta is None else tuple(theta.shape)
            theta_ok = theta_shape == ((self.batch, n_theta) if n_theta else None)
            if shapes != expected or not theta_ok:
                got = (*shapes, theta_shape)
                raise WireError(
                    ErrorCode.WRONG_SHAPE,
                    f"layer {layer} {kind} from lane {other}: shapes {got}, expected {expected} and θ {n_theta}",
                )
