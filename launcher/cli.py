"""`protocol-swarm`: simulate a run in one process, inspect a preset, start a local swarm, or export and sample a
trained model.

Every flag can also come from the environment as PROTOCOL_SWARM_<FLAG> (`swarm/flags.py`)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from launcher.export import add_export_parsers
from launcher.local import add_local_parser
from launcher.manifest_args import add_manifest_args, manifest_from
from swarm.data import DataError
from swarm.flags import EnvDefaultsParser, refuse_start
from swarm.manifest import ManifestError, save_manifest

PROG = "protocol-swarm"


def cmd_inspect(args: argparse.Namespace) -> int:
    manifest = manifest_from(args)
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
    spec = manifest.context_parallel
    if spec is not None:
        formula = spec.payload_bytes_per_token(shape, manifest.batch.seq_len)
        sent = formula["compressed" if spec.compressed else "dense"]
        share = f" -> {100 * sent / formula['dense']:.2f}% of dense" if formula["dense"] else ""
        print(
            f"context parallel  P={spec.size}, {spec.compression} ({spec.variant}): K/V payload {sent:.1f}"
            f" B/token/layer/dir, dense {formula['dense']:.1f}{share}"
        )
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from swarm.simulate import simulate

    manifest = manifest_from(args)
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
        if result.cp_bytes_per_token is not None:
            sent, dense = result.cp_bytes_per_token, result.cp_dense_bytes_per_token
            share = sent["forward"] / dense["forward"] if dense["forward"] else 1.0
            print(
                f"context parallel K/V {sent['forward']:.1f} + {sent['backward']:.1f} B/token/layer vs dense"
                f" {dense['forward']:.1f} + {dense['backward']:.1f} ({100 * share:.2f}%),"
                f" reconstruction error {result.cp_reconstruction_error:.2e}"
            )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = EnvDefaultsParser(prog=PROG, description=__doc__, env_prefix="PROTOCOL_SWARM_")
    sub = parser.add_subparsers(dest="command", required=True)

    inspect = sub.add_parser("inspect", help="print a manifest, its run_id, hashes and compression ratio")
    add_manifest_args(inspect, context_parallel=True)
    inspect.add_argument("--write", metavar="FILE", help="also save the manifest to FILE")
    inspect.set_defaults(func=cmd_inspect)

    sim = sub.add_parser("simulate", help="train all stages in one process through the real wire codec")
    add_manifest_args(sim, context_parallel=True)
    sim.add_argument("--steps", type=int, default=50, help="optimizer steps")
    sim.add_argument("--data", help="a text file or directory (default: the manifest's dataset)")
    sim.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    sim.set_defaults(func=cmd_simulate)

    add_local_parser(sub)
    add_export_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ManifestError, DataError) as exc:
        return refuse_start(PROG, exc)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
