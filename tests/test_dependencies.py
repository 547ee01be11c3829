"""Every import the console scripts can reach at run time is a main dependency of the distribution.

CI installs `.[test]`, so a run-time import that only an extra provides passes every other test
and still breaks a newcomer's plain `pip install -e .` (the tracker once died that way on
`prometheus_client`). This reads the imports of every package (`PACKAGES`) and checks each
third-party module against `[project].dependencies`; a module of an optional extra (`hf`) is
allowed only inside a function, where the code asking for it can say which extra to install.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("swarm", "peer", "tracker", "launcher", "dhtio", "p2pio")


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    return _normalise(re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0])


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _third_party_imports() -> list[tuple[str, str, bool]]:
    """(module, where, at top level of its file) for every import outside the stdlib and our packages."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            top_level = {id(node) for node in tree.body}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    root = name.split(".")[0]
                    if root in sys.stdlib_module_names or root in PACKAGES or root == "__future__":
                        continue
                    found.append((root, f"{path.relative_to(ROOT)}:{node.lineno}", id(node) in top_level))
    return found


@functools.cache
def _installed() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def _distribution(module: str) -> str:
    names = _installed().get(module) or [module]
    return _normalise(names[0])


def test_every_runtime_import_is_a_main_dependency():
    project = _project()
    main = {_requirement_name(r) for r in project["dependencies"]}
    optional = {_requirement_name(r) for r in project["optional-dependencies"]["hf"]}
    missing, eager_optional = [], []
    for module, where, top_level in _third_party_imports():
        distribution = _distribution(module)
        if distribution in main:
            continue
        if distribution in optional and not top_level:
            continue
        (eager_optional if distribution in optional else missing).append(f"{module} ({distribution}) at {where}")
    assert not missing, f"imported at run time but not a main dependency: {missing}"
    assert not eager_optional, f"optional-extra modules imported at module level: {eager_optional}"


def test_test_extra_holds_no_runtime_dependency():
    """The extras are for tests, benchmarks and optional data sources; nothing the scripts import."""
    project = _project()
    used = {_distribution(module) for module, _, _ in _third_party_imports()}
    test_only = {_requirement_name(r) for r in project["optional-dependencies"]["test"]}
    assert not (used & test_only), f"run-time imports listed only in the test extra: {sorted(used & test_only)}"
