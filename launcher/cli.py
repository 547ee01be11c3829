"""`protocol-swarm`: simulate a run in one process, inspect a preset, or start a local swarm."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from launcher.local import add_local_parser
from swarm.data import DataError
from swarm.manifest import ManifestError, load_manifest, save_manifest
from swarm.presets import PRESETS, preset, verify_hashes


def _manifest_from(args: argparse.Namespace):
    if getattr(args, "manifest", None):
        manifest = load_manifest(args.manifest)
        verify_hashes(manifest)
        return manifest
    return preset(
        args.preset,
        stages=getattr(args, "stages", None),
        compression=getattr(args, "compression", None),
        seed=getattr(args, "seed", None),
        k=getattr(args, "k", None),
        subspace_update_interval=getattr(args, "subspace_update_interval", None),
    )


def cmd_inspect(args: argparse.Namespace) -> int:
    manifest = _manifest_from(args)
    if args.write:
        save_manifest(manifest, args.write)
    shape = manifest.model
    dense = manifest.dense_bytes_per_token()
    compressed = manifest.compressed_bytes_per_token()
    print(json.dumps(manifest.model_dump(mode="json"), indent=2, sort_keys=True))
    print(f"run_id            {manifest.run_id}")
    print(f"T_fixed sha256    {manifest.t_fixed_sha256}")
    print(f"U v0 sha256       {manifest.u_sha256}")
    layers = ", ".join(str(len(manifest.layers_of(i))) for i in range(manifest.num_stages))
    print(f"stages            {manifest.num_stages} ({layers} layers)")
    print(f"d/k               {shape.d_model}/{manifest.k} = {shape.d_model / manifest.k:.1f}")
    print(
        f"bytes/token/dir   dense {dense} ({manifest.wire_dtype}), {manifest.compression} {compressed}"
        f" -> {100 * compressed / dense:.2f}% of dense"
    )
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from swarm.simulate import simulate

    manifest = _manifest_from(args)
    bar = None

    def on_step(step: int, loss: float) -> None:
        nonlocal bar
        if args.json:
            return
        if bar is None:  # opened at the first step, so a refused --data or manifest leaves stderr one line
            bar = tqdm(total=args.steps, desc=f"simulate {manifest.compression}", unit="step")
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")

    result = simulate(manifest, args.steps, data=args.data, seed=args.seed or 0, on_step=on_step)
    if bar is not None:
        bar.close()
    if args.json:
        print(json.dumps(asdict(result)))
    else:
        print(f"run {result.run_id}: {result.steps} steps, {result.tokens} tokens in {result.seconds:.1f}s")
        print(f"val loss {result.val_loss_first:.3f} -> {result.val_loss_last:.3f}")
        print(
            f"wire {result.wire_bytes_per_token:.1f} B/token vs dense {result.dense_wire_bytes_per_token:.0f}"
            f" ({100 * result.wire_bytes_per_token / result.dense_wire_bytes_per_token:.2f}%)"
        )
        print(f"max reconstruction error {result.max_reconstruction_error:.2e}")
    return 0


def _add_manifest_args(parser: argparse.ArgumentParser, seed_default=None) -> None:
    parser.add_argument("--preset", default="tiny", choices=PRESETS, help="named run shape")
    parser.add_argument("--manifest", help="a manifest JSON file instead of a preset")
    parser.add_argument("--compression", choices=("subspace", "boundary", "none"), help="override the compression mode")
    parser.add_argument("--stages", type=int, help="split the layers into this many stages")
    parser.add_argument("--k", type=int, help="subspace width")
    parser.add_argument("--seed", type=int, default=seed_default, help="run seed (derives T_fixed and U)")
    parser.add_argument("--subspace-update-interval", type=int, help="optimizer epochs between U updates (0 = never)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="protocol-swarm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    inspect = sub.add_parser("inspect", help="print a manifest, its run_id, hashes and compression ratio")
    _add_manifest_args(inspect)
    inspect.add_argument("--write", metavar="FILE", help="also save the manifest to FILE")
    inspect.set_defaults(func=cmd_inspect)

    sim = sub.add_parser("simulate", help="train all stages in one process through the real wire codec")
    _add_manifest_args(sim)
    sim.add_argument("--steps", type=int, default=50, help="optimizer steps")
    sim.add_argument("--data", help="a text file or directory (default: the manifest's dataset)")
    sim.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    sim.set_defaults(func=cmd_simulate)

    add_local_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ManifestError, DataError) as exc:
        print(f"protocol-swarm: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
