"""What a relay carries for others, and the `--relay-*` flags that set it, for a peer and the tracker's node
alike (no networking here: the CLIs import it before anything heavy)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class Budget:
    """What a relay carries for others (the `--relay-*` flags)."""

    circuits_per_peer: int = 16
    bytes_per_circuit: int = 4096 << 20  # each way
    seconds_per_circuit: float = 1800.0

    @property
    def data_limit_mib(self) -> int:
        return self.bytes_per_circuit >> 20


def add_budget_flags(parser: argparse.ArgumentParser) -> None:
    """The `--relay-*` budget flags, one set for a peer and for the tracker's node."""
    default = Budget()
    parser.add_argument("--relay-max-circuits", type=int, default=default.circuits_per_peer,
                        help="relayed trips per sending peer at once")
    parser.add_argument("--relay-data-limit-mib", type=int, default=default.data_limit_mib,
                        help="MiB relayed each way per trip at most")
    parser.add_argument("--relay-time-limit", type=int, default=int(default.seconds_per_circuit),
                        help="seconds a relayed trip lasts at most")


def budget_from_flags(args: argparse.Namespace) -> Budget:
    """The budget `add_budget_flags`' flags give; ValueError naming them unless every one is positive."""
    if min(args.relay_max_circuits, args.relay_data_limit_mib, args.relay_time_limit) < 1:
        raise ValueError("--relay-max-circuits, --relay-data-limit-mib and --relay-time-limit must be positive")
    return Budget(args.relay_max_circuits, args.relay_data_limit_mib << 20, float(args.relay_time_limit))
