"""Tables and plots of `benchmarks/frontier.py`'s JSON rows: kept apart from the training so a report
can be redrawn from any finished (or half finished) file without importing torch's training code.

A point is (corpus, split, T_fixed std, stage embedding, mode, wire dtype, k). Its learning rate is
picked by `lr_sweep.best_lr`; `edge` says that lr was the lowest or the highest tried (or the only
one), so the optimum may lie outside the sweep. The ratio is paired by seed against the *best* dense
bf16 point of the same corpus and split (over every std and stage embedding tried), each at its own
best learning rate; `ratio_same` against dense bf16 at the point's own std and stage embedding. A
point is on the frontier when no point of its corpus and split with at most its bytes has a lower loss.
Rows written before the std, stage-embedding and split axes existed read as std 0.02, none, 2 stages.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from lr_sweep import best_lr

Point = tuple[str, int, float, int, str, str, int]  # corpus, stages, T_fixed std, stage embedding, mode, dtype, k
DENSE_WIRE = ("none", "dense-ts")


def _setting(row: dict) -> tuple[int, float, int]:
    return row.get("stages", 2), row.get("t_fixed_std", 0.02), row.get("stage_embedding", 0)


def _by_point(rows: list[dict], kind: str) -> dict[Point, dict[float, list[dict]]]:
    grouped: dict[Point, dict[float, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if row["kind"] == kind and "error" not in row:
            k = 0 if row["mode"] in DENSE_WIRE else row["k"]
            grouped[(row["corpus"], *_setting(row), row["mode"], row["dtype"], k)][row["lr"]].append(row)
    return grouped


def _paired(point: dict, reference: dict | None) -> tuple[float, tuple[float, float]]:
    base = reference["seeds"] if reference else {}
    ratios = [loss / base[seed] for seed, loss in point["seeds"].items() if seed in base]
    if not ratios:
        return float("nan"), (float("nan"), float("nan"))
    return statistics.fmean(ratios), (min(ratios), max(ratios))


def best(rows: list[dict], kind: str = "frontier") -> list[dict]:
    """One summary per point at its best learning rate, sorted by corpus, split and bytes."""
    out = []
    for (corpus, stages, std, embedding, mode, dtype, k), per_lr in _by_point(rows, kind).items():
        lr = best_lr({value: [r["val_loss"] for r in runs] for value, runs in per_lr.items()})
        mine = sorted(per_lr[lr], key=lambda r: r["seed"])
        tried = sorted(per_lr)
        edge = "single" if len(tried) == 1 else "low" if lr == tried[0] else "high" if lr == tried[-1] else ""
        out.append(dict(
            corpus=corpus, stages=stages, t_fixed_std=std, stage_embedding=embedding, mode=mode, dtype=dtype, k=k,
            lr=lr, lrs_tried=tried, edge=edge, seeds={r["seed"]: r["val_loss"] for r in mine},
            val_loss=statistics.fmean(r["val_loss"] for r in mine),
            val_std=statistics.stdev([r["val_loss"] for r in mine]) if len(mine) > 1 else 0.0,
            bytes=statistics.fmean(r["bytes_per_token"] for r in mine), formula=mine[0]["formula_bytes"],
            tokens=mine[0]["tokens"], steps=mine[0]["steps"],
            max_reconstruction_error=max(r["max_reconstruction_error"] for r in mine),
        ))
    for corpus, stages in {(p["corpus"], p["stages"]) for p in out}:
        mine = sorted((p for p in out if (p["corpus"], p["stages"]) == (corpus, stages)),
                      key=lambda p: (p["bytes"], p["val_loss"]))
        dense = [p for p in mine if (p["mode"], p["dtype"]) == ("none", "bf16")]
        # the best dense: most seeds first (a mean over other seeds is not comparable), then the lowest mean
        reference = min(dense, key=lambda p: (-len(p["seeds"]), p["val_loss"]), default=None)
        lowest = float("inf")
        for p in mine:
            p["frontier"] = p["val_loss"] < lowest
            lowest = min(lowest, p["val_loss"])
            p["ratio"], p["ratio_range"] = _paired(p, reference)
            same = next((d for d in dense if (d["t_fixed_std"], d["stage_embedding"]) ==
                         (p["t_fixed_std"], p["stage_embedding"])), None)
            p["ratio_same"] = _paired(p, same)[0]
            p["best_dense"] = reference is not None and p is reference
            p["dense_share"] = p["bytes"] / reference["bytes"] if reference else float("nan")
    return sorted(out, key=lambda p: (p["corpus"], p["stages"], p["bytes"], p["val_loss"]))


def markdown(rows: list[dict], settings: dict) -> str:
    points = best(rows)
    lines: list[str] = []
    if points:
        lines += [
            f"settings: {settings}; bytes = measured per token per boundary, forward + backward, headers included "
            "(formula: payload only); ratio = paired per-seed val loss / the best dense bf16 of the corpus and split "
            "(marked ‡), mean [min, max]; same = / dense bf16 at the row's own std and stage embedding; "
            "* = on the frontier; lr edge = the best lr was the lowest/highest tried.",
            "",
            "| corpus | stages | T_fixed std | stage emb | mode | dtype | k | B/token (formula) | % of dense bf16 "
            "| best lr (edge) | val loss ± std (seeds) | ratio to best dense | same | frontier |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for p in points:
            low, high = p["ratio_range"]
            lines.append(
                f"| {p['corpus']} | {p['stages']} | {p['t_fixed_std']:g} | {p['stage_embedding'] or '—'} "
                f"| {p['mode']}{' ‡' if p['best_dense'] else ''} | {p['dtype']} | {p['k'] or '—'} "
                f"| {p['bytes']:.2f} ({p['formula']:g}) | {100 * p['dense_share']:.2f}% "
                f"| {p['lr']:g}{' (' + p['edge'] + ')' if p['edge'] else ''} "
                f"| {p['val_loss']:.4f} ± {p['val_std']:.4f} ({len(p['seeds'])}) "
                f"| ×{p['ratio']:.3f} [{low:.3f}, {high:.3f}] | ×{p['ratio_same']:.3f} "
                f"| {'*' if p['frontier'] else ''} |"
            )
    curves = trajectories(rows)
    if curves:
        lines += ["", "Trajectory (val loss at tokens; last three validations per run; × = / the dense run of the "
                  "same corpus, split, lr and seed):", ""]
        for key, curve in sorted(curves.items()):
            corpus, stages, std, embedding, mode, dtype, k, lr, seed = key
            dense = _dense_curve(curves, key)
            ratio = {t: f" (×{loss / dense[t]:.3f})" for t, loss in curve if mode != "none" and t in dense}
            tail = ", ".join(f"{t:,}: {loss:.4f}{ratio.get(t, '')}" for t, loss in curve[-3:])
            lines.append(f"- {corpus} {stages} stages std={std:g} emb={embedding} {mode} {dtype} k={k} lr={lr:g} "
                         f"seed={seed}: … {tail}")
    lines += [
        f"failed: {r['corpus']} {r['mode']} {r['dtype']} k={r['k']} lr={r['lr']:g} seed={r['seed']}: {r['error']}"
        for r in rows if "error" in r
    ]
    return "\n".join(lines)


def _dense_curve(curves: dict[tuple, list[tuple[int, float]]], key: tuple) -> dict[int, float]:
    """The dense bf16 trajectory run beside `key` (same corpus, split, lr and seed), as {tokens: loss}."""
    corpus, stages, *_, lr, seed = key
    return next((dict(c) for other, c in curves.items()
                 if (other[0], other[1], other[4], other[5]) == (corpus, stages, "none", "bf16")
                 and other[7:] == (lr, seed)), {})


def trajectories(rows: list[dict]) -> dict[tuple, list[tuple[int, float]]]:
    """(corpus, stages, std, stage embedding, mode, dtype, k, lr, seed) → [(tokens, val loss)], from the
    trajectory rows."""
    out = {}
    for row in rows:
        if row["kind"] == "trajectory" and "error" not in row and row["val_curve"]:
            per_step = row["tokens"] // row["steps"]
            curve = [(0, row["val_loss_first"])] + [(step * per_step, loss) for step, loss in row["val_curve"]]
            out[(row["corpus"], *_setting(row), row["mode"], row["dtype"], row["k"], row["lr"], row["seed"])] = curve
    return out


def plot(rows: list[dict], folder: Path) -> list[Path]:
    """frontier.png (log bytes against the ratio to dense bf16, one panel per corpus) and
    frontier_trajectory.png (val loss against tokens), for what the rows hold."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib (the JSON and table are written)") from None
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    points = best(rows)
    corpora = sorted({p["corpus"] for p in points})
    if corpora:
        fig, axes = plt.subplots(1, len(corpora), figsize=(7 * len(corpora), 5), squeeze=False)
        for ax, corpus in zip(axes[0], corpora, strict=True):
            mine = [p for p in points if p["corpus"] == corpus]
            series_keys = sorted({(p["stages"], p["t_fixed_std"], p["stage_embedding"], p["mode"], p["dtype"])
                                  for p in mine})
            for key in series_keys:
                series = sorted((p for p in mine if (p["stages"], p["t_fixed_std"], p["stage_embedding"], p["mode"],
                                                     p["dtype"]) == key), key=lambda p: p["bytes"])
                xs, ys = [p["bytes"] for p in series], [p["ratio"] for p in series]
                stages, std, embedding, mode, dtype = key
                ax.plot(xs, ys, "s" if mode == "none" else "o-",
                        label=f"{stages}st std={std:g} emb={embedding} {mode} {dtype}")
                for p in series:
                    if p["k"]:
                        ax.annotate(f"k={p['k']}", (p["bytes"], p["ratio"]), fontsize=7)
            ax.set_xscale("log")
            ax.axhline(1.0, color="grey", lw=0.5)
            ax.set_xlabel("wire bytes per token per boundary (fwd + bwd, measured)")
            ax.set_ylabel("val loss / best dense bf16 of the split (best lr each)")
            ax.set_title(f"{corpus}: {mine[0]['steps']} steps, {mine[0]['tokens']:,} tokens")
            ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(folder / "frontier.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    curves = trajectories(rows)
    if curves:
        fig, (loss_ax, ratio_ax) = plt.subplots(1, 2, figsize=(13, 5))
        for key, curve in sorted(curves.items()):
            corpus, stages, std, embedding, mode, dtype, k, lr, seed = key
            label = f"{corpus} {stages}st std={std:g} emb={embedding} {mode} {dtype} k={k} lr={lr:g} s{seed}"
            loss_ax.plot([t for t, _ in curve[1:]], [v for _, v in curve[1:]], label=label)
            dense = _dense_curve(curves, key)
            if mode != "none" and dense:
                pairs = [(t, v / dense[t]) for t, v in curve[1:] if t in dense]
                ratio_ax.plot([t for t, _ in pairs], [r for _, r in pairs], label=label)
        loss_ax.set(xlabel="tokens", ylabel="validation loss")
        ratio_ax.set(xlabel="tokens", ylabel="val loss / dense bf16 (same seed, lr)")
        ratio_ax.axhline(1.0, color="grey", lw=0.5)
        loss_ax.legend(fontsize=7)
        ratio_ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(folder / "frontier_trajectory.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written
