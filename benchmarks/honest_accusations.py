"""Does the robust rule accuse honest peers? Replicas' real gradients, cut and reduced as hivemind does (issue 26).

A stage's peers average their gradients part by part (hivemind's butterfly all-reduce: each tensor is cut into parts
of the bytes `GradientWire.FP16` sets, 131,072 fp16 values; the leader shuffles the group's order and the parts go
to the peers in that order, a run of them each). Each part's reducer runs `swarm/robust.py` `robust_average`, which
finds a sender whose part lies far from the others; each receiver checks what the other reducers return with
`check_reduced`. Here `--peers` honest replicas of the tiny preset's two stages (the same weights, each its own
microbatch of real text, the backward of the whole pipeline in one process) give their gradients for `--rounds`
rounds; the replicas train on the robust average (AdamW at the preset's rate) so the rounds see a model that learns.
Every accusation is a false positive. The reduced-part check is scored two ways: `region`, against the change this
receiver's reduction made to its own parts this round (the rule until 27 Nov 2026), and `part`, against the larger
of that and the change it made to the same part when it last reduced it (`PartChanges`). Each receiver also judges
the direction of each reducer's round (`Alignment`, over the parts it used) with its own `Evidence(ALIGNMENT)`; the
report gives how many rounds fell below the floor and the most of any 8 consecutive rounds of one receiver and
reducer. Each reducer also judges the direction of each sender's parts of the round (`SenderDirection`, each part's
cosine weighted by its values and its clipped pull; the lowest of a round, below the floor and apart from the next:
`direction_findings`), weighed the same way. The same rounds also score a hostile replica (the last, on the parts it
reduced or sent honestly): a reducer returning noise of 10× the average's norm, or the negated average; a sender of
10× its gradient, of −1×, of −1× on every part but the first of each reducer's run, which it sends ×8 (clipped,
inside the accusation bound: it would outweigh the rest if a round's parts were judged joined end to end), or of −2×
on two parts of every five and 1× on the rest (twice −g's pull, inside the clip radius: by values alone it would
count as −g and the honest parts would hide it): how many parts the others refuse, and when they accuse it; and what
the honest replicas then make of each other (a hostile part moves every sender's clip radius and direction
reference): their direction findings and accusations under each attack.

`--peers 3` is a group of three (the hostile sender then half of each honest sender's reference); `--samples` gives
each replica its own number of microbatches, which is its weight as well (honest peers of unequal sample counts: a
replica of fewer samples sends a noisier gradient).

    OMP_NUM_THREADS=1 python benchmarks/honest_accusations.py --rounds 40
    OMP_NUM_THREADS=1 python benchmarks/honest_accusations.py --rounds 40 --samples 1 4 4 4
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch
from hivemind.averaging.partition import TensorPartContainer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peer.stage_averagers import GradientWire  # noqa: E402
from swarm.data import load_splits  # noqa: E402
from swarm.evidence import ALIGNMENT, Evidence, EvidenceRule  # noqa: E402
from swarm.model import PipelineStage, next_token_loss  # noqa: E402
from swarm.presets import preset  # noqa: E402
from swarm.robust import (  # noqa: E402
    Alignment,
    PartChanges,
    RobustRule,
    SenderDirection,
    capped_weights,
    check_reduced,
    direction_findings,
    robust_average,
)

RULE = RobustRule()
RULE_PART = GradientWire.FP16.averager_options()["part_size_bytes"] // 2  # fp16 values per part
# what the hostile sender multiplies a part by, given the part's index in its tensor and whether it is the first of
# its reducer's run this round
SENDER_ATTACKS = {
    "sender ×10": lambda part, first: 10.0,
    "sender sign": lambda part, first: -1.0,
    "sender one part ×8, the rest sign": lambda part, first: 8.0 if first else -1.0,  # clipped, not accused
    "sender 2 parts of 5 ×(−2)": lambda part, first: -2.0 if part % 5 < 2 else 1.0,  # inside the clip radius
}
ATTACKS = ("reducer noise", "reducer sign", *SENDER_ATTACKS)
DIRECTIONS = ("direction", "sender direction")  # roles judged once per round, by `Evidence(ALIGNMENT)`


def regions(tensors: list[torch.Tensor], peers: int) -> list[list[tuple[int, int]]]:
    """The parts (tensor index, part index) each position of a group reduces, as hivemind assigns them."""
    container = TensorPartContainer(tensors, [1.0] * peers, **GradientWire.FP16.averager_options())
    return [[(info.key, info.part_index) for _, info in parts] for parts in container._input_parts_by_peer]


def evidences(role: str, peers: int, part_rule: EvidenceRule) -> list[Evidence]:
    """Each replica's `Evidence` for one role: by rounds for the roles of `DIRECTIONS`, by parts (`part_rule`) for
    the rest."""
    return [Evidence(ALIGNMENT if role in DIRECTIONS else part_rule) for _ in range(peers)]


def first_accusations(by_role) -> dict[str, int]:
    """Each observer's first round of accusing, over the roles given (observer -> round, one dict per role)."""
    first: dict[int, int] = {}
    for rounds in by_role:
        for observer, step in rounds.items():
            first[observer] = min(step, first.get(observer, step))
    return {str(o): step for o, step in sorted(first.items())}


def hostile(attack: str, average: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """What a hostile reducer returns instead of the `average` it reduced."""
    if attack == "reducer noise":
        noise = torch.randn(average.shape, generator=generator)
        return average + noise * (10 * average.norm() / noise.norm())
    return -average


def under_attack(finding, verdicts: dict[str, dict], sender: int) -> dict:
    """`sender`'s finding under each attack of `ATTACKS`: the all-honest `finding` where the attack leaves the round
    alone, the attacked round's verdict (`verdicts[attack]`, by sender) where it changes it, and no entry where that
    round did not judge the sender at all."""
    attacked = {attack: finding for attack in ATTACKS if attack not in verdicts}
    attacked |= {attack: judged[sender] for attack, judged in verdicts.items() if sender in judged}
    return attacked


class Stage:
    """One stage's replicas for the whole run: each round's parts, each rule's findings, and the accusations each
    replica's `Evidence` makes, all honest and with the last replica hostile in each way of `ATTACKS`."""

    def __init__(self, stage: PipelineStage, weights: list[float], lr: float, part_rule: EvidenceRule):
        self.params = list(stage.parameters())
        self.names = [name for name, _ in stage.named_parameters()]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr)
        self.weights, self.peers = weights, len(weights)  # each replica's weight: the samples it averaged
        capped = capped_weights(weights, RULE.weight_cap)
        self.weight_shares = [len(capped) * w / sum(capped) for w in capped]  # against an equal share, as peers see
        self.memory = [PartChanges(RULE.reduced_memory) for _ in range(self.peers)]
        self.judged = Counter()  # parts judged, by role
        self.findings = {"sender": Counter(), "reducer region": Counter(), "reducer part": Counter()}
        roles = ("part", *DIRECTIONS)
        # each replica's, all replicas honest
        self.honest = {role: evidences(role, self.peers, part_rule) for role in roles}
        self.accusations: list[dict] = []
        self.attacked = {(role, attack): evidences(role, self.peers, part_rule) for role in roles for attack in ATTACKS}
        self.away: dict[tuple[int, int], list[bool]] = defaultdict(list)  # (receiver, reducer): rounds below the floor
        self.sender_away: dict[tuple[int, int], list[bool]] = defaultdict(list)  # (reducer, sender): rounds lowest
        self.sender_cosines: list[float] = []  # honest senders' cosines of a round to the others' clipped average
        self.attack_findings = Counter()
        self.attack_judged = Counter()
        # attack -> evidence ("part" or a role of `DIRECTIONS`) -> observer -> the round of its first accusation of the
        # hostile replica on that evidence
        self.caught: dict[str, dict[str, dict[int, int]]] = {attack: defaultdict(dict) for attack in ATTACKS}
        # the honest replicas' verdicts on each other while the last one attacks: evidence, findings, accusations
        self.attacked_honest = {(role, attack): evidences(role, self.peers, part_rule) for role in roles
                                for attack in ATTACKS}
        self.honest_direction_findings = Counter()  # attack -> honest senders' direction findings under it
        self.accused_under_attack: dict[str, list[dict]] = defaultdict(list)

    def _judge(self, step: int, observer: int, suspect: int, role: str, honest, attacked: dict,
               values: int | None = None) -> None:
        """One judged part of `suspect` by `observer`, of `values` values (or, for the roles of `DIRECTIONS`, one
        round's direction of a reducer or a sender): `honest` its finding in the all-honest round, `attacked` what it
        is under each attack (the honest finding where the attack does not touch this part)."""
        kind = role if role in DIRECTIONS else "part"
        why = self.honest[kind][observer].judge(suspect, step, honest, values)
        if why:
            self.accusations.append(dict(round=step, observer=observer, suspect=suspect, role=role, why=why))
        hostile = self.peers - 1
        if observer in (suspect, hostile):  # nobody judges itself; the hostile replica's verdicts do not count
            return
        for attack, finding in attacked.items():
            if suspect != hostile:
                self.honest_direction_findings[attack] += role == "sender direction" and finding is not None
                why = self.attacked_honest[kind, attack][observer].judge(suspect, step, finding, values)
                if why:
                    self.accused_under_attack[attack].append(
                        dict(round=step, observer=observer, suspect=suspect, role=role, why=why))
                continue
            if kind == "part":
                self.attack_judged[attack] += 1
                self.attack_findings[attack] += finding is not None
            evidence = self.attacked[kind, attack][observer]
            if evidence.judge(suspect, step, finding, values) and observer not in self.caught[attack][kind]:
                self.caught[attack][kind][observer] = step

    def round(self, step: int, grads: list[list[torch.Tensor]], rng: random.Random, gen: torch.Generator) -> None:
        order = list(range(self.peers))
        rng.shuffle(order)  # position -> replica, as the leader shuffles the group
        runs = regions(grads[0], self.peers)
        reducer_of = {key: order[position] for position, parts in enumerate(runs) for key in parts}
        firsts = {parts[0] for parts in runs if parts}
        pieces = {key: [g[key[0]].reshape(-1).split(RULE_PART)[key[1]] for g in grads] for key in reducer_of}
        averages = {}
        hostile_part = self.peers - 1
        # (reducer, "honest" or a sender attack) -> sender -> its direction over the parts of the round
        directions: dict[tuple[int, str], dict[int, SenderDirection]] = defaultdict(
            lambda: defaultdict(SenderDirection))
        for key, contributions in pieces.items():
            weights, shape = self.weights, contributions[0].shape
            aggregate = robust_average(contributions, weights, shape, RULE)
            sent = {attack: robust_average([*contributions[:-1], factor(key[1], key in firsts) * contributions[-1]],
                                           weights, shape, RULE) for attack, factor in SENDER_ATTACKS.items()}
            averages[key] = aggregate.average
            for name, reduced in (("honest", aggregate), *sent.items()):
                for sender, direction in reduced.directions.items():
                    directions[reducer_of[key], name][sender].merge(direction)
            for sender, finding in aggregate.judged.items():
                self.judged["sender"] += 1
                self.findings["sender"][self.names[key[0]]] += finding is not None
                # the hostile part moves every sender's radius: judged there too, or not judged at all under that attack
                attacked = under_attack(finding, {attack: reduced.judged for attack, reduced in sent.items()}, sender)
                self._judge(step, reducer_of[key], sender, "sender", finding, attacked, contributions[0].numel())
        for reducer in range(self.peers):
            verdicts = {name: direction_findings(directions[reducer, name], RULE)
                        for name in ("honest", *SENDER_ATTACKS)}
            self.sender_cosines += [d.cosine for d in directions[reducer, "honest"].values() if d.cosine is not None]
            for sender, finding in verdicts["honest"].items():
                self.sender_away[reducer, sender].append(finding is not None)
                attacked = under_attack(finding, {attack: verdicts[attack] for attack in SENDER_ATTACKS}, sender)
                if sender != reducer:  # a peer does not judge itself
                    self._judge(step, reducer, sender, "sender direction", finding, attacked)
        for receiver in range(self.peers):
            own = [key for key, reducer in reducer_of.items() if reducer == receiver]
            moved = sum(float((averages[k] - pieces[k][receiver]).norm()) ** 2 for k in own)
            norm = sum(float(pieces[k][receiver].norm()) ** 2 for k in own)
            honest = (moved / max(norm, 1e-30)) ** 0.5
            typical = (norm / max(sum(pieces[k][receiver].numel() for k in own), 1)) ** 0.5  # per-value RMS
            memory = self.memory[receiver]
            for key in own:
                x = pieces[key][receiver]
                memory.record(key, float((averages[key] - x).norm()) / max(float(x.norm()), 1e-30))
            alignments = defaultdict(Alignment)  # (reducer, "honest" or an attack): its used parts this round
            for key, reducer in reducer_of.items():
                if reducer == receiver:
                    continue
                x = pieces[key][receiver]
                self.judged["reducer"] += 1
                region = check_reduced(x, averages[key] - x, honest, RULE)
                self.findings["reducer region"][self.names[key[0]]] += region is not None
                finding = check_reduced(x, averages[key] - x, honest, RULE, memory.reference(key), typical)
                self.findings["reducer part"][self.names[key[0]]] += finding is not None
                attacked = {attack: finding for attack in ATTACKS}
                returned = {attack: averages[key] for attack in ATTACKS}
                if reducer == hostile_part:
                    for attack in ("reducer noise", "reducer sign"):
                        returned[attack] = hostile(attack, averages[key], gen)
                        attacked[attack] = check_reduced(x, returned[attack] - x, honest, RULE, memory.reference(key),
                                                         typical)
                self._judge(step, receiver, reducer, "reducer", finding, attacked, x.numel())
                for name, used in (("honest", finding), *attacked.items()):
                    if used is None:  # a refused part is not applied, so not judged for its direction
                        alignments[reducer, name].add(x, averages[key] if name == "honest" else returned[name])
            for reducer in {r for r, _ in alignments}:
                verdict = {name: alignments[reducer, name] for name in ("honest", *ATTACKS)}
                share = self.weight_shares[receiver]
                findings = {name: a.finding(RULE, share) for name, a in verdict.items() if a.judged}
                if "honest" in findings:
                    self.away[receiver, reducer].append(findings["honest"] is not None)
                    attacked = {attack: findings[attack] for attack in ATTACKS if attack in findings}
                    self._judge(step, receiver, reducer, "direction", findings["honest"], attacked)
        for index, param in enumerate(self.params):
            parts = sum(1 for key in averages if key[0] == index)
            param.grad = torch.cat([averages[(index, part)] for part in range(parts)]).reshape(param.shape)
        self.optimizer.step()

    def report(self) -> dict:
        return dict(
            parts_judged=dict(self.judged),
            findings={rule: sum(c.values()) for rule, c in self.findings.items()},
            findings_by_tensor={rule: {name: n for name, n in c.items() if n} for rule, c in self.findings.items()},
            rounds_pointing_away=dict(
                judged=sum(len(flags) for flags in self.away.values()),
                below_the_floor=sum(sum(flags) for flags in self.away.values()),
                most_in_8_consecutive=max((sum(flags[i : i + 8]) for flags in self.away.values()
                                           for i in range(len(flags))), default=0)),
            senders_pointing_away=dict(
                judged=sum(len(flags) for flags in self.sender_away.values()),
                lowest_and_apart=sum(sum(flags) for flags in self.sender_away.values()),
                most_in_8_consecutive=max((sum(flags[i : i + 8]) for flags in self.sender_away.values()
                                           for i in range(len(flags))), default=0),
                by_round=[sum(flags[step] for flags in self.sender_away.values() if step < len(flags))
                          for step in range(max(map(len, self.sender_away.values()), default=0))],
                cosine_quantiles=[round(q, 3) for q in torch.tensor(self.sender_cosines).quantile(
                    torch.tensor([0.0, 0.01, 0.1, 0.5])).tolist()] if self.sender_cosines else []),
            honest_accusations=self.accusations,
            attacks={attack: dict(parts_judged=self.attack_judged[attack], findings=self.attack_findings[attack],
                                  accused_by=first_accusations(self.caught[attack].values()),
                                  accused_by_evidence={kind: first_accusations([by]) for kind, by in
                                                       sorted(self.caught[attack].items())},
                                  honest_direction_findings=self.honest_direction_findings[attack],
                                  honest_accused=self.accused_under_attack[attack])
                     for attack in ATTACKS},
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--data", default="builtin:stdlib")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--samples", type=int, nargs="+",
                        help="microbatches each replica's gradient averages, one number per replica (default 1 each); "
                             "its weight in the average, capped at the median as the peers cap it")
    parser.add_argument("--full-values", type=int, default=EvidenceRule.full_values,
                        help="values from which a judged part weighs one judgement as evidence (smaller parts weigh "
                             "their share; 1: every part weighs 1, the rule before 1 Dec 2026)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    samples = args.samples or [1] * args.peers
    if len(samples) != args.peers or min(samples) < 1:
        parser.error(f"--samples needs {args.peers} positive numbers, one per replica")
    if args.full_values < 1:
        parser.error("--full-values needs a positive number")
    torch.manual_seed(args.seed)
    rng, generator = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    manifest = preset("tiny", stages=2)
    train, _ = load_splits(manifest, args.data, seed=args.seed)
    modules = [PipelineStage(manifest, index) for index in range(manifest.num_stages)]
    part_rule = EvidenceRule(full_values=args.full_values)
    stages = [Stage(module, [float(n) for n in samples], manifest.optimizer.lr, part_rule) for module in modules]
    for step in range(args.rounds):
        grads: list[list[list[torch.Tensor]]] = [[] for _ in modules]
        losses = []
        for microbatches in samples:
            for module in modules:
                module.zero_grad(set_to_none=True)
            for _ in range(microbatches):
                tokens = train.batch(manifest.batch.microbatch_size)
                hidden = None
                for module in modules:
                    hidden, _ = module.forward_with_residual(hidden, tokens)
                loss = next_token_loss(hidden, tokens) / microbatches
                loss.backward()
                losses.append(float(loss) * microbatches)
            for index, module in enumerate(modules):
                grads[index].append(
                    [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in module.parameters()])
        for index, stage in enumerate(stages):
            stage.round(step, grads[index], rng, generator)
        print(f"round {step + 1}/{args.rounds}: loss {sum(losses) / len(losses):.3f}", file=sys.stderr, flush=True)
    report = dict(rounds=args.rounds, peers=args.peers, samples=samples, data=args.data, seed=args.seed,
                  values_per_part=RULE_PART, full_values=args.full_values,
                  **{f"stage {index}": stage.report() for index, stage in enumerate(stages)})
    text = json.dumps(report, indent=1, ensure_ascii=False)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
