"""A real peer that turns liar: `protocol-peer` itself, except that once the file `--turn-file` exists every reply
it serves carries a forged input gradient (`--lie`: negated, scaled by 10 or by 0.1, or a random direction of the
honest norm), while its loss and epochs stay the honest ones. It trains on its own honest gradients, so it holds
the stage's weights and answers at the speed of an honest peer: a verified peer that turns liar (issue 26). Used
by tests/test_liar_swarm.py.

    python tests/liar_peer.py --turn-file F [--lie negate|scale10|scale0.1|random] <protocol-peer's arguments>
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from peer import cli, trip

LIES = {
    "negate": lambda grad: -grad,
    "scale10": lambda grad: 10 * grad,
    "scale0.1": lambda grad: 0.1 * grad,
    "random": lambda grad: (noise := torch.randn_like(grad)) * (grad.norm() / noise.norm()),
}


def lying(turn, turn_file: Path, lie: str):
    """`Hop.turn`, forging the input gradient of every reply with `LIES[lie]` once `turn_file` exists."""
    told = False

    async def forged(self, header, hidden, tokens, sender):
        nonlocal told
        result = await turn(self, header, hidden, tokens, sender)
        if turn_file.exists() and result.input_grad is not None:
            if not told:
                logging.getLogger("peer").warning("liar: %s input gradients from trip %s on", lie, header.trip_id[:8])
                told = True
            result.input_grad = LIES[lie](result.input_grad)
        return result

    return forged


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turn-file", type=Path, required=True)
    parser.add_argument("--lie", choices=sorted(LIES), default="negate")
    args, peer_args = parser.parse_known_args()
    trip.Hop.turn = lying(trip.Hop.turn, args.turn_file, args.lie)
    sys.exit(cli.main(peer_args))


if __name__ == "__main__":
    main()
