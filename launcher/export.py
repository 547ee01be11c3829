"""`protocol-swarm export` and `protocol-swarm generate`: take a run's model home and look at what it says.

`export` reads stage checkpoints from folders on disk (the organiser's own peers' `--checkpoint-dir`s, a
local swarm's work dir kept with `--keep-logs`), or with `--from-swarm` downloads every stage from the run's
live peers (`dhtio/state_download.py`, each state confirmed by the stage's peer records), checks them against
the manifest and writes one file that plain PyTorch loads. `generate` loads such a file and samples text. The
logic is in `swarm/export.py`, `swarm/live_state.py`, `swarm/bundle.py` and `swarm/llama.py`; this is flags,
messages and exit codes: every refusal is one line, `protocol-swarm: error: ...`, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dhtio.state_download import download_run
from swarm.bundle import generate_ids, load_bundle
from swarm.data import DataError, make_tokenizer
from swarm.export import (
    Export,
    ExportError,
    Selection,
    StageCheckpoint,
    assemble,
    bundle_stages,
    find_manifest,
    load_run_manifest,
    save_bundle,
)
from swarm.flags import refuse_start
from swarm.live_state import LiveStateError
from swarm.llama import llama_blockers, write_llama
from swarm.manifest import Manifest

PROG = "protocol-swarm"


def cmd_export(args: argparse.Namespace) -> int:
    try:
        summary = run_export(args)
    except (ExportError, LiveStateError) as exc:
        return refuse_start(PROG, exc)
    if args.json:
        print(json.dumps(summary))
    return 0


def run_export(args: argparse.Namespace) -> dict:
    paths = [Path(p) for p in args.checkpoints]
    if bool(paths) == bool(args.from_swarm):
        raise ExportError("give checkpoint files or folders, or --from-swarm ADDR (the run's live peers), not both")
    if not args.timeout > 0:
        raise ExportError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    manifest_path = Path(args.manifest) if args.manifest else find_manifest([p for p in paths if p.is_dir()])
    if manifest_path is None:
        raise ExportError("need --manifest FILE (no single manifest.json at the top of the folders given)")
    manifest = load_run_manifest(manifest_path)
    out = Path(args.out or f"{manifest.run_id}.pt")
    if args.from_swarm:
        export = from_swarm(manifest, args.from_swarm, args.timeout, args.accept_single_peer_stages)
    else:
        export = assemble(manifest, paths)
    save_bundle(export.bundle, out)
    say = (lambda line: print(line, file=sys.stderr)) if args.json else print
    for note in export.notes:
        say(f"note: {note}")
    for entry in export.bundle["stages"]:
        say(f"stage {entry['stage']}: epoch {entry['epoch']} from {entry['source']}")
    parameters = sum(t.numel() for t in export.bundle["state_dict"].values())
    say(
        f"wrote {out}: run {manifest.run_id}, {manifest.num_stages} stages, {parameters:,} parameters, "
        f"U v{export.bundle['u_version']}"
    )
    llama = None
    blockers = llama_blockers(manifest, export.projects_boundary)
    if args.hf_llama:
        if blockers:
            say(f"hf-llama: skipped: not exportable as LLaMA, it would compute another function: {'; '.join(blockers)}")
        else:
            write_llama(manifest, export.bundle, Path(args.hf_llama))
            llama = args.hf_llama
            say(
                f"hf-llama: wrote {args.hf_llama} (config.json, model.safetensors; T_fixed + T_S folded into "
                f"embed_tokens; the float32 chain, without the swarm's {manifest.wire_dtype} wire rounding)"
            )
    return {
        "out": str(out),
        "run_id": manifest.run_id,
        "stages": export.bundle["stages"],
        "parameters": parameters,
        "u_version": export.bundle["u_version"],
        "notes": export.notes,
        "hf_llama": llama,
        "llama_blockers": blockers,
    }


def from_swarm(manifest: Manifest, initial_peers: list[str], timeout: float, single_peer_ok: bool) -> Export:
    """Every stage downloaded from the run's live peers and confirmed by their records, then verified and
    bundled as checkpoints on disk are; a stage's source reads `peer:<peer id>`."""
    run = download_run(manifest, initial_peers, timeout, single_peer_ok)
    chosen = {
        index: StageCheckpoint(
            path=Path(f"peer:{stage.donor}"),
            run_id=manifest.run_id,
            stage=index,
            epoch=stage.epoch,
            model=stage.model,
            mtime=time.time(),
            u_version=run.u_version,
            u=run.u,
        )
        for index, stage in run.stages.items()
    }
    return bundle_stages(manifest, Selection(chosen, run.notes))


def cmd_generate(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 0 or args.top_k < 0:
        return refuse_start(PROG, "--max-new-tokens and --top-k must not be negative")
    try:
        model = load_bundle(Path(args.model), args.device)
        tokenizer = _tokenizer(model.manifest.tokenizer)
        prompt = [int(i) for i in tokenizer.encode(args.prompt)]
        if any(i >= model.manifest.model.vocab_size for i in prompt):
            raise ExportError("the tokenizer gave ids beyond the model's vocabulary")
        if not args.json:
            print(args.prompt, end="", flush=True)
        new = generate_ids(
            model.stages,
            prompt,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
            wire=not args.no_wire,
        )
    except (ExportError, DataError) as exc:
        return refuse_start(PROG, exc)
    completion = tokenizer.decode(new)
    if args.json:
        print(
            json.dumps(
                {"run_id": model.manifest.run_id, "prompt": args.prompt, "completion": completion, "tokens": new}
            )
        )
    else:
        print(completion)
    return 0


def _tokenizer(spec: str):
    """The manifest's tokenizer; `hf:` ones need the `hf` extra and may need the network, either failure one line."""
    try:
        return make_tokenizer(spec)
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - tokenizers' download errors come in many types
        raise ExportError(f"cannot load tokenizer {spec!r}: {str(exc).strip().splitlines()[0][:200]}") from None


def add_export_parsers(sub) -> None:
    export = sub.add_parser(
        "export",
        help="assemble one model file from a run's stage checkpoints, verified against the manifest",
        description="Assemble one model file (torch.load(..., weights_only=True)) from a run's stage checkpoints "
        "on disk, or from its live peers (--from-swarm), each verified against the manifest.",
    )
    export.add_argument(
        "checkpoints",
        nargs="*",
        metavar="PATH",
        help="checkpoint files, or folders searched for stage*.pt (peers' --checkpoint-dir, a local swarm's work dir)",
    )
    export.add_argument(
        "--from-swarm",
        action="append",
        metavar="ADDR",
        help="instead of files: download every stage from the run's live peers, reached through this DHT address "
        "(repeat for more); a state is taken only if two peers of its stage announce its hash",
    )
    export.add_argument(
        "--accept-single-peer-stages",
        action="store_true",
        help="with --from-swarm, take a stage that shows only one peer on that peer's own word",
    )
    export.add_argument(
        "--timeout", type=float, default=120.0, help="with --from-swarm, seconds to wait for every stage's state"
    )
    export.add_argument("--manifest", help="the run's manifest (default: manifest.json at the top of a folder given)")
    export.add_argument("--out", help="the model file to write (default: <run_id>.pt)")
    export.add_argument(
        "--hf-llama",
        metavar="DIR",
        help="also write a Hugging Face LlamaForCausalLM checkpoint there, if the run's function is a plain LLaMA",
    )
    export.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    export.set_defaults(func=cmd_export)

    generate = sub.add_parser("generate", help="sample text from a model file written by `protocol-swarm export`")
    generate.add_argument("--model", required=True, help="the file `protocol-swarm export` wrote")
    generate.add_argument("--prompt", required=True, help="text to continue")
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.8, help="0 = always the most likely token")
    generate.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    generate.add_argument("--seed", type=int, default=0, help="sampling seed")
    generate.add_argument(
        "--no-wire",
        action="store_true",
        help="chain the stages in float32; by default every boundary is rounded as the swarm's wire does",
    )
    generate.add_argument("--device", default="cpu", help="torch device to run on")
    generate.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    generate.set_defaults(func=cmd_generate)
