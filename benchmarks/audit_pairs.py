"""How far two honest replies to one audit duplicate differ, and how often the audit policy calls an honest peer a
liar: its false positives.

A local swarm of real peers (the tiny preset, 2 stages x 2 peers, `protocol-swarm local`), every trip a driver
sends to a verified peer also duplicated to the other (`--audit-rate 1`, `PROTOCOL_PEER_AUDIT_RATE`), and every
comparison logged by the drivers at DEBUG (peer/next_hop.py). Every peer is honest, so each refusal (and the ban
that follows it) is a false positive. It reports how many pairs, the gradient cosine (min, 1st percentile,
median), the relative loss difference (max, 99th percentile, median), the ratio of the gradients' norms, and the
refusals with the reason each gave, every ban from a stage's averaging the peers logged (each one also of an
honest peer), and the reduced parts receivers refused (`refused_parts`: their sizes, and what they weigh as
evidence). With `--context-parallel 2` every stage has 2 lanes of 2 peers each and
every lane trip is forked for an audit (`peer/lane_claim.py`): the lane peers' comparisons, measured the same way.
Each run also reports how far a stage's replicas' weights were apart at the same epoch (`replica_drift`, from the
weights fingerprints each peer logs after every update, `swarm/fingerprint.py`) with the sizes of the gradient
groups that formed, and, with lanes, how many of the tail's lane forwards ran across a change of its weights
(`lane_forwards`).

    OMP_NUM_THREADS=1 python benchmarks/audit_pairs.py --steps 150 --runs 2 --json benchmarks/results/audit-pairs.json
    OMP_NUM_THREADS=1 python benchmarks/audit_pairs.py --context-parallel 2 --steps 60 \
        --json benchmarks/results/audit-pairs-lanes.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peer.audit import AUDIT_MAX_LAG, COSINE_MIN, LANE_LOSS_RTOL, LOSS_RTOL, LOSS_RTOL_PER_EPOCH  # noqa: E402
from peer.next_hop import LOSS_GAP_WEIGHED, NOT_JUDGED  # noqa: E402
from swarm.evidence import EvidenceRule  # noqa: E402
from swarm.fingerprint import relative_distance  # noqa: E402
from swarm.manifest import save_manifest  # noqa: E402
from swarm.presets import preset  # noqa: E402

LINE = re.compile(
    r"(?P<observer>\[[^\]]*\]|\S+) audit of (?P<shadow>\S+) against (?P<primary>\S+): "
    r"loss rdiff (?P<loss>\S+), cosine (?P<cosine>\S+), norms (?P<na>\S+) (?P<nb>\S+), "
    r"(?:epochs apart (?P<lag>\S+), )?(?P<verdict>.*)$"
)


def parse(log_text: str) -> list[dict]:
    """Every audit comparison a driver logged: who compared whom (the end of the peers' ids), its loss difference,
    cosine, norm ratio (and the shadow's norm over the primary's, as a log), how many epochs apart the two replies'
    weights were (None in logs from before replies carried epochs) and the tolerances' verdict."""
    pairs = []
    for line in log_text.splitlines():
        match = LINE.search(line)
        if not match:
            continue
        na, nb = float(match["na"]), float(match["nb"])
        pairs.append(
            dict(
                loss_rdiff=None if match["loss"] == "None" else float(match["loss"]),
                cosine=None if match["cosine"] == "None" else float(match["cosine"]),
                norm_ratio=max(na, nb) / min(na, nb) if min(na, nb) > 0 else math.inf,
                log_norm_ratio=math.log(nb / na) if min(na, nb) > 0 else None,
                observer=match["observer"], primary=match["primary"], shadow=match["shadow"],
                lag=None if match["lag"] in (None, "None") else int(match["lag"]),
                verdict=match["verdict"],
            )
        )
    return pairs


AVERAGING_BAN = re.compile(
    r"(?P<averager>\S+) banned peer \S+ from averaging for \S+ s: as an? (?P<role>\w+): (?P<why>.*)$")


def averaging_bans(log_text: str) -> list[dict]:
    """Every ban from a stage's averaging in the peers' logs (peer/robust_averaging.py): which averager (its
    prefix: gradients or state), as a sender or a reducer, and why. Every peer is honest: each is a false one."""
    return [dict(averager=m["averager"], role=m["role"], why=m["why"])
            for m in map(AVERAGING_BAN.search, log_text.splitlines()) if m]


REFUSED_PART = re.compile(
    r"robust_parts: (?:(?P<averager>\S+) )?refused reduced part \d+ of reducer \d+, (?P<values>\d+) values "
    r"\(not accused yet\): .*\(tensor (?P<tensor>\d+), part \d+\)$")


def refused_parts(log_text: str) -> dict:
    """Every reduced part a receiver refused without an accusation (peer/robust_parts.py; all honest: each is a
    false finding): how many, how many of fewer than `EvidenceRule.full_values` values (`vectors`: norm gains,
    biases, and the θ head's d × 2 weight too), what they weigh as evidence (`swarm/evidence.py`: each its values'
    share of a full part, at most 1) against what they weighed counted as whole parts, and the count by averager
    (its prefix names the stage; none in logs from before 1 Dec 2026), values and tensor index (an index into that
    stage's tensors)."""
    found = [(m["averager"] or "", int(m["values"]), int(m["tensor"]))
             for m in map(REFUSED_PART.search, log_text.splitlines()) if m]
    rule = EvidenceRule()
    return dict(parts=len(found), vectors=sum(values < rule.full_values for _, values, _ in found),
                weight=round(sum(rule.weight(values) for _, values, _ in found), 3),
                by_size_and_tensor={f"{averager} {values} values, tensor {tensor}".strip(): n
                                    for (averager, values, tensor), n in sorted(Counter(found).items())})


FINGERPRINT = re.compile(
    r"(?P<peer>\[\S+ stage (?P<stage>\d+)\]) epoch (?P<epoch>\d+) weights fingerprint: (?P<values>.*)$")
LANDED = re.compile(
    r"\[\S+ stage (?P<stage>\d+)\] epoch \d+ update landed: gradients (?P<group>\d+ peers|alone|failed)")


LANE_FORWARD = re.compile(r"lane trip \S+ lane \d+: loss \S+, weights changed (?P<changes>\d+) times in its forward")


def lane_forwards(log_text: str) -> dict:
    """The tail's lane forwards (peer/lane_trip.py logs each with its loss): how many, and how many ran while an
    update, a state average or a download changed the weights (their layers then used two versions)."""
    changes = [int(m["changes"]) for m in map(LANE_FORWARD.search, log_text.splitlines()) if m]
    return dict(forwards=len(changes), across_a_weights_change=sum(c > 0 for c in changes))


def replica_drift(log_text: str) -> dict:
    """How far each stage's replicas' weights were apart at the same epoch, from the fingerprints each peer logged
    after every update (`swarm/fingerprint.py`, peer/stage_optimizer.py): per stage, the relative distance of each
    pair of peers at every epoch both logged (quantiles, and each pair's median and largest), and how many peers
    each epoch's gradient round held, as each peer saw it."""
    prints: dict[str, dict[str, dict[int, list[float]]]] = defaultdict(lambda: defaultdict(dict))
    groups: dict[str, Counter] = defaultdict(Counter)
    for line in log_text.splitlines():
        if match := FINGERPRINT.search(line):
            prints[match["stage"]][match["peer"]][int(match["epoch"])] = [float(x) for x in match["values"].split()]
        elif match := LANDED.search(line):
            groups[match["stage"]][match["group"]] += 1
    stages = {}
    for stage, peers in sorted(prints.items()):
        distances, by_pair = [], {}
        for a, b in itertools.combinations(sorted(peers), 2):
            pair = [relative_distance(peers[a][e], peers[b][e]) for e in sorted(peers[a].keys() & peers[b].keys())]
            pair = [d for d in pair if d is not None]
            distances += pair
            if pair:
                by_pair[f"{a} {b}"] = dict(epochs=len(pair), median=quantile(pair, 0.5), max=max(pair))
        stages[stage] = dict(pairs_at_equal_epochs=len(distances), median=quantile(distances, 0.5),
                             p90=quantile(distances, 0.9), max=max(distances, default=None), by_pair=by_pair,
                             gradient_groups=dict(groups[stage]))
    return stages


def unjudged(pair: dict) -> bool:
    return pair["verdict"].startswith(NOT_JUDGED)


def weighed(pair: dict) -> bool:
    return pair["verdict"].startswith(LOSS_GAP_WEIGHED)


def too_far(pair: dict) -> bool:
    return pair.get("lag") is not None and pair["lag"] > AUDIT_MAX_LAG


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summary(pairs: list[dict]) -> dict:
    cosines = [p["cosine"] for p in pairs if p["cosine"] is not None]
    losses = [p["loss_rdiff"] for p in pairs if p["loss_rdiff"] is not None]
    ratios = [p["norm_ratio"] for p in pairs]
    return dict(
        pairs=len(pairs),
        cosine_min=min(cosines, default=None),
        cosine_p01=quantile(cosines, 0.01),
        cosine_median=quantile(cosines, 0.5),
        loss_rdiff_max=max(losses, default=None),
        loss_rdiff_p99=quantile(losses, 0.99),
        loss_rdiff_median=quantile(losses, 0.5),
        norm_ratio_max=max(ratios, default=None),
        norm_ratio_p99=quantile(ratios, 0.99),
        # a pair too many epochs apart is not compared (peer/audit.py): the tolerances' verdict on it is not used
        refused=[p["verdict"] for p in pairs
                 if p["verdict"] != "agree" and not too_far(p) and not unjudged(p) and not weighed(p)],
        # a loss gap between two verified peers that was not most of the pair's last few: no verdict (peer/audit.py)
        loss_gaps_weighed=[p["verdict"] for p in pairs if weighed(p)],
        # back after a verdict on its pair landed (peer/next_hop.py): logged, not judged
        not_judged=sum(unjudged(p) for p in pairs),
        not_compared=sum(too_far(p) for p in pairs),
        lag_max=max((p["lag"] for p in pairs if p.get("lag") is not None), default=None),
        tolerances=dict(cosine_min=COSINE_MIN, loss_rtol=LOSS_RTOL, lane_loss_rtol=LANE_LOSS_RTOL,
                        loss_rtol_per_epoch=LOSS_RTOL_PER_EPOCH),
    )


def run_swarm(steps: int, timeout: float, lanes: int, target_batch_size: int | None) -> tuple[dict, str]:
    """A local swarm whose drivers duplicate (with lanes: fork) every trip and log every comparison; its summary
    and peer logs. `target_batch_size`: the tiny preset with epochs of that many sequences (its own: 16, two
    microbatches, shorter than an averaging round, so a stage's peers step apart)."""
    env = dict(os.environ, PROTOCOL_PEER_AUDIT_RATE="1", PROTOCOL_PEER_LOG_LEVEL="DEBUG", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "launcher.cli", "local", "--stages", "2", "--peers-per-stage", "2",
               "--steps", str(steps), "--timeout", str(timeout), "--keep-logs", "--json"]
    if lanes > 1:
        command += ["--context-parallel", str(lanes)]
    if target_batch_size is not None:
        batch = preset("tiny", stages=2).batch.model_copy(update={"target_batch_size": target_batch_size})
        manifest = preset("tiny", stages=2, batch=batch)
        path = Path(tempfile.mkdtemp(prefix="audit-pairs-")) / "manifest.json"
        save_manifest(manifest, path)
        command += ["--manifest", str(path)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout + 120)
    if result.returncode != 0:
        raise SystemExit(f"the local swarm failed: {result.stderr[-2000:]}")
    run = json.loads(result.stdout.strip().splitlines()[-1])
    workdir = Path(run["workdir"])
    logs = "\n".join(path.read_text(errors="replace") for path in sorted(workdir.rglob("*.log")))
    return run, logs, workdir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--runs", type=int, default=1, help="swarms to run, each added to the runs in --json")
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--context-parallel", type=int, default=1, metavar="P", help="lanes per stage")
    parser.add_argument("--target-batch-size", type=int, help="sequences per optimizer epoch (tiny's own: 16)")
    parser.add_argument("--keep-logs", type=Path, metavar="DIR", help="keep the peer logs of a run that banned an "
                        "honest peer or weighed a loss gap here (one folder per run), to see what led to it")
    args = parser.parse_args()
    runs = json.loads(args.json.read_text())["runs"] if args.json.exists() else []  # resumable: runs accumulate
    for number in range(args.runs):
        print(f"run {number + 1} of {args.runs} ({len(runs)} recorded before)", file=sys.stderr, flush=True)
        run, logs, workdir = run_swarm(args.steps, args.timeout, args.context_parallel, args.target_batch_size)
        pairs = parse(logs)
        ban_lines = [line for line in logs.splitlines() if "audit: replies of" in line]  # all honest: false ones
        bans = len(ban_lines)
        averaging = averaging_bans(logs)
        gaps = sum(weighed(pair) for pair in pairs)
        if (bans or averaging or gaps) and args.keep_logs is not None:
            kept = args.keep_logs / f"run{len(runs) + 1}"
            shutil.copytree(workdir, kept, ignore=shutil.ignore_patterns("checkpoints", "*.sqlite*"))
            print(f"the logs of a run with {bans} + {len(averaging)} bans and {gaps} loss gaps weighed are in {kept}",
                  file=sys.stderr, flush=True)
        shutil.rmtree(workdir, ignore_errors=True)
        excused = sum("answered with weights" in line for line in logs.splitlines())
        runs.append(dict(target_batch_size=args.target_batch_size,
                         steps=run["steps"], loss_first=run.get("loss_first"), loss_last=run.get("loss_last"),
                         honest_peers_banned=bans, bans=[line.split("audit: ", 1)[1] for line in ban_lines],
                         averaging_bans=averaging, refused_parts=refused_parts(logs), lags_excused=excused,
                         replica_drift=replica_drift(logs),
                         lane_forwards=lane_forwards(logs),
                         summary=summary(pairs), pairs=pairs))
        everything = [pair for r in runs for pair in r["pairs"]]
        result = dict(summary=summary(everything), honest_peers_banned=sum(r["honest_peers_banned"] for r in runs),
                      honest_averaging_bans=sum(len(r.get("averaging_bans", ())) for r in runs), runs=runs)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
        print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1), flush=True)
        drift = {stage: {k: v for k, v in d.items() if k != "by_pair"}
                 for stage, d in runs[-1]["replica_drift"].items()}
        print(f"replicas' drift by stage: {json.dumps(drift)}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
