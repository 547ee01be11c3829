"""The manifest flags `protocol-swarm inspect`, `simulate` and `local` share, and the manifest they choose."""

from __future__ import annotations

import argparse

from swarm.context_parallel import VARIANTS
from swarm.cp_modes import CP_MODES
from swarm.manifest import Manifest, load_manifest
from swarm.modes import MODES
from swarm.presets import PRESETS, preset, verify_hashes

# What `--context-parallel P` sends between chunks when `--cp-compression` is not given: compressed K/V,
# as every context-parallel preset does (`remote` reached 0.93 of dense CP's validation loss at 4.7% of its
# K/V bytes, benchmarks/RESULTS.md); `--cp-compression none` is the dense baseline to compare with.
DEFAULT_CP_COMPRESSION = "subspace"


def add_manifest_args(
    parser: argparse.ArgumentParser, stages: int | None = None, context_parallel: bool = False
) -> None:
    """The flags that choose a run's manifest, the same for every `protocol-swarm` command; `stages` is the
    default stage count (None: the preset's); `context_parallel` adds the flags that turn it on (the
    commands that can run it: the simulator, and a local swarm whose lanes ship K/V between peers)."""
    parser.add_argument("--preset", default="tiny", choices=PRESETS, help="named run shape")
    parser.add_argument("--manifest", help="a manifest JSON file instead of a preset")
    parser.add_argument("--compression", choices=tuple(MODES), help="override the compression mode")
    parser.add_argument("--stages", type=int, default=stages, help="split the layers into this many stages")
    parser.add_argument("--k", type=int, help="subspace width")
    parser.add_argument("--seed", type=int, help="run seed (derives T_fixed and U)")
    parser.add_argument("--subspace-update-interval", type=int, help="optimizer epochs between U updates (0 = never)")
    if context_parallel:
        parser.add_argument(
            "--context-parallel",
            type=int,
            metavar="P",
            help=f"split every sequence into P chunks (context parallelism); K/V cross compressed "
            f"({DEFAULT_CP_COMPRESSION}) unless --cp-compression none",
        )
        parser.add_argument(
            "--cp-compression",
            choices=tuple(CP_MODES),
            help=f"what crosses between chunks: {DEFAULT_CP_COMPRESSION} = Z and θ (the default with "
            "--context-parallel), none = dense K and V (the baseline)",
        )
        parser.add_argument(
            "--cp-variant", choices=VARIANTS, help="subspace: paper = every block compressed, remote = crossing ones"
        )


def manifest_from(args: argparse.Namespace) -> Manifest:
    """The manifest a command was given: `--manifest FILE` (its hashes verified), else the preset with the
    flags' overrides."""
    if args.manifest:
        manifest = load_manifest(args.manifest)
        verify_hashes(manifest)
        return manifest
    size, compression = getattr(args, "context_parallel", None), getattr(args, "cp_compression", None)
    if size is not None and compression is None:
        # the flag's default, not ContextParallelSpec's "none", which stays what a manifest file without the key means
        compression = DEFAULT_CP_COMPRESSION
    cp_flags = {
        "size": size,
        "compression": compression,
        "variant": getattr(args, "cp_variant", None),
    }
    return preset(
        args.preset,
        context_parallel={key: value for key, value in cp_flags.items() if value is not None},
        stages=args.stages,
        compression=args.compression,
        seed=args.seed,
        k=args.k,
        subspace_update_interval=args.subspace_update_interval,
    )
