"""`protocol-tracker`: the run's front door (manifest, bootstrap) and its status page.

Every flag can also come from the environment as PROTOCOL_TRACKER_<FLAG> (dashes become
underscores, e.g. PROTOCOL_TRACKER_INITIAL_PEERS); a flag on the command line wins. The
convention, lists included, is `swarm/flags.py`'s.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import sys
import textwrap
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from p2pio.budget import add_budget_flags, budget_from_flags
from swarm.flags import EnvDefaultsParser, add_log_level, refuse_start
from swarm.manifest import ManifestError, load_manifest
from tracker.summary import DEFAULT_STALE_AFTER, POLL_INTERVAL

logger = logging.getLogger("tracker")
PROG = "protocol-tracker"
ENV_PREFIX = "PROTOCOL_TRACKER_"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
OLD_DEFAULT_DB = "tracker-history.sqlite"  # --db's default until it moved to the per-user data directory


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Wraps flag help at spaces only, so a path such as the default --db is never cut at a hyphen."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def build_parser() -> argparse.ArgumentParser:
    p = EnvDefaultsParser(
        prog=PROG,
        description=__doc__,
        formatter_class=_HelpFormatter,
        env_prefix=ENV_PREFIX,
    )
    p.add_argument("--manifest", required=True, help="the run manifest (JSON)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port; 0 picks a free one")
    p.add_argument(
        "--db",
        help="SQLite file for the run's history: loss/throughput charts, the run's counters, peers to rejoin "
        "through (default: $XDG_DATA_HOME/protocol-swarm/tracker-<run_id>.sqlite, with ~/.local/share when "
        "XDG_DATA_HOME is unset). Rows are keyed by run id, so a file shared by several runs keeps each "
        "run's apart and a restart of the same run resumes its own",
    )
    p.add_argument(
        "--identity",
        help="libp2p identity file (created if missing); keeps the bootstrap address stable across restarts",
    )
    p.add_argument(
        "--initial-peers",
        nargs="*",
        default=[],
        help="multiaddrs of other DHT nodes of the run (e.g. another tracker)",
    )
    p.add_argument(
        "--host-maddrs",
        nargs="*",
        help="where the DHT node listens (default: loopback when --host is loopback, else all interfaces; "
        "pin a port, e.g. /ip4/0.0.0.0/tcp/31337, for an address that survives restarts)",
    )
    p.add_argument(
        "--announce-maddrs",
        nargs="*",
        help="public multiaddrs to hand out (behind NAT or a port forward)",
    )
    p.add_argument("--poll-interval", type=float, default=POLL_INTERVAL,
                   help=f"seconds between DHT reads (default {POLL_INTERVAL:g})")
    p.add_argument(
        "--stale-after",
        type=float,
        default=DEFAULT_STALE_AFTER,
        help=f"warn about a peer whose record is not refreshed for this long ({DEFAULT_STALE_AFTER:g}s)",
    )
    p.add_argument(
        "--relay-service",
        choices=("on", "off"),
        default="on",
        help="relay trips for peers behind NAT that register with this node (tracker/relay.py; default on)",
    )
    add_budget_flags(p)
    add_log_level(p)
    return p


def default_host_maddrs(host: str) -> list[str]:
    """A tracker that serves HTTP only locally keeps its DHT local too; a public one listens everywhere."""
    if host in ("127.0.0.1", "localhost"):
        return ["/ip4/127.0.0.1/tcp/0"]
    if host == "::1":
        return ["/ip6/::1/tcp/0"]
    return ["/ip4/0.0.0.0/tcp/0"]


def default_history_path(run_id: str, environ: Mapping[str, str] = os.environ) -> Path:
    """Where a run's history lives unless --db says: the per-user data directory (XDG), one file per run.

    Not the current directory: a history there was picked up by whatever run was started from the
    same folder next. The run id (characters unsafe in a file name replaced) names the file, so even
    without the rows' run key two runs would not share a file by default.
    """
    base = environ.get("XDG_DATA_HOME", "")
    if not os.path.isabs(base):  # unset, empty or relative: the XDG spec says to ignore it
        base = os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "protocol-swarm" / f"tracker-{re.sub(r'[^A-Za-z0-9._-]', '_', run_id)}.sqlite"


def _listen(host: str, port: int) -> socket.socket:
    """Bind before starting anything else: a taken port fails fast, and port 0 tells us its number."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _display_url(host: str, port: int) -> str:
    shown = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host, f"[{host}]" if ":" in host else host)
    return f"http://{shown}:{port}"


def _raise_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from p2pio.sockets import remove_own_socket_dir, use_own_socket_dir
    from tracker.app import create_app
    from tracker.history import History, HistoryError
    from tracker.relay import TrackerRelay
    from tracker.service import SwarmMonitor, dht_fetch, start_dht

    try:
        manifest = load_manifest(args.manifest)
    except ManifestError as exc:
        return refuse_start(PROG, exc)
    if not manifest.t_fixed_sha256 or not manifest.u_sha256:
        logger.warning(
            "manifest records no T_fixed/U hashes: peers cannot verify them (use a preset or "
            "`protocol-swarm inspect --write`)"
        )
    if args.poll_interval <= 0 or args.stale_after <= 0:
        return refuse_start(PROG, "--poll-interval and --stale-after must be positive")
    try:
        budget = budget_from_flags(args)
    except ValueError as exc:
        return refuse_start(PROG, str(exc))
    try:
        sock = _listen(args.host, args.port)
    except OSError as exc:
        return refuse_start(PROG, f"cannot listen on {args.host}:{args.port}: {exc}")
    port = sock.getsockname()[1]
    url = _display_url(args.host, port)
    if args.identity is None:
        logger.warning("no --identity: the DHT peer id (and so the bootstrap address) changes on every restart")
    elif os.path.dirname(os.path.abspath(args.identity)):
        os.makedirs(os.path.dirname(os.path.abspath(args.identity)), exist_ok=True)

    dht = history = monitor = relay = None
    signal.signal(signal.SIGTERM, _raise_exit)  # so a SIGTERM still runs the cleanup below
    try:
        db = args.db or default_history_path(manifest.run_id)
        if args.db is None and os.path.exists(OLD_DEFAULT_DB):
            logger.warning(
                "%s in this folder is the history's old default and is no longer read (it names no run); "
                "run %s keeps its history in %s",
                OLD_DEFAULT_DB,
                manifest.run_id,
                db,
            )
        try:
            history = History(db, manifest.run_id)
        except HistoryError as exc:
            return refuse_start(PROG, exc)
        others = history.other_runs()
        logger.info(
            "history of run %s in %s (%d samples%s)",
            manifest.run_id,
            db,
            history.count(),
            f"; the file keeps {others} other run(s) apart" if others else "",
        )
        use_own_socket_dir()  # hivemind's sockets where the cleanup below removes them (p2pio/sockets.py)
        try:
            dht = start_dht(
                manifest,
                identity=args.identity,
                initial_peers=args.initial_peers,
                host_maddrs=args.host_maddrs or default_host_maddrs(args.host),
                announce_maddrs=args.announce_maddrs,
                remembered=history.remembered_peers(),
            )
        except Exception as exc:
            return refuse_start(PROG, f"cannot start the DHT node: {type(exc).__name__}: {exc}", status=1)
        maddrs = [str(a) for a in dht.get_visible_maddrs()]
        logger.info("DHT node %s listening on %s", dht.peer_id, " ".join(maddrs))
        if args.relay_service == "on":
            relay = TrackerRelay(dht, manifest, budget)
            try:
                relay.start()
            except Exception as exc:
                return refuse_start(PROG, f"cannot start the trip relay: {type(exc).__name__}: {exc}", status=1)
        monitor = SwarmMonitor(
            manifest,
            history,
            dht_fetch(dht, manifest),
            bootstrap=dht.get_visible_maddrs,
            poll_interval=args.poll_interval,
            stale_after=args.stale_after,
            own_peer_id=str(dht.peer_id),
        )
        monitor.poll_once()
        monitor.start()
        config = uvicorn.Config(
            create_app(monitor),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
        server = uvicorn.Server(config)

        def announce_ready() -> None:
            while not server.started and not server.should_exit:
                time.sleep(0.05)
            if server.started:
                logger.info(
                    "tracker ready at %s/ (run %s, %d stages, bootstrap %s)",
                    url,
                    manifest.run_id,
                    manifest.num_stages,
                    " ".join(maddrs),
                )

        threading.Thread(target=announce_ready, name="tracker-ready", daemon=True).start()
        server.run(sockets=[sock])
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        stopping = time.monotonic()
        if monitor is not None:
            monitor.stop()
        if relay is not None:
            relay.stop()
        if dht is not None:
            dht.shutdown()
        remove_own_socket_dir()
        if history is not None:
            history.close()
        sock.close()
        logger.info("tracker stopped (cleanup took %.1fs)", time.monotonic() - stopping)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = getattr(logging, args.log_level)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
