"""Convergence against wire bytes: the best validation loss of every setting at equal tokens.

Each point trains the tiny preset's width (d=256, 4 layers) with `swarm.simulate` for the same number
of steps on the same batches (equal tokens), every boundary through the real codec, and records the
bytes of the encoded messages per token per boundary (forward + backward, headers included) next to
the payload formula. A point is (corpus, split, T_fixed std, stage embedding, mode, wire dtype, k):
the grid is the product of `--splits` (stages over the 4 layers: 2 = 2×2, 4 = 4×1),
`--t-fixed-stds` (the frozen embedding's scale, DESIGN §2.10), `--stage-embeddings` (ranks of the
stage-local token embedding; 0 = none, 256 = a full table) and {dense `none` in `--dense-dtypes`} ∪
{`--modes` × `--dtypes` × `--ks`}, each at every learning rate of `--lrs` and every seed. The summary
takes each point's best learning rate (mean over seeds), flags it when that is the lowest or highest
tried, and pairs it per seed against the **best** dense bf16 point of its corpus and split (whatever
its std and stage embedding), never a dense handicapped by the same change.

Two corpora: `code` is the default the repo trains on (the Python standard library's source);
`prose` is English prose that every CPython install ships: the reference manual's topics
(`pydoc_data`) and the standard library's docstrings (doctest lines dropped), ~1.9 MB, built once
into a file in the temp folder. Neither is tuned on here.

`--trajectory` trains the grid's settings for 2000 steps (unless `--steps` says otherwise), validating
every `--val-every` steps: does the gap shrink with training?

    OMP_NUM_THREADS=1 python benchmarks/frontier.py --json /tmp/frontier.json [--jobs 2] [--device cuda]
    python benchmarks/frontier.py --trajectory --stage-embeddings 256 --modes boundary --dtypes bf16 --ks 4 \
        --dense-dtypes bf16 --json /tmp/frontier.json --jobs 2
    python benchmarks/frontier.py --report-only --json /tmp/frontier.json --plot benchmarks/

The JSON is rewritten after every point and a rerun skips the points it holds (same settings), so
any run can be stopped and resumed, and grids of several invocations can share one file; `--jobs N`
trains N points at once in worker processes of one torch thread each.
"""

from __future__ import annotations

import argparse
import ast
import json
import multiprocessing
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import frontier_report  # noqa: E402

import swarm.data  # noqa: E402
from swarm.manifest import BatchSpec, Manifest, OptimizerSpec, token_id_itemsize  # noqa: E402
from swarm.modes import MODES  # noqa: E402
from swarm.presets import preset  # noqa: E402
from swarm.simulate import simulate  # noqa: E402

CORPORA = ("code", "prose")
PROSE_MIN_BYTES = 1 << 20
SETTINGS = ("d_model", "n_layers", "seq_len", "microbatch", "microbatches", "warmup", "val_batches", "val_every")
KEY = ("kind", "corpus", "stages", "t_fixed_std", "stage_embedding", "mode", "dtype", "k", "lr", "seed", "steps")
DEFAULT_LRS = (2.5e-4, 5e-4, 1e-3, 2e-3)
DENSE_K = 4  # the manifest needs a k; a dense wire never uses it


def prose_text() -> str:
    """CPython's own prose: the reference manual's topics and the standard library's docstrings (≥ 80
    characters), in a fixed order, doctest lines dropped."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        topics = {}
    parts = [topics[key] for key in sorted(topics)]
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "__pycache__"}
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(name for name in subfolders if name not in skip)
        for name in sorted(n for n in names if n.endswith(".py")):
            try:
                tree = ast.parse((Path(folder) / name).read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) >= 80:
                        parts.append(doc)
    lines = "\n\n".join(parts).splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith((">>>", "...")))


def corpus_spec(name: str) -> str:
    """What `swarm.data` reads for corpus `name`: a file in the temp folder, written once, so that every
    point (and every worker) reads one file instead of walking the standard library again."""
    path = Path(tempfile.gettempdir()) / f"protocol-swarm-{name}-py{sys.version_info[0]}{sys.version_info[1]}.txt"
    if not path.exists():
        text = swarm.data.read_corpus(swarm.data.BUILTIN_STDLIB) if name == "code" else prose_text()
        if name == "prose" and len(text.encode()) < PROSE_MIN_BYTES:
            stdlib = sysconfig.get_paths()["stdlib"]
            raise SystemExit(
                f"the prose corpus (pydoc_data topics + standard library docstrings under {stdlib})"
                f" holds {len(text.encode()):,} bytes, fewer than {PROSE_MIN_BYTES:,}: this Python install lacks them"
            )
        partial = path.with_suffix(f".{os.getpid()}.part")
        partial.write_text(text, encoding="utf-8")
        partial.replace(path)
    return str(path)


def point_key(point: dict) -> str:
    return "|".join(f"{key}={point[key]}" for key in KEY)


def make_manifest(point: dict, settings: dict) -> Manifest:
    base = preset("tiny")
    d = settings["d_model"]
    shape = base.model.model_copy(update=dict(
        d_model=d, n_layers=settings["n_layers"], n_heads=max(4, d // 64), n_kv_heads=max(2, d // 128),
        d_ff=base.model.d_ff * d // base.model.d_model,
    ))
    micro = settings["microbatch"]
    return preset(
        "tiny", model=shape, k=point["k"], stages=point["stages"], compression=point["mode"],
        wire_dtype=point["dtype"], seed=point["seed"], t_fixed_std=point["t_fixed_std"],
        stage_embedding_rank=point["stage_embedding"],
        batch=BatchSpec(microbatch_size=micro, seq_len=settings["seq_len"],
                        target_batch_size=micro * settings["microbatches"]),
        optimizer=OptimizerSpec(lr=point["lr"], warmup_steps=settings["warmup"]),
    )


def formula_bytes(manifest: Manifest) -> float:
    """Payload per token per boundary, forward (coefficients or residual, plus token ids) + backward."""
    width = manifest.k if manifest.mode.compressed else manifest.model.d_model
    one_way = manifest.wire.payload_bytes(1, width)
    return 2 * one_way + token_id_itemsize(manifest.model.vocab_size)


def _init_worker() -> None:
    torch.set_num_threads(1)


def run_point(point: dict, settings: dict, data: str, device: str, val_every: int) -> dict:
    """Train one point; its result as the JSON row, or the point with `error` if it failed (a diverging
    learning rate makes the sender refuse its own message): recorded, so a resumed sweep does not
    retry it, and reported, so the sweep goes on."""
    try:
        return _train_point(point, settings, data, device, val_every)
    except Exception as error:
        return {**point, "device": device, "error": f"{type(error).__name__}: {error}"}


def _train_point(point: dict, settings: dict, data: str, device: str, val_every: int) -> dict:
    manifest = make_manifest(point, settings)
    result = simulate(manifest, point["steps"], data=data, seed=point["seed"], val_batches=settings["val_batches"],
                      device=device, val_every=val_every)
    return {
        **point, "device": device, "tokens": result.tokens, "val_loss_first": result.val_loss_first,
        "val_loss": result.val_loss_last, "train_loss_last": statistics.fmean(result.train_loss[-10:]),
        "bytes_per_token": result.wire_bytes_per_token, "bytes_forward": result.wire_bytes_per_token_forward,
        "bytes_backward": result.wire_bytes_per_token_backward, "formula_bytes": formula_bytes(manifest),
        "max_reconstruction_error": result.max_reconstruction_error,
        "max_subspace_residual": result.max_subspace_residual, "seconds": result.seconds,
        "step_seconds": result.step_seconds, "val_curve": result.val_curve,
    }


def plan(args: argparse.Namespace) -> list[dict]:
    """Every point, seeds outermost and the settings rotating, so load drift hits all alike."""
    wires = [("none", dtype, DENSE_K) for dtype in args.dense_dtypes]
    wires += [(mode, dtype, k) for mode in args.modes for dtype in args.dtypes for k in args.ks]
    combos = [(stages, std, rank, *wire) for stages in args.splits for std in args.t_fixed_stds
              for rank in args.stage_embeddings for wire in wires]
    points = []
    turn = 0
    for seed in args.seeds:
        for lr in args.lrs:
            for corpus in args.corpus:
                order = combos[turn % len(combos):] + combos[: turn % len(combos)]
                turn += 1
                points += [
                    dict(kind="trajectory" if args.trajectory else "frontier", corpus=corpus, stages=stages,
                         t_fixed_std=std, stage_embedding=rank, mode=mode, dtype=dtype, k=k, lr=lr, seed=seed,
                         steps=args.steps)
                    for stages, std, rank, mode, dtype, k in order
                ]
    return points


def load(path: str | None, settings: dict) -> list[dict]:
    if not path or not Path(path).exists():
        return []
    saved = json.loads(Path(path).read_text())
    if {key: saved["settings"].get(key) for key in SETTINGS} != settings:
        raise SystemExit(f"{path} was written with other settings ({saved['settings']}, now {settings}): "
                         "name another --json file")
    return saved["points"]


def save(path: str | None, settings: dict, rows: list[dict]) -> None:
    if path:
        partial = Path(f"{path}.part")
        partial.write_text(json.dumps(dict(settings=settings, points=rows), indent=1))
        partial.replace(path)


def train_all(todo: list[dict], rows: list[dict], args: argparse.Namespace, settings: dict) -> None:
    """Train `todo`, appending each result to `rows` and saving as it lands."""
    data = {corpus: corpus_spec(corpus) for corpus in args.corpus}
    val_every = args.val_every if args.trajectory else 0
    started, done = time.perf_counter(), 0

    def landed(row: dict) -> None:
        nonlocal done
        done += 1
        rows.append(row)
        save(args.json_path, settings, rows)
        elapsed = time.perf_counter() - started
        eta = elapsed / done * (len(todo) - done)
        if "error" in row:
            print(f"[{done}/{len(todo)}] {row['corpus']} {row['stages']}st std={row['t_fixed_std']:g} "
                  f"emb={row['stage_embedding']} {row['mode']} {row['dtype']} k={row['k']} lr={row['lr']:g} "
                  f"seed={row['seed']}: FAILED {row['error']}", flush=True)
            return
        print(f"[{done}/{len(todo)}] {row['corpus']} {row['stages']}st std={row['t_fixed_std']:g} "
              f"emb={row['stage_embedding']} {row['mode']:<8} {row['dtype']:<4} k={row['k']:<2} "
              f"lr={row['lr']:g} seed={row['seed']}: val {row['val_loss_first']:.3f} -> {row['val_loss']:.4f}, "
              f"{row['bytes_per_token']:.2f} B/token/boundary, {row['step_seconds']:.3f} s/step | "
              f"elapsed {elapsed:.0f}s, ETA {eta:.0f}s", flush=True)

    if args.jobs <= 1:
        _init_worker()
        for point in todo:
            landed(run_point(point, settings, data[point["corpus"]], args.device, val_every))
        return
    context = multiprocessing.get_context("spawn")  # no forked CUDA or OpenMP state
    with ProcessPoolExecutor(args.jobs, mp_context=context, initializer=_init_worker) as pool:
        pending = {pool.submit(run_point, point, settings, data[point["corpus"]], args.device, val_every)
                   for point in todo}
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                landed(future.result())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: where the model and batches live")
    parser.add_argument("--steps", type=int, help="optimizer steps per point (default 600; 2000 with --trajectory)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--lrs", type=float, nargs="+",
                        help=f"learning rates swept per point (default {' '.join(map(str, DEFAULT_LRS))}; "
                             "1e-3 with --trajectory)")
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--modes", nargs="*", default=["boundary", "subspace"], choices=sorted(MODES),
                        help="compressed modes (none given: dense points only)")
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "int8"], help="coefficient wire dtypes")
    parser.add_argument("--dense-dtypes", nargs="*", default=["bf16", "int8"],
                        help="dense baselines' wire dtypes (none given: no dense point)")
    parser.add_argument("--corpus", nargs="+", default=["code"], choices=CORPORA,
                        help="code: the standard library's source (the repo's default); prose: CPython's docs")
    parser.add_argument("--splits", type=int, nargs="+", default=[2],
                        help="stages over the --n-layers layers (2: 2 stages x 2 layers; 4: 4 x 1)")
    parser.add_argument("--t-fixed-stds", type=float, nargs="+",
                        help="standard deviations of T_fixed (default: the tiny preset's)")
    parser.add_argument("--stage-embeddings", type=int, nargs="+", default=[0],
                        help="ranks of the stage-local token embedding: 0 none, d-model a full table")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--microbatch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=2, help="microbatches per optimizer step")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--trajectory", action="store_true", help="long runs validated every --val-every steps")
    parser.add_argument("--val-every", type=int, default=100, help="with --trajectory: steps between validations")
    parser.add_argument("--jobs", type=int, default=1, help="points trained at once, one process each")
    parser.add_argument("--json", dest="json_path", help="results, rewritten after every point; resumed from")
    parser.add_argument("--report-only", action="store_true",
                        help="train nothing: summarise (and plot) the JSON's rows of --seeds, --corpus (and --lrs)")
    parser.add_argument("--plot", metavar="DIR", help="write frontier.png / frontier_trajectory.png there")
    args = parser.parse_args(argv)
    args.steps = args.steps or (2000 if args.trajectory else 600)
    args.lr_filter = args.lrs  # the report of --report-only covers only these, when given
    args.lrs = args.lrs or ([1e-3] if args.trajectory else list(DEFAULT_LRS))
    args.t_fixed_stds = args.t_fixed_stds or [preset("tiny").t_fixed_std]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = {key: getattr(args, key) for key in SETTINGS}
    if args.report_only and args.json_path and Path(args.json_path).exists():
        settings = json.loads(Path(args.json_path).read_text())["settings"]  # report what the file holds
    rows = load(args.json_path, settings)
    if args.report_only:  # the report covers the seeds and corpora asked for (a screen's seed, a confirm's three)
        rows = [row for row in rows if row["seed"] in args.seeds and row["corpus"] in args.corpus
                and (not args.lr_filter or row["lr"] in args.lr_filter)]
    else:
        have = {point_key(row) for row in rows}
        todo = [point for point in plan(args) if point_key(point) not in have]
        print(f"{len(todo)} points to train, {len(rows)} found in {args.json_path}", flush=True)
        train_all(todo, rows, args, settings)
    print()
    print(frontier_report.markdown(rows, settings))
    if args.plot:
        for path in frontier_report.plot(rows, Path(args.plot)):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
