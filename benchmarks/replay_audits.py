"""Recorded honest audits against the audit rules: how close honest pairs came to each bound, and what verdicts the
rules of this checkout give on them.

Reads the comparisons benchmarks/audit_pairs.py recorded (every `benchmarks/results/audit-pairs*.json` but the
lanes', or the files named), every peer honest, so each verdict is a false positive. Reports the single cosines
below `COSINE_MIN`, the lowest median of a pair's last `FLIP_WINDOW` cosines, the highest median norm ratio over a
pair's last `DRIFT_WINDOW` audits within 1, 2 and 3 epochs, and the verdicts of `Ledger.flip` and `Ledger.drift`
(one ledger per driver) run over them in order. Older files do not name the peers: their windows run over a run's
audits in order. A single loss check is not replayed (which reply came from the older weights is not recorded): the
recorded verdict says whether a comparison's losses were past their tolerance when it was made (or, since
`Ledger.losses_apart`, weighed as a gap), and those are run through `Ledger.losses_apart`, which judges two verified
peers' loss gaps over their last `LOSS_WINDOW` comparisons (whether both were verified is not recorded: every
comparison is weighed, newcomers' too, which live are judged on one). On lane forks (`--lanes`: the
`audit-pairs-lanes*.json` files), judged on one, single loss differences are held against `LANE_LOSS_RTOL` without
any slack (those within `AUDIT_MAX_LAG` epochs, the ones compared), cosines against `Ledger.flip` (lane forks are
not weighed for drift).

    python benchmarks/replay_audits.py [--lanes] [FILE ...]
    python benchmarks/replay_audits.py --liar-shares 0.05 0.1 0.3 0.5 1
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections import defaultdict, deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peer.audit import (  # noqa: E402
    AUDIT_MAX_LAG,
    COSINE_MIN,
    DRIFT_WINDOW,
    FLIP_WINDOW,
    LANE_LOSS_RTOL,
    LOSS_RTOL,
    LOSS_WINDOW,
    Agreement,
    Ledger,
)
from peer.next_hop import LOSS_GAP_WEIGHED, NOT_JUDGED  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def recorded_runs(files: list[Path]):
    """(file name, run index, its comparisons with an epoch lag) for every run in `files`."""
    for path in files:
        for index, run in enumerate(json.loads(path.read_text()).get("runs", [])):
            pairs = [pair for pair in run.get("pairs", []) if pair.get("lag") is not None]
            if pairs:
                yield path.name, index, pairs


def pair_key(pair: dict) -> tuple:
    return pair.get("observer"), frozenset((pair.get("primary"), pair.get("shadow")))


def worst_norm_windows(runs: list, max_lag: int) -> tuple[int, list]:
    """How many windows of `DRIFT_WINDOW` audits within `max_lag` epochs there were, and the highest medians."""
    medians = []
    for name, index, pairs in runs:
        windows: dict[tuple, deque] = defaultdict(lambda: deque(maxlen=DRIFT_WINDOW))
        for at, pair in enumerate(pairs):
            if pair["lag"] > max_lag or not pair.get("norm_ratio"):
                continue
            window = windows[pair_key(pair)]
            window.append(abs(math.log(pair["norm_ratio"])))
            if len(window) == DRIFT_WINDOW:
                medians.append((round(math.exp(statistics.median(window)), 2), name, index, at))
    return len(medians), sorted(medians, reverse=True)[:3]


def loss_gap(pair: dict) -> bool | None:
    """Whether a pipeline comparison's losses were apart past their tolerance, as its recorded verdict says; None
    where it was not weighed live: a loss missing, weights too far apart to compare, or not judged (a verdict on its
    pair landed while it was in flight)."""
    if pair["loss_rdiff"] is None or pair["lag"] > AUDIT_MAX_LAG or pair["verdict"].startswith(NOT_JUDGED):
        return None
    return pair["verdict"].startswith(("losses", LOSS_GAP_WEIGHED))


def audits_to_a_loss_verdict(share: float, trials: int = 20000, seed: int = 0) -> float:
    """The mean number of audits until `Ledger.losses_apart` judges a verified pair whose liar forges its loss on a
    random `share` of its audits (each forgery a gap, each other audit none); the one-audit rule's is 1 / share."""
    rng, total = random.Random(seed), 0
    for _ in range(trials):
        ledger, audits, judged = Ledger(), 0, False
        while not judged:
            audits += 1
            gap = Agreement(0.5 if rng.random() < share else 0.0, (1.0, 1.0), None, True)
            judged = ledger.losses_apart("honest", "liar", gap, LOSS_RTOL)
        total += audits
    return total / trials


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lanes", action="store_true", help="the lane forks' recorded audits")
    parser.add_argument("--liar-shares", nargs="+", type=float, metavar="P",
                        help="instead: the mean audits until a verified liar forging its loss on a share P of its "
                             "audits is judged, under the loss window and under the one-audit rule")
    parser.add_argument("files", nargs="*", type=Path)
    args = parser.parse_args()
    if args.liar_shares:
        print(json.dumps({p: {"window": round(audits_to_a_loss_verdict(p), 1), "one audit": round(1 / p, 1)}
                          for p in args.liar_shares}))
        return
    recorded = sorted(RESULTS.glob("audit-pairs*.json"))
    files = args.files or [p for p in recorded if ("lanes" in p.name) == args.lanes]
    runs = list(recorded_runs(files))
    singles, flip_medians, verdicts, loss_verdicts, audits = [], [], [], [], 0
    for name, index, pairs in runs:
        windows: dict[tuple, deque] = defaultdict(lambda: deque(maxlen=FLIP_WINDOW))
        ledgers: dict[str | None, Ledger] = defaultdict(Ledger)
        for at, pair in enumerate(pairs):
            ledger, (a, b) = ledgers[pair.get("observer")], (pair.get("primary", "a"), pair.get("shadow", "b"))
            gap = None if args.lanes else loss_gap(pair)
            if gap is not None:  # the recorded difference against a tolerance it was past, or one it was not
                seen = Agreement(pair["loss_rdiff"], (1.0, 1.0), None, True)
                if ledger.losses_apart(a, b, seen, 0.0 if gap else math.inf):
                    loss_verdicts.append((name, index, at, pair["verdict"]))
            if pair["cosine"] is None:
                continue
            audits += 1
            if pair["cosine"] < COSINE_MIN:
                singles.append((round(pair["cosine"], 3), name, index, at))
            window = windows[pair_key(pair)]
            window.append(pair["cosine"])
            if len(window) == FLIP_WINDOW:
                flip_medians.append((round(statistics.median(window), 3), name, index, at))
            seen = Agreement(pair["loss_rdiff"], (1.0, pair["norm_ratio"] or 1.0), pair["cosine"], True)
            why = ledger.flip(a, b, seen) or (None if args.lanes else ledger.drift(a, b, seen, pair["lag"]))
            if why:
                verdicts.append((name, index, at, why))
    report = {
        "files": len(files), "runs": len(runs), "audits": audits,
        f"single cosines below {COSINE_MIN}": singles,
        f"lowest medians of {FLIP_WINDOW} cosines": sorted(flip_medians)[:3],
        **{f"norm windows within {lag} epochs (count, highest medians)": worst_norm_windows(runs, lag)
           for lag in (1, 2, 3)},
        "verdicts of Ledger.flip" + ("" if args.lanes else " and Ledger.drift"): verdicts,
    }
    if not args.lanes:
        report["loss gaps recorded"] = sum(bool(loss_gap(pair)) for _, _, pairs in runs for pair in pairs)
        report[f"verdicts of Ledger.losses_apart (most of a pair's last {LOSS_WINDOW})"] = loss_verdicts
    if args.lanes:
        losses = sorted(pair["loss_rdiff"] for _, _, pairs in runs for pair in pairs
                        if pair["loss_rdiff"] is not None and pair["lag"] <= AUDIT_MAX_LAG)  # farther: not compared
        report[f"loss differences within {AUDIT_MAX_LAG} epochs"] = {
            "comparisons": len(losses), "largest": losses[-3:],
            f"past LOSS_RTOL ({LOSS_RTOL:.3g})": sum(rdiff > LOSS_RTOL for rdiff in losses),
            f"past LANE_LOSS_RTOL ({LANE_LOSS_RTOL:.3g})": sum(rdiff > LANE_LOSS_RTOL for rdiff in losses),
        }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
