"""Each compression mode's answers, and that nothing outside `swarm/modes/` asks for a mode by name."""

from __future__ import annotations

import re
from pathlib import Path

from builders import tiny_manifest

from swarm.model import build_stages
from swarm.modes import DEFAULT, MODES
from swarm.presets import preset
from swarm.subspace_update import subspace_driver

ROOT = Path(__file__).resolve().parent.parent


def test_one_default_for_presets_and_manifests():
    assert preset("tiny").compression == DEFAULT
    assert type(preset("tiny")).model_fields["compression"].default == DEFAULT


def test_what_crosses_and_whether_u_moves():
    assert MODES["subspace"].compressed and MODES["boundary"].compressed and not MODES["none"].compressed
    assert [name for name, mode in MODES.items() if mode.moves_u] == ["subspace", "boundary", "boundary-free-ts"]
    assert tiny_manifest("none", subspace_update_interval=5).updates_u is False
    assert tiny_manifest("boundary", subspace_update_interval=5).updates_u is True
    assert tiny_manifest("boundary").updates_u is False  # no interval: U stays


def test_which_stages_project_and_which_drive_updates():
    stages = {name: build_stages(tiny_manifest(name, n_layers=3, stages=3)) for name in MODES}
    assert [s.projects_boundary for s in stages["boundary"]] == [True, True, False]
    assert not any(s.projects_boundary for s in stages["subspace"] + stages["none"])
    gradient, energy = subspace_driver("gradient"), subspace_driver("energy")
    assert gradient.weight_terms(MODES["subspace"]) and not energy.weight_terms(MODES["subspace"])
    assert not gradient.boundary_terms(MODES["subspace"]) and not gradient.weight_terms(MODES["boundary"])
    assert gradient.boundary_terms(MODES["boundary"])
    assert not energy.boundary_terms(MODES["boundary"])
    assert energy.receiver_energy and not gradient.receiver_energy


def test_which_stages_contribute_to_a_move_of_u():
    def contributing(name: str, driver: str) -> list[int]:
        return [s for s in range(3) if subspace_driver(driver).stage_contributes(MODES[name], s, 3)]

    assert contributing("subspace", "gradient") == [0, 1]  # the tail holds no constrained weight
    assert contributing("boundary", "gradient") == [0, 1, 2]
    assert contributing("subspace", "energy") == contributing("boundary", "energy") == [1, 2]


def test_no_module_compares_the_mode_name():
    """A mode is one object: the rest of the code asks it, never `compression == "..."`."""
    pattern = re.compile(r"compression\s*[!=]=|[!=]=\s*compression\b")
    offending = [
        f"{path.relative_to(ROOT)}:{number}"
        for package in ("swarm", "peer", "tracker", "launcher", "dhtio")
        for path in sorted((ROOT / package).rglob("*.py"))
        if not path.name.startswith(("context_parallel", "cp_"))  # context parallelism has its own compression
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offending, offending
