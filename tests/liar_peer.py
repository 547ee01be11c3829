"""A real peer that turns liar: `protocol-peer` itself, except that once the file `--turn-file` exists every reply
it serves carries its input gradient negated, while its loss and epochs stay the honest ones. It trains on its own
honest gradients, so it holds the stage's weights and answers at the speed of an honest peer: a verified peer that
turns liar (issue 26). Used by tests/test_liar_swarm.py.

    python tests/liar_peer.py --turn-file F <protocol-peer's arguments>
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from peer import cli, trip


def lying(turn, turn_file: Path):
    """`Hop.turn`, negating the input gradient of every reply once `turn_file` exists."""
    told = False

    async def forged(self, header, hidden, tokens, sender):
        nonlocal told
        result = await turn(self, header, hidden, tokens, sender)
        if turn_file.exists() and result.input_grad is not None:
            if not told:
                logging.getLogger("peer").warning("liar: negating input gradients from trip %s on", header.trip_id[:8])
                told = True
            result.input_grad = -result.input_grad
        return result

    return forged


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turn-file", type=Path, required=True)
    args, peer_args = parser.parse_known_args()
    trip.Hop.turn = lying(trip.Hop.turn, args.turn_file)
    sys.exit(cli.main(peer_args))


if __name__ == "__main__":
    main()
