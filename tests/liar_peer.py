"""A real peer that turns liar: `protocol-peer` itself, except that once the file `--turn-file` exists every reply
it serves carries a forged input gradient (`--lie`: negated, scaled by 10 or by 0.1, or a random direction of the
honest norm), while its loss and epochs stay the honest ones; or (`--lie stale`, a tail only) the loss and input
gradient of the run's initial weights, while it claims the epochs of the weights it holds now (a peer that never
kept up and answers from old weights; weights only a few epochs old are not told from an honest lagging peer's,
docs/DESIGN.md §4, and in CI a copy taken at its first trip, after its download, was caught only at its 44th
audit). It trains on its own honest gradients, so it
holds the stage's weights, averages with the stage and answers at the speed of an honest peer (the stale one
after a second forward and backward): a verified peer that turns liar (issue 26). A pipeline peer forges its trips'
replies, a lane peer (`--lane`) its lane trips' (the K/V gradients it sends its lane partners stay honest). Used by
tests/test_liar_swarm.py and tests/test_lane_swarm.py.

    python tests/liar_peer.py --turn-file F [--lie negate|scale10|scale0.1|random|stale] <protocol-peer's arguments>
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from peer import cli, lane_trip, trip
from swarm.model import PipelineStage, next_token_loss

LIES = {
    "negate": lambda grad: -grad,
    "scale10": lambda grad: 10 * grad,
    "scale0.1": lambda grad: 0.1 * grad,
    "random": lambda grad: (noise := torch.randn_like(grad)) * (grad.norm() / noise.norm()),
}


def initial_weights(stage: PipelineStage) -> PipelineStage:
    """A tail stage as the run's manifest initialises it, on the live stage's device."""
    if not stage.is_tail:
        raise ValueError("the stale liar serves from a tail stage only")
    return PipelineStage(stage.manifest, stage.index).to(next(stage.parameters()).device).requires_grad_(False)


def stale_reply(old: PipelineStage, hidden: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The input gradient and loss that `old`'s weights give this trip (the honest turn has run on the live
    weights already; nothing here touches them or their gradients)."""
    leaf = hidden.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        output, _ = old.forward_with_residual(leaf, tokens)
        loss = next_token_loss(output, tokens)
        (grad,) = torch.autograd.grad(loss, leaf)
    return grad, float(loss)


def lying(turn, turn_file: Path, lie: str):
    """`Hop.turn` (or `LaneHop.turn`), forging every reply once `turn_file` exists: its input gradient with
    `LIES[lie]`, or with `stale` its loss and input gradient from the run's initial weights (module docstring)."""
    told = False
    old: PipelineStage | None = None

    async def forged(self, header, hidden, tokens, sender):
        nonlocal told, old
        result = await turn(self, header, hidden, tokens, sender)
        if turn_file.exists() and result.input_grad is not None:
            if not told:
                logging.getLogger("peer").warning("liar: %s input gradients from trip %s on", lie, header.trip_id[:8])
                told = True
            if lie == "stale":
                if old is None:
                    old = await self.runtime.run(initial_weights, self.runtime.stage)
                grad, result.loss = await self.runtime.run(stale_reply, old, hidden, tokens)
                result.input_grad = grad.to(result.input_grad)  # its dtype and device
            else:
                result.input_grad = LIES[lie](result.input_grad)
        return result

    return forged


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turn-file", type=Path, required=True)
    parser.add_argument("--lie", choices=sorted([*LIES, "stale"]), default="negate")
    args, peer_args = parser.parse_known_args()
    trip.Hop.turn = lying(trip.Hop.turn, args.turn_file, args.lie)
    lane_trip.LaneHop.turn = lying(lane_trip.LaneHop.turn, args.turn_file, args.lie)
    sys.exit(cli.main(peer_args))


if __name__ == "__main__":
    main()
