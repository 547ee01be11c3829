"""A real peer whose gradient averaging is hostile: `protocol-peer` itself, except that in every gradient round its
averager sends the group a forged copy of its gradients (`--send`: NaN, the negated gradients, or 1e4 times them)
instead of its own. It serves its trips honestly, so the audits have nothing against it: only the stage's
averaging can find it (issue 26). The forged copy takes the round's results, so the peer's own gradients stay its
own and it keeps stepping on them, as a careless or hostile volunteer would. Used by tests/test_averaging_swarm.py.

    python tests/hostile_averager_peer.py --send nan|sign|huge <protocol-peer's arguments>
"""

from __future__ import annotations

import argparse
import logging
import math
import multiprocessing
import sys

import torch

from peer import cli
from peer.robust_averaging import RobustAveraging

FORGERIES = {
    "nan": lambda tensor: torch.full_like(tensor, math.nan),
    "sign": lambda tensor: -tensor,
    "huge": lambda tensor: 1e4 * tensor,
}


def forging(run_allreduce, send: str):
    """`RobustAveraging._run_allreduce_inplace_`, handing a gradient round's runner forged copies of the tensors
    (a state round's are left honest). hivemind's averager process is forked from this one, so the patch holds
    there."""
    told = False

    async def forged(self, tensors, group_info, group_id=None, **kwargs):
        nonlocal told
        if "grad_averager" in self.prefix:
            if not told:
                logging.getLogger("peer").warning("hostile averager: sending %s gradients from now on", send)
                told = True
            tensors = [FORGERIES[send](tensor.detach().clone()) for tensor in tensors]
        return await run_allreduce(self, tensors, group_info, group_id, **kwargs)

    return forged


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--send", choices=sorted(FORGERIES), default="nan")
    args, peer_args = parser.parse_known_args()
    if multiprocessing.get_start_method() != "fork":
        sys.exit("hostile_averager_peer.py patches the averager in this process: it needs the 'fork' start method")
    RobustAveraging._run_allreduce_inplace_ = forging(RobustAveraging._run_allreduce_inplace_, args.send)
    sys.exit(cli.main(peer_args))


if __name__ == "__main__":
    main()
