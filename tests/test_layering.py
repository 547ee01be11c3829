"""The layering DESIGN.md §5 promises, read from the import statements and from what an import loads.

`swarm/` is the protocol and the math: it never starts a DHT node, opens a libp2p daemon or
starts processes, so the simulator, the tracker's pure summary and the tests can use all of it
without a network. It imports nothing of hivemind: importing any hivemind module runs the package's
`__init__`, which loads the DHT node and the P2P daemon, so the record validators and identity keys
(built on `hivemind.dht` and `hivemind.p2p`) live in `dhtio/`. The import statements alone would miss
a module that loads them through another package, so a fresh interpreter imports every `swarm/` module
and the test reads what it loaded. Between the packages: `peer`, `tracker` and `launcher` never import
one another, nothing imports `launcher`, and the shared `dhtio` and `p2pio` import none of them.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# modules that start processes (torch itself loads them, so only the import statements are checked)
PROCESS_MODULES = ("subprocess", "multiprocessing")
# hivemind's networking: the DHT node and its protocol, the libp2p daemon and its servicers
NETWORKING_PACKAGES = ("hivemind.dht", "hivemind.p2p")


def _imports(package: str) -> list[tuple[str, list[str], str]]:
    """(module, imported names, where) for every absolute import under `package/`, read in a fresh interpreter:
    on CPython 3.11.7, after tests/test_tracker_relay.py has run in the same process, `ast.parse` raises
    "AST constructor recursion depth mismatch" (cause not established; a later parse by pytest itself can still
    fail in that order, which is not the suite's order)."""
    done = subprocess.run([sys.executable, __file__, package], capture_output=True, text=True, check=True)
    return [tuple(item) for item in json.loads(done.stdout)]


def _read_imports(package: str) -> list[tuple[str, list[str], str]]:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                found += [(alias.name, [], where) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.append((node.module, [alias.name for alias in node.names], where))
    return found


def _is_under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _swarm_modules() -> list[str]:
    paths = sorted((ROOT / "swarm").rglob("*.py"))
    names = [".".join(path.relative_to(ROOT).with_suffix("").parts) for path in paths]
    return [name.removesuffix(".__init__") for name in names]


def _load_each(modules: list[str]) -> dict[str, list[str]]:
    """Import `modules` in order (in this interpreter): for each, the networking modules its import loaded."""
    import importlib

    loaded = {}
    for module in modules:
        before = set(sys.modules)
        importlib.import_module(module)
        loaded[module] = sorted(name for name in set(sys.modules) - before if _is_under(name, NETWORKING_PACKAGES))
    return loaded


def test_swarm_imports_no_hivemind_or_processes():
    offending = [
        f"{where} {module}"
        for module, _, where in _imports("swarm")
        if module.split(".")[0] == "hivemind" or _is_under(module, PROCESS_MODULES)
    ]
    assert not offending, "swarm/ must not import hivemind or start processes:\n" + "\n".join(offending)


def test_importing_swarm_loads_no_hivemind_networking():
    done = subprocess.run(
        [sys.executable, __file__, "--load", *_swarm_modules()], capture_output=True, text=True, check=True
    )
    offending = [
        f"{module}: {len(names)} modules: {', '.join(names[:3])}, ..."
        for module, names in json.loads(done.stdout).items()
        if names
    ]
    assert not offending, "importing swarm/ loaded hivemind's DHT or P2P:\n" + "\n".join(offending)


def test_packages_import_only_downwards():
    may_not_import = {
        "swarm": ("peer", "tracker", "launcher", "dhtio", "p2pio"),
        "dhtio": ("peer", "tracker", "launcher"),
        "p2pio": ("peer", "tracker", "launcher"),
        "peer": ("tracker", "launcher"),
        "tracker": ("peer", "launcher"),
        "launcher": ("peer", "tracker"),
    }
    offending = [
        f"{where} {module}"
        for package, forbidden in may_not_import.items()
        for module, _, where in _imports(package)
        if module.split(".")[0] in forbidden
    ]
    assert not offending, "an import against the layering:\n" + "\n".join(offending)


if __name__ == "__main__":
    if sys.argv[1] == "--load":
        print(json.dumps(_load_each(sys.argv[2:])))
    else:
        print(json.dumps(_read_imports(sys.argv[1])))
