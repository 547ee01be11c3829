"""One hostile peer of four in a stage: does the stage still train? (issue 26)

A stage served by four peers averages their gradients every optimizer step (hivemind's butterfly all-reduce:
the flattened gradient is cut into four parts, peer j reduces part j for everyone). This benchmark trains the
tiny preset (2 stages, `boundary`, every boundary through the real codec) as synchronous data parallelism over
four peers: each step every peer computes the gradient of its own microbatch on the same weights, stage 1's
four gradients are averaged by the rule under test, stage 0's by a plain mean, and the result is applied.
Peer 3 of stage 1 is hostile in one way per run:

- as a sender: `nan`, `huge` (1e4 × its gradient), `sign` (−g), `half-sign` (−g on every other value: its cosine
  to the others' is about zero), `sign40` (−g on two of every five values: its cosine stays above zero, where the
  direction check does not look, so it measures what a sender of −g hidden that way costs), `scale10`, `scale0.1`,
  `random` (a random direction of the honest norm), `weight` (an honest gradient sent with weight 1e9);
- as a reducer of its part: `reducer-noise` (the mean plus noise of 10× its norm), `reducer-sign` (−mean);
- `absent`, a reference, not an attack: peer 3 is not in the group (its microbatch is drawn and dropped, so the
  honest peers see the same data as in every other run): what training on three peers' gradients costs, the
  floor for an attacker the rule excludes.

The rule is `robust` (swarm/robust.py, what the peers run: CenteredClip per part, reduced parts checked by
each honest peer, findings weighed into accusations by swarm/evidence.py (but not `PartChanges`: here each
peer reduces the same part every step, so its own change is the reference), the direction of each reducer's
used part judged each step (`Alignment`, weighed by its own `Evidence(ALIGNMENT)`) and of each sender's part
(`SenderDirection`, `direction_findings`, the same), an accused peer left out of every later group, so its share of
the parts is reduced by the honest peers) or `mean` (hivemind's plain weighted
mean, for contrast). An honest peer's view is applied (peer 0's: where it refuses a reduced part it keeps its own
gradient for that slice). What it does not model: the network (the wiring is tested on real hivemind
averagers in tests/test_robust_averaging.py), state averaging (all peers hold the same weights here), and
peers drifting apart where they kept their own slice.

The number is the held-out loss after the same tokens, as a ratio to the all-honest robust run of the same
seed, the step at which peer 0 first accused the hostile peer, and how often it accused an honest one (counted,
not acted on). The held-out loss is the mean of `TAIL_EVALS`
evaluations over the last steps (`--tail-every` apart), so that one step's jitter does not decide a 5% bound.

    OMP_NUM_THREADS=1 python benchmarks/robust_stage.py --json benchmarks/results/robust-stage.json --jobs 2

The JSON is rewritten after every run and a rerun skips what it holds (resumable).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarm.data import load_splits  # noqa: E402
from swarm.evidence import ALIGNMENT, Evidence  # noqa: E402
from swarm.model import build_stages  # noqa: E402
from swarm.optim import clip_grad_norm, lr_at, make_optimizer  # noqa: E402
from swarm.presets import preset  # noqa: E402
from swarm.robust import (  # noqa: E402
    Alignment,
    Finding,
    RobustRule,
    check_reduced,
    direction_findings,
    relative_change,
    robust_average,
)
from swarm.simulate import evaluate, run_trip  # noqa: E402

PEERS, HOSTILE = 4, 3
SENDER_ATTACKS = ["nan", "huge", "sign", "half-sign", "sign40", "scale10", "scale0.1", "random", "weight"]
REDUCER_ATTACKS = ["reducer-noise", "reducer-sign"]
ATTACKS = ["none", "absent", *SENDER_ATTACKS, *REDUCER_ATTACKS]
TAIL_EVALS = 5  # evaluations averaged over the run's last steps


def hostile_contribution(attack: str, grad: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, float]:
    """What peer 3 sends for its gradient `grad`, and the weight it claims."""
    if attack == "nan":
        return torch.full_like(grad, float("nan")), 1.0
    if attack == "huge":
        return 1e4 * grad, 1.0
    if attack == "sign":
        return -grad, 1.0
    if attack in ("half-sign", "sign40"):
        index = torch.arange(grad.numel())
        negated = index % 2 == 1 if attack == "half-sign" else index % 5 >= 3
        return torch.where(negated, -grad, grad), 1.0
    if attack == "scale10":
        return 10 * grad, 1.0
    if attack == "scale0.1":
        return 0.1 * grad, 1.0
    if attack == "random":
        noise = torch.randn(grad.shape, generator=generator)
        return noise * (grad.norm() / noise.norm()), 1.0
    if attack == "weight":
        return grad, 1e9
    return grad, 1.0


def hostile_reduction(attack: str, average: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    if attack == "reducer-noise":
        noise = torch.randn(average.shape, generator=generator)
        return average + noise * (10 * average.norm() / noise.norm())
    if attack == "reducer-sign":
        return -average
    return average


class Stage1Averaging:
    """Peer 0's view of stage 1's all-reduce, over the four peers' flattened gradients."""

    def __init__(self, rule: str, attack: str, seed: int):
        self.rule, self.attack = rule, attack
        self.robust = RobustRule()
        self.banned = False
        self.accused_at: int | None = None
        self.evidence = Evidence()  # peer 0's: when findings against a peer add up to an accusation
        self.alignment_evidence = Evidence(ALIGNMENT)  # peer 0's, for the direction of each reducer's part
        self.direction_evidence = Evidence(ALIGNMENT)  # peer 0's, for the direction of each sender's part
        self.honest_accused = 0  # accusations of an honest peer by peer 0 (counted, not acted on)
        self.generator = torch.Generator().manual_seed(10_000 + seed)

    def average(self, grads: list[torch.Tensor], step: int) -> torch.Tensor:
        sent = [(g, 1.0) for g in grads]
        if self.attack == "absent":
            sent[HOSTILE] = (grads[HOSTILE], 0.0)
        if self.attack in SENDER_ATTACKS:
            sent[HOSTILE] = hostile_contribution(self.attack, grads[HOSTILE], self.generator)
        bounds = [round(i * grads[0].numel() / PEERS) for i in range(PEERS + 1)]
        own = grads[0]
        reduced: list[torch.Tensor] = []
        for j in range(PEERS):
            parts = [g[bounds[j] : bounds[j + 1]] for g, _ in sent]
            weights = [w for _, w in sent]
            if self.rule == "mean":
                total = sum(weights)
                part = sum(w * p for p, w in zip(parts, weights, strict=True)) / total
            else:
                keep = [i for i in range(PEERS) if not ((self.banned or self.attack == "absent") and i == HOSTILE)]
                aggregate = robust_average([parts[i] for i in keep], [weights[i] for i in keep], parts[0].shape)
                part = own[bounds[j] : bounds[j + 1]] if aggregate is None else aggregate.average
                if aggregate is not None and j == 0:  # peer 0 judges the senders of the part it reduces
                    refused = {n: Finding(why, math.inf) for n, why in aggregate.refused.items()}
                    for n, finding in (refused | aggregate.judged).items():
                        self._judge(keep[n], step, finding, values=parts[0].numel())
                    for n, finding in direction_findings(aggregate.directions, self.robust).items():
                        if keep[n] != 0:  # a peer does not judge itself
                            self._judge(keep[n], step, finding, self.direction_evidence)
            # a banned peer is in no later group (`peer/robust_averaging.py` `ExcludingMatchmaking`): the honest
            # peers split its share of the parts among themselves, so every part is theirs to reduce
            if j == HOSTILE and self.attack in REDUCER_ATTACKS and not (self.rule == "robust" and self.banned):
                part = hostile_reduction(self.attack, part, self.generator)
            reduced.append(part)
        if self.rule == "robust":
            reduced = self._checked(reduced, own, bounds, step)
        return torch.cat(reduced)

    def _checked(self, reduced: list[torch.Tensor], own: torch.Tensor, bounds: list[int], step: int):
        """Peer 0 reduced part 0 itself: the others are checked against how far that moved its own part."""
        honest_change = relative_change(own[bounds[0] : bounds[1]], reduced[0])
        typical_rms = float(own[bounds[0] : bounds[1]].float().pow(2).mean().sqrt())
        for j in range(1, PEERS):
            mine = own[bounds[j] : bounds[j + 1]]
            finding = check_reduced(mine, reduced[j] - mine, honest_change, self.robust, typical_rms=typical_rms)
            if finding is not None:
                reduced[j] = mine
            if j == HOSTILE and self.banned:
                continue
            self._judge(j, step, finding, values=mine.numel())
            if finding is not None:  # a refused part is not applied, so not judged for its direction
                continue
            alignment = Alignment()
            alignment.add(mine, reduced[j])
            if alignment.judged:
                self._judge(j, step, alignment.finding(self.robust), self.alignment_evidence)
        return reduced

    def _judge(self, peer: int, step: int, finding: Finding | None, evidence: Evidence | None = None,
               values: int | None = None) -> None:
        if (evidence or self.evidence).judge(peer, step, finding, values) is None:
            return
        if peer != HOSTILE:
            self.honest_accused += 1
        elif not self.banned:
            self.banned, self.accused_at = True, step


def run(point: dict) -> dict:
    torch.set_num_threads(1)
    seed, steps = point["seed"], point["steps"]
    manifest = preset("tiny", stages=2)
    torch.manual_seed(seed)
    stages = build_stages(manifest)
    optimizers = [make_optimizer(stage) for stage in stages]
    train, held_out = load_splits(manifest, None, seed=seed)
    validation = held_out.fixed_batches(manifest.batch.microbatch_size, 8)
    averaging = Stage1Averaging(point["rule"], point["attack"], seed)
    params = [list(stage.parameters()) for stage in stages]
    started, skipped, tail = time.perf_counter(), 0, []
    tail_steps = {steps - 1 - k * point["tail_every"] for k in range(TAIL_EVALS if point["tail_every"] else 1)}
    for step in range(steps):
        per_peer: list[list[torch.Tensor]] = [[], []]
        for _ in range(PEERS):
            run_trip(stages, train.batch(manifest.batch.microbatch_size))
            for s, stage_params in enumerate(params):
                grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in stage_params]
                per_peer[s].append(torch.cat(grads))
            for stage in stages:
                stage.zero_grad(set_to_none=True)
        averaged = [torch.stack(per_peer[0]).mean(0), averaging.average(per_peer[1], step)]
        skipped += int(not torch.isfinite(averaged[1]).all())
        for stage, stage_params, flat, optimizer in zip(stages, params, averaged, optimizers, strict=True):
            offset = 0
            for p in stage_params:
                p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            clip_grad_norm(stage.parameters(), manifest.optimizer.grad_clip)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, manifest.optimizer.lr, manifest.optimizer.warmup_steps)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if step in tail_steps:
            tail.append(evaluate(stages, validation))
    return {
        **point,
        "val_loss": tail[-1],
        "val_loss_tail": statistics.mean(tail),
        "accused_at": averaging.accused_at,
        "honest_accused": averaging.honest_accused,
        "accusation": ACCUSATION,
        "skipped_steps": skipped,
        "finite": all(torch.isfinite(p).all().item() for stage_params in params for p in stage_params),
        "seconds": time.perf_counter() - started,
    }


GROUPS = "excluded"  # how a banned peer is treated: left out of later groups; runs before this kept it in ("kept")
# findings weighed by swarm/evidence.py, reducers' and senders' directions by `ALIGNMENT`; runs before judged no
# sender's direction ("evidence+alignment"), no direction at all ("evidence") or accused at the first finding
# ("at-once")
ACCUSATION = "evidence+alignment+direction"


def counts_now(run: dict) -> bool:
    """Whether a run holds under the current `GROUPS` and `ACCUSATION`: it ran under that accusation rule, and
    under that treatment of a banned peer or with nobody banned (then the two compute the same)."""
    groups = run.get("groups", "kept") == GROUPS or run["accused_at"] is None
    return groups and run.get("accusation", "at-once") == ACCUSATION


def key(point: dict) -> tuple:
    return (point["rule"], point["attack"], point["seed"], point["steps"], point.get("tail_every", 0),
            point.get("groups", "kept"), point.get("accusation", "at-once"))


def report(results: list[dict], steps: int, tail_every: int) -> str:
    """The table in RESULTS: the runs of `steps` steps evaluated `tail_every` apart (runs made before tail
    evaluations existed read as `tail_every` 0: the last step's loss alone)."""
    def of(rule: str, attack: str) -> list[dict]:
        """The runs of this point that hold now (`counts_now`), one per seed."""
        found = {}
        for r in results:
            if (r["rule"], r["attack"], r["steps"], r.get("tail_every", 0)) == (rule, attack, steps, tail_every) and (
                    counts_now(r)):
                found.setdefault(r["seed"], r)
        return list(found.values())

    def loss(result: dict) -> float:
        return result.get("val_loss_tail", result["val_loss"])

    honest = {r["seed"]: loss(r) for r in of("robust", "none")}
    lines = [
        "| attack on peer 3 of 4 | rule | seeds | held-out loss / all-honest robust, mean [min, max] "
        "| accused at step | honest peers accused | weights finite |",
        "|---|---|---|---|---|---|---|",
    ]
    for attack in ATTACKS:
        for rule in ("robust", "mean"):
            rows = [r for r in of(rule, attack) if r["seed"] in honest]
            if not rows:
                continue
            ratios = [loss(r) / honest[r["seed"]] for r in rows]
            accused = sorted({r["accused_at"] for r in rows}, key=lambda a: (a is None, a))
            spread = f"×{statistics.mean(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]"
            when = ", ".join("never" if a is None else str(a) for a in accused)
            counted = rule == "robust" and all("honest_accused" in r for r in rows)  # older runs did not count
            falsely = sum(r["honest_accused"] for r in rows) if counted else "—"
            finite = all(r["finite"] for r in rows)
            lines.append(f"| {attack} | {rule} | {len(rows)} | {spread} | {when} | {falsely} | {finite} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--attacks", nargs="+", default=ATTACKS, choices=ATTACKS)
    parser.add_argument("--rules", nargs="+", default=["robust", "mean"], choices=["robust", "mean"])
    parser.add_argument("--tail-every", type=int, default=4,
                        help="steps between the last evaluations averaged (0: the last step's alone)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    results = json.loads(args.json.read_text()) if args.json.exists() else []
    done = {key({**r, "groups": GROUPS, "accusation": ACCUSATION}) for r in results if counts_now(r)}
    points = [
        {"rule": rule, "attack": attack, "seed": seed, "steps": args.steps, "tail_every": args.tail_every,
         "groups": GROUPS, "accusation": ACCUSATION}
        for seed in args.seeds
        for attack in args.attacks
        for rule in args.rules
    ]
    points = [p for p in points if key(p) not in done] if not args.report_only else []
    print(f"{len(points)} runs to do, {len(results)} held", flush=True)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        for future in as_completed([pool.submit(run, p) for p in points]):
            result = future.result()
            results.append(result)
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=1))
            print(
                f"{result['rule']:>6} {result['attack']:>13} seed {result['seed']}: val {result['val_loss']:.4f} "
                f"accused {result['accused_at']} ({result['seconds']:.0f} s)",
                flush=True,
            )
    print(report(results, args.steps, args.tail_every))


if __name__ == "__main__":
    main()
