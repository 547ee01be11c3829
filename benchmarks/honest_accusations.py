"""Does the robust rule accuse honest peers? Replicas' real gradients, cut as hivemind cuts them (issue 26).

A stage's peers average their gradients part by part (hivemind's butterfly all-reduce; a part is the bytes
`GradientWire.FP16` sets, 131,072 fp16 values); the reducer of each part runs
`swarm/robust.py` `robust_average`, which accuses a sender whose part lies far from the others. Here `--peers`
honest replicas of the tiny preset's two stages (the same weights, each its own microbatch of real text, the
backward of the whole pipeline in one process) give their gradients, each stage's flattened gradient is cut
into those parts, and every part is reduced as a peer would. Every accusation is a false positive; the report
says how many contributions were accused, in which part, and which parameters that part holds.

    OMP_NUM_THREADS=1 python benchmarks/honest_accusations.py --rounds 20
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peer.stage_averagers import GradientWire  # noqa: E402
from swarm.data import load_splits  # noqa: E402
from swarm.model import PipelineStage, next_token_loss  # noqa: E402
from swarm.presets import preset  # noqa: E402
from swarm.robust import robust_average  # noqa: E402

PART = GradientWire.FP16.averager_options()["part_size_bytes"] // 2  # fp16 values per part, as the peers cut them


def part_contents(stage: PipelineStage) -> dict[int, list[str]]:
    """The parameters each part of the stage's flattened gradient holds (all of one, or pieces of several)."""
    holds: dict[int, list[str]] = {}
    offset = 0
    for name, param in stage.named_parameters():
        for part in range(offset // PART, (offset + param.numel() - 1) // PART + 1):
            holds.setdefault(part, []).append(name)
        offset += param.numel()
    return holds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--data", default="builtin:stdlib")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    manifest = preset("tiny", stages=2)
    train, _ = load_splits(manifest, args.data, seed=args.seed)
    stages = [PipelineStage(manifest, index) for index in range(manifest.num_stages)]
    accused: dict[int, Counter] = {index: Counter() for index in range(len(stages))}
    contributions = {index: 0 for index in range(len(stages))}
    for _ in range(args.rounds):
        grads: dict[int, list[torch.Tensor]] = {index: [] for index in range(len(stages))}
        for _peer in range(args.peers):
            tokens = train.batch(manifest.batch.microbatch_size)
            hidden = None
            for stage in stages:
                stage.zero_grad(set_to_none=True)
                hidden, _ = stage.forward_with_residual(hidden, tokens)
            next_token_loss(hidden, tokens).backward()
            for index, stage in enumerate(stages):
                grads[index].append(torch.cat([
                    (p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in stage.parameters()]))
        for index, flat in grads.items():
            for part, start in enumerate(range(0, flat[0].numel(), PART)):
                pieces = [g[start : start + PART] for g in flat]
                aggregate = robust_average(pieces, [float(manifest.batch.microbatch_size)] * args.peers,
                                           pieces[0].shape)
                contributions[index] += args.peers
                accused[index][part] += len(aggregate.accused)
    report = {}
    for index, stage in enumerate(stages):
        holds = part_contents(stage)
        report[f"stage {index}"] = dict(
            contributions=contributions[index],
            accused=sum(accused[index].values()),
            parts={part: dict(accused=n, holds=holds[part]) for part, n in sorted(accused[index].items()) if n},
        )
    print(json.dumps(dict(rounds=args.rounds, peers=args.peers, data=args.data, values_per_part=PART, **report),
                     indent=1))


if __name__ == "__main__":
    main()
