"""Does moving U help? Fixed U vs U updated every N steps (two drivers) vs dense, same data and tokens.

Also measures what an update costs: wall time of the in-process update (contributions, the
deterministic Grassmann step, re-projection) as a share of training time, and the bytes an update
puts through the DHT (real serialized record values: one contribution per contributing stage peer
and one version record per peer), here and at the paper's 8B shape. Usage:

    python benchmarks/subspace_updates.py [--steps 150] [--seeds 0 1] [--intervals 0 50 20] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch
from hivemind.dht.protocol import DHTProtocol

from swarm.presets import preset
from swarm.records import SubspaceRecord
from swarm.simulate import simulate
from swarm.subspace_update import matrix_to_bytes


def record_bytes(d_model: int, k: int) -> int:
    """Size of one subspace record value as the DHT stores it (msgpack of the record)."""
    record = SubspaceRecord(kind="contribution", peer_id="12D3KooW" + "x" * 44, version=1, target_version=2, stage=3,
                            epoch=500, terms=1000, u_sha256="a" * 64, contributors=[],
                            data=matrix_to_bytes(np.zeros((d_model, k))))
    return len(DHTProtocol.serializer.dumps(record.dict()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--intervals", type=int, nargs="+", default=[0, 50, 20])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write all runs here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    configs = [("dense", dict(compression="none"))]
    for interval in args.intervals:
        label = "fixed U" if interval == 0 else f"U every {interval} (gradient)"
        configs.append((label, dict(compression="subspace", subspace_update_interval=interval)))
    energy = [i for i in args.intervals if i]
    if energy:
        configs.append((f"U every {min(energy)} (energy)", dict(compression="subspace", subspace_driver="energy",
                                                                 subspace_update_interval=min(energy))))
    runs: dict[str, list[dict]] = {label: [] for label, _ in configs}
    total, done, started = len(configs) * len(args.seeds), 0, time.monotonic()
    for seed in args.seeds:
        for label, overrides in configs:
            manifest = preset("tiny", stages=args.stages, seed=seed, **overrides)
            result = simulate(manifest, args.steps, seed=seed)
            runs[label].append({"val_loss_last": result.val_loss_last, "tokens": result.tokens,
                                "seconds": result.seconds, "update_seconds": result.update_seconds,
                                "u_version": result.u_version, "updates": result.subspace_updates})
            done += 1
            eta = (time.monotonic() - started) / done * (total - done)
            print(f"[{done}/{total}] seed {seed} {label}: val {result.val_loss_last:.4f}, U v{result.u_version}, "
                  f"update time {result.update_seconds:.2f}s of {result.seconds:.1f}s; ETA {eta:.0f}s", flush=True)
    print(f"\ntiny preset, {args.stages} stages x 1 layer, d=256, k=4, {args.steps} steps, seeds {args.seeds}")
    print("| config | val loss (mean ± half-range) | vs dense | U versions | update time share |")
    print("|---|---|---|---|---|")
    dense = statistics.mean(r["val_loss_last"] for r in runs["dense"])
    for label, items in runs.items():
        losses = [r["val_loss_last"] for r in items]
        spread = (max(losses) - min(losses)) / 2
        share = statistics.mean(r["update_seconds"] / r["seconds"] for r in items)
        print(f"| {label} | {statistics.mean(losses):.4f} ± {spread:.4f} | "
              f"{100 * (statistics.mean(losses) / dense - 1):+.2f}% | {items[0]['u_version']} | {100 * share:.2f}% |")
    for name, d_model, k, stages, peers in (("tiny", 256, 4, args.stages, 1), ("8b", 4096, 40, 32, 1)):
        size = record_bytes(d_model, k)
        per_update = size * (stages + stages * peers)
        print(f"DHT bytes per update at {name} (d={d_model}, k={k}, {stages} stages x {peers} peer): "
              f"{size} B per record, {per_update} B per update (contributions + version records)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "runs": runs}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
