"""How small is an honest gradient? Its norm against the samples it averages (issue 26: why a sender of g/10 is
not banned for its norm).

A stage's peers send the mean gradient of the samples they accumulated in an epoch, weighted by that count (capped
at the median). A volunteer with a GPU accumulates many times the samples a laptop does, and its mean gradient holds
less of the microbatches' noise, so its norm is smaller: while the noise dominates, the norm of a mean over n
microbatches falls towards the expected gradient's as 1/sqrt(n). A sender of g/10 also sends a small norm pointing
along the others' average. This measures the honest side: the tiny preset's two stages on real text (trained by
AdamW on batches of 4 microbatches up to each checkpoint), then the norm of each stage's gradient averaged over n
microbatches, `--repeats` draws each, as a ratio to the median norm over the fewest microbatches given (one, by
default) at the same weights.

    OMP_NUM_THREADS=1 python benchmarks/gradient_norms.py --json benchmarks/results/gradient-norms.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarm.data import load_splits  # noqa: E402
from swarm.model import PipelineStage, next_token_loss  # noqa: E402
from swarm.presets import preset  # noqa: E402


def gradient_norms(stages: list[PipelineStage], batches, microbatches: int) -> list[float]:
    """Each stage's gradient norm, the gradient averaged over `microbatches` drawn from `batches`."""
    for stage in stages:
        stage.zero_grad(set_to_none=True)
    for _ in range(microbatches):
        tokens, hidden = batches(), None
        for stage in stages:
            hidden, _ = stage.forward_with_residual(hidden, tokens)
        (next_token_loss(hidden, tokens) / microbatches).backward()
    return [float(torch.cat([p.grad.reshape(-1) for p in stage.parameters() if p.grad is not None]).norm())
            for stage in stages]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=int, nargs="+", default=[0, 30, 120], help="optimizer steps")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--data", default="builtin:stdlib")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    manifest = preset("tiny", stages=2)
    train, _ = load_splits(manifest, args.data, seed=args.seed)
    size = manifest.batch.microbatch_size

    def draw() -> torch.Tensor:
        return train.batch(size)

    stages = [PipelineStage(manifest, index) for index in range(manifest.num_stages)]
    optimizer = torch.optim.AdamW([p for stage in stages for p in stage.parameters()], lr=manifest.optimizer.lr)
    results, step = [], 0
    for checkpoint in sorted(args.checkpoints):
        while step < checkpoint:
            gradient_norms(stages, draw, 4)
            optimizer.step()
            step += 1
        norms = {n: [gradient_norms(stages, draw, n) for _ in range(args.repeats)]
                 for n in args.microbatches}
        for index in range(len(stages)):
            one = statistics.median(d[index] for d in norms[min(norms)])
            row = dict(step=checkpoint, stage=index, median_norm_of_one=one,
                       ratio={n: dict(median=statistics.median(d[index] for d in draws) / one,
                                      min=min(d[index] for d in draws) / one, max=max(d[index] for d in draws) / one)
                              for n, draws in norms.items()})
            results.append(row)
            ratios = ", ".join(f"{n} microbatches ×{r['median']:.2f} [{r['min']:.2f}, {r['max']:.2f}]"
                               for n, r in row["ratio"].items())
            print(f"step {checkpoint} stage {index}: {ratios}", file=sys.stderr, flush=True)
    report = dict(preset="tiny", data=args.data, seed=args.seed, repeats=args.repeats, results=results)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
