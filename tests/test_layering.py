"""The layering DESIGN.md §5 promises, read from the import statements.

`swarm/` is the protocol and the math: it never starts a DHT node, opens a libp2p daemon or
starts processes, so the simulator, the tracker's pure summary and the tests can use all of it
without a network. Record schemas need hivemind's *validators* (`hivemind.dht.schema`, `.crypto`,
`.validation`, `.routing` for the key hash) and the `PeerID` datastructure: those build and check
records and touch no network, so they are allowed; the DHT and P2P classes are not. Between the
packages: `peer`, `tracker` and `launcher` never import one another, nothing imports `launcher`, and the
shared `dhtio` and `p2pio` import none of them.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# modules that run a DHT node, a libp2p daemon or other processes
NETWORKING_MODULES = (
    "hivemind.dht.dht",
    "hivemind.dht.node",
    "hivemind.dht.protocol",
    "hivemind.p2p.p2p_daemon",
    "hivemind.p2p.servicer",
    "subprocess",
    "multiprocessing",
)
# names that package re-exports of those modules hand out
NETWORKING_NAMES = {"DHT", "DHTNode", "DHTProtocol", "P2P", "ServicerBase"}
# the hivemind modules `swarm/records.py` builds and checks records with
ALLOWED_HIVEMIND = (
    "hivemind.dht.crypto",
    "hivemind.dht.routing",
    "hivemind.dht.schema",
    "hivemind.dht.validation",
    "hivemind.p2p.p2p_daemon_bindings.datastructures",
    "hivemind.proto",
    "hivemind.utils",
)


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


def test_swarm_has_no_networking_or_process_imports():
    offending = []
    for module, names, where in _imports("swarm"):
        if _is_under(module, NETWORKING_MODULES) or NETWORKING_NAMES & set(names):
            offending.append(f"{where} {module} {names}")
        elif module.startswith("hivemind") and not _is_under(module, ALLOWED_HIVEMIND):
            offending.append(f"{where} {module} (not one of the record-building modules)")
    assert not offending, "swarm/ must not do networking or start processes:\n" + "\n".join(offending)


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
    print(json.dumps(_read_imports(sys.argv[1])))
