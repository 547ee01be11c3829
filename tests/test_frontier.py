"""benchmarks/frontier.py end to end on a toy shape: every point trains, bytes are measured from the
encoded messages, the JSON resumes without retraining, and the report reads what it wrote."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import frontier  # noqa: E402
import frontier_report  # noqa: E402

# the smoke flags the benchmark promises to run quickly, on a shape small enough for two shared cores
SMOKE = ["--steps", "3", "--seeds", "0", "--ks", "4", "--lrs", "1e-3", "--d-model", "64", "--n-layers", "2",
         "--seq-len", "16", "--microbatch", "2", "--microbatches", "1", "--warmup", "1", "--val-batches", "1"]


def test_smoke_grid_resumes_and_reports(tmp_path, capsys):
    out = tmp_path / "frontier.json"
    assert frontier.main([*SMOKE, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["points"]
    combos = {(r["mode"], r["dtype"]) for r in rows}
    assert {("none", "bf16"), ("none", "int8"), ("boundary", "bf16"), ("subspace", "bf16")} <= combos
    for row in rows:
        assert row["tokens"] == 3 * 2 * 16
        # measured bytes = the payload formula plus the headers, spread over the message's tokens
        assert row["formula_bytes"] < row["bytes_per_token"] < row["formula_bytes"] + 2 * 200 / 32
    dense = next(r for r in rows if (r["mode"], r["dtype"]) == ("none", "bf16"))
    assert dense["formula_bytes"] == 2 * 64 * 2 + 1
    capsys.readouterr()
    assert frontier.main([*SMOKE, "--json", str(out)]) == 0  # resumed: nothing left to train
    assert "0 points to train" in capsys.readouterr().out
    assert len(json.loads(out.read_text())["points"]) == len(rows)
    with pytest.raises(SystemExit, match="other settings"):
        frontier.main([*SMOKE, "--d-model", "128", "--json", str(out)])


def test_report_picks_best_lr_and_flags_edges():
    def row(mode, dtype, lr, loss, seed=0, k=4, size=10.0):
        return dict(kind="frontier", corpus="code", mode=mode, dtype=dtype, k=k, lr=lr, seed=seed, steps=1,
                    tokens=1, val_loss=loss, bytes_per_token=size, formula_bytes=size,
                    max_reconstruction_error=0.0)

    rows = [row("none", "bf16", 1e-3, 2.0, size=1000), row("none", "bf16", 2e-3, 2.2, size=1000),
            row("boundary", "bf16", 1e-3, 2.3), row("boundary", "bf16", 2e-3, 2.1), row("boundary", "bf16", 4e-3, 2.2)]
    points = {p["mode"]: p for p in frontier_report.best(rows)}
    assert points["none"]["lr"] == 1e-3 and points["none"]["edge"] == "low"
    assert points["boundary"]["lr"] == 2e-3 and points["boundary"]["edge"] == ""
    assert points["boundary"]["ratio"] == pytest.approx(2.1 / 2.0)
    assert points["boundary"]["frontier"] and points["none"]["frontier"]


def test_prose_corpus_is_prose_and_large_enough():
    text = frontier.prose_text()
    assert len(text.encode()) >= frontier.PROSE_MIN_BYTES
    assert not any(line.lstrip().startswith(">>>") for line in text.splitlines())  # doctests dropped


def _row(lr: float, seed: int, loss: float, **extra) -> dict:
    return dict(kind="frontier", corpus="code", mode="boundary", dtype="bf16", k=4, lr=lr, seed=seed, steps=600,
                val_loss=loss, bytes_per_token=9.0, formula_bytes=9.0, tokens=1, max_reconstruction_error=0.0,
                **extra)


def test_best_lr_compares_equal_seeds_and_skips_failures_and_nan():
    rows = [
        _row(1e-3, 0, 2.0), _row(1e-3, 1, 2.3),  # mean 2.15 over both seeds
        _row(2e-3, 0, 2.1),  # one seed only: lower mean, but not comparable
        _row(4e-3, 0, float("nan")), _row(4e-3, 1, 1.0),  # non-finite: +inf
        {**_row(8e-3, 0, 0.0), "error": "WireError: out_of_range"},  # failed: left out
    ]
    (point,) = frontier_report.best(rows)
    assert point["lr"] == 1e-3 and point["edge"] == "low"
    assert "failed: code boundary bf16 k=4 lr=0.008 seed=0" in frontier_report.markdown(rows, {})
    (single,) = frontier_report.best([_row(1e-3, 0, 2.0)])
    assert single["edge"] == "single"
