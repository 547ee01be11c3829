"""benchmarks/control_traffic.py's accounting: which kind each counted byte belongs to."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import control_traffic as ct  # noqa: E402


def test_dht_keys_are_named_by_record_kind():
    assert ct.dht_kind("tiny-ab12_stage1") == "DHT stage records"
    assert ct.dht_kind("tiny-ab12_stage1_progress") == "DHT progress"
    assert ct.dht_kind("tiny-ab12_stage0_grad_averager.0b1") == "DHT averaging groups"
    assert ct.dht_kind("tiny-ab12_stage2_state_averager.all_averagers") == "DHT averaging groups"
    assert ct.dht_kind("tiny-ab12_subspace") == ct.dht_kind("tiny-ab12_ucontrib") == "DHT subspace"
    assert ct.dht_kind(None) == ct.dht_kind("something else") == "DHT other (pings, routing)"
    assert ct.family("lookup tiny-ab12_stage1_grad_averager.0b") == "lookup stage*_grad_averager.<group>"


def test_bytes_are_split_by_kind_and_every_counted_byte_lands_in_one_row():
    names = {"aa": "run_stage1", "bb": "run_stage1_progress"}
    counts = collections.Counter({
        "served find aa": 100, "served store bb": 50, "served ping": 7, "served find cc": 3,  # cc: unnamed
        "served requests": 4, "served bytes": 160,  # totals, not rows
        "trip forward payload bytes": 10, "trip backward payload bytes": 8, "trip forward header bytes": 4,
        "trip forward messages": 1, "state download": 9, "averaging payload": 11, "averaging matchmaking": 2,
    })
    kinds = ct.byte_kinds(counts, names)
    assert kinds["DHT stage records"] == 100 and kinds["DHT progress"] == 50
    assert kinds["DHT other (pings, routing)"] == 10
    assert kinds["trip payload"] == 18 and kinds["trip headers"] == 4
    assert (kinds["state download"], kinds["averaging payload"], kinds["averaging matchmaking"]) == (9, 11, 2)
    assert sum(kinds.values()) == 160 + 18 + 4 + 9 + 11 + 2
    assert ct.served_dht("served store bb", names) == ("store", "DHT progress")
    assert ct.served_dht("served requests", names) is None
