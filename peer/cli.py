"""`protocol-peer`: the daemon a volunteer runs. Every flag can also come from an environment
variable (PROTOCOL_PEER_<FLAG>, e.g. PROTOCOL_PEER_STAGE=auto) so a container is configured with -e;
the convention, lists included, is `swarm/flags.py`'s.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import traceback

from p2pio.budget import add_budget_flags, budget_from_flags
from p2pio.framing import MIN_RATE
from peer.audit import AUDIT_RATE
from peer.daemon import PeerDaemon
from peer.lanes import lane_refusal
from peer.options import PeerOptions
from peer.processes import exit_now
from peer.stage_averagers import GradientWire
from peer.status_log import LOG_FORMAT
from peer.trip_flavour import LaneTrips, PipelineTrips
from swarm.flags import EnvDefaultsParser, add_log_level, refuse_start
from swarm.manifest import Manifest, ManifestError, load_manifest, parse_manifest
from swarm.presets import verify_hashes

ENV_PREFIX = "PROTOCOL_PEER_"


class StartupError(Exception):
    """A reason not to start, printed as one line."""


def build_parser() -> argparse.ArgumentParser:
    parser = EnvDefaultsParser(
        prog="protocol-peer",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        env_prefix=ENV_PREFIX,
    )
    parser.add_argument(
        "--stage",
        default="auto",
        help="stage to serve: a number, or 'auto' to join the stage that needs help most "
        "(an empty one first, else the weakest by throughput) and move later if that "
        "clearly helps the swarm",
    )
    parser.add_argument(
        "--lane",
        default="auto",
        help="with context parallelism (the manifest's context_parallel.size P > 1): the chunk of every sequence to "
        "hold, 0..P-1, or 'auto' to take an empty lane of the stage first, else its weakest",
    )
    parser.add_argument("--tracker", help="tracker URL: the manifest and bootstrap addresses come from it")
    parser.add_argument(
        "--initial-peers",
        nargs="*",
        default=[],
        metavar="MADDR",
        help="multiaddrs of peers already in the swarm (with /p2p/<id>)",
    )
    parser.add_argument("--new-swarm", action="store_true", help="start a new run as its first peer (needs --manifest)")
    parser.add_argument("--manifest", help="run manifest JSON file (with --new-swarm, or to join without a tracker)")
    parser.add_argument(
        "--host-maddrs",
        nargs="*",
        default=["/ip4/0.0.0.0/tcp/0"],
        metavar="MADDR",
        help="addresses to listen on, e.g. /ip4/0.0.0.0/tcp/31337 to pin the P2P port",
    )
    parser.add_argument(
        "--announce-maddrs",
        nargs="*",
        default=[],
        metavar="MADDR",
        help="addresses other peers should dial, e.g. your public IP and forwarded port behind NAT",
    )
    parser.add_argument(
        "--relay",
        default="auto",
        choices=("auto", "on", "off"),
        help="when no other peer can dial this one (checked at start), register with a directly reachable peer "
        "that relays trips (peer/relay.py) and name it in this peer's record; 'auto' and 'on' do, 'off' never",
    )
    parser.add_argument(
        "--relay-service",
        default="on",
        choices=("on", "off"),
        help="relay trips for peers behind NAT that register with this one (worth it on a public address)",
    )
    add_budget_flags(parser)
    parser.add_argument(
        "--identity",
        help="file with this peer's private key; created if missing, keeps the "
        "peer id (and record ownership) across restarts",
    )
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where the stage runs")
    parser.add_argument("--public-name", default="", help="name shown on the tracker page (max 64 chars)")
    parser.add_argument(
        "--checkpoint-dir", help="save the stage here periodically and on exit; resume an empty stage from here"
    )
    parser.add_argument("--checkpoint-every", type=int, default=50, help="optimizer epochs between checkpoints")
    parser.add_argument("--max-inflight", type=int, help="trips a driver (stage 0) keeps in flight, at most: fewer "
                        "where a quarter of the free memory holds fewer trips' activations; default "
                        f"{PipelineTrips.default_inflight}, with context parallelism {LaneTrips.default_inflight}")
    parser.add_argument(
        "--audit-rate",
        type=float,
        default=AUDIT_RATE,
        help="share of a verified next-hop peer's trips also sent to another peer of its stage to compare replies",
    )
    parser.add_argument("--grad-averaging", choices=[w.value for w in GradientWire], default=GradientWire.FP16.value,
                        help="what this peer sends its stage's other peers for its gradients at each optimizer epoch; "
                        "fp16 halves those bytes, fp32 is exact (either averages with peers sending the other)")
    parser.add_argument("--data", help="text file or directory for drivers (default: the manifest's dataset)")
    parser.add_argument("--trip-timeout", type=float, default=60.0, help="seconds to wait for the next hop")
    parser.add_argument(
        "--min-stream-kbit",
        type=float,
        default=MIN_RATE * 8 / 1000,
        help="the rate (kbit/s) every incoming trip or K/V stream must keep, or it is cut (a stalled sender holds "
        "no receive slot); lower it on links slower than this, where dense messages would be cut",
    )
    parser.add_argument(
        "--rebalance-interval", type=float, default=60.0, help="seconds between placement re-checks with --stage auto"
    )
    parser.add_argument(
        "--placement-delay",
        type=float,
        default=3.0,
        help="maximum random delay before choosing a stage (avoids a herd)",
    )
    parser.add_argument(
        "--heartbeat-file",
        help="rewrite this JSON file every few seconds while the peer runs (for container health checks)",
    )
    parser.add_argument("--log-interval", type=float, default=5.0, help="seconds between progress log lines")
    add_log_level(parser)
    parser.add_argument("--fault-t-fixed-seed", type=int, help=argparse.SUPPRESS)  # fault injection for tests
    parser.add_argument("--fault-cp-version", type=int, help=argparse.SUPPRESS)  # fault injection for tests
    parser.add_argument("--fault-poison-served-state", action="store_true", help=argparse.SUPPRESS)  # for tests
    return parser


def _from_tracker(url: str) -> tuple[Manifest, list[str]]:
    import httpx

    base = url.rstrip("/")
    try:
        run = httpx.get(f"{base}/api/v1/run", timeout=10).raise_for_status().json()
        bootstrap = httpx.get(f"{base}/api/v1/bootstrap", timeout=10).raise_for_status().json()
    except (httpx.HTTPError, ValueError) as exc:
        raise StartupError(f"cannot reach the tracker at {base}: {exc}") from None
    manifest = parse_manifest(run["manifest"])
    if run.get("run_id") != manifest.run_id:
        raise StartupError(f"tracker's run_id {run.get('run_id')!r} does not match its manifest ({manifest.run_id})")
    return manifest, list(bootstrap.get("initial_peers", []))


def resolve(args: argparse.Namespace) -> tuple[Manifest, PeerOptions]:
    """The run's manifest and this peer's options from its flags, every flag checked before anything starts."""
    initial_peers = list(args.initial_peers)
    if args.tracker:
        manifest, from_tracker = _from_tracker(args.tracker)
        initial_peers = initial_peers or from_tracker
    elif args.manifest:
        manifest = load_manifest(args.manifest)
    else:
        raise StartupError("need --tracker URL, or --manifest FILE (with --initial-peers, or --new-swarm)")
    if not args.new_swarm and not initial_peers:
        raise StartupError("no initial peers: pass --initial-peers, --tracker, or --new-swarm to start a run")
    if args.fault_t_fixed_seed is None:
        verify_hashes(manifest)
    spec = manifest.context_parallel
    if spec is not None and spec.compressed and spec.warm_start_steps > 0:
        # the simulator crosses K/V dense for these steps, then switches to a PCA basis; peers run no such warm-up,
        # so they would train another run than the simulator's under the same run id
        raise StartupError(
            f"context_parallel.warm_start_steps is {spec.warm_start_steps}: peers run no dense K/V warm-up (use 0)"
        )
    if args.stage != "auto":
        try:
            stage = int(args.stage)
        except ValueError:
            raise StartupError(f"--stage must be 'auto' or a number, got {args.stage!r}") from None
        if not 0 <= stage < manifest.num_stages:
            raise StartupError(f"--stage {stage} is out of range: the run has stages 0..{manifest.num_stages - 1}")
    if args.max_inflight is not None and args.max_inflight < 1:
        raise StartupError("--max-inflight must be at least 1")
    if not 0.0 <= args.audit_rate <= 1.0:
        raise StartupError(f"--audit-rate must be within 0..1, got {args.audit_rate}")
    if not args.min_stream_kbit > 0:
        raise StartupError(f"--min-stream-kbit must be positive, got {args.min_stream_kbit}")
    try:
        budget = budget_from_flags(args)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    return manifest, PeerOptions(
        stage=str(args.stage),
        lane=parse_lane(args.lane, manifest),
        initial_peers=initial_peers,
        host_maddrs=args.host_maddrs,
        announce_maddrs=args.announce_maddrs,
        identity=args.identity,
        device=args.device,
        public_name=args.public_name,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=int(args.checkpoint_every),
        heartbeat_file=args.heartbeat_file,
        max_inflight=args.max_inflight,
        data=args.data,
        trip_timeout=float(args.trip_timeout),
        min_stream_rate=args.min_stream_kbit * 1000 / 8,
        placement_delay=float(args.placement_delay),
        rebalance_interval=float(args.rebalance_interval),
        log_interval=float(args.log_interval),
        fault_t_fixed_seed=args.fault_t_fixed_seed,
        fault_cp_version=args.fault_cp_version,
        fault_poison_served_state=args.fault_poison_served_state,
        audit_rate=float(args.audit_rate),
        gradient_wire=GradientWire(args.grad_averaging),
        relay=args.relay,
        relay_service=args.relay_service == "on",
        relay_budget=budget,
    )


def parse_lane(value: str, manifest: Manifest) -> int | None:
    """`--lane`: None for 'auto', else a lane the run's stages have."""
    if value == "auto":
        return None
    try:
        lane = int(value)
    except ValueError:
        raise StartupError(f"--lane must be 'auto' or a number, got {value!r}") from None
    refusal = lane_refusal(lane, manifest.lanes)
    if refusal is not None:
        raise StartupError(refusal)
    return lane


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT)
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        manifest, options = resolve(args)
        daemon = PeerDaemon(manifest, options)
        try:
            daemon.start_dht()
        except Exception as exc:  # noqa: BLE001 - hivemind raises bare errors for unreachable peers
            daemon.stop_processes()  # what the failed start left: a DHT process, p2pd, their sockets
            raise StartupError(
                f"could not join the DHT via {' '.join(options.initial_peers) or 'a new swarm'}: "
                f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            ) from None
    except (StartupError, ManifestError) as exc:
        return refuse_start("protocol-peer", exc)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    code = 0
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(daemon.main())
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 - reported, then the same hard exit
        traceback.print_exc()
        code = 1
    # The peer has left, saved its checkpoint and stopped its child processes. A DHT call abandoned at
    # its timeout (p2pd killed by a group signal) may still hold a worker thread that interpreter
    # shutdown would join forever, so the process ends here (`exit_now`: logs flushed, sockets removed).
    exit_now(code)


if __name__ == "__main__":
    sys.exit(main())
