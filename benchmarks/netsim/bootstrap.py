"""The run's bootstrap DHT node, meant to run inside a netsim namespace.

    python -m benchmarks.netsim.bootstrap --manifest M.json --host 10.77.0.1 --out DIR

Writes `DIR/maddrs.json` once the node listens, then every `--interval` seconds rewrites
`DIR/records.json` (atomically) with every stage's live peer records; each record also gets
`announced_at`, the wall-clock time the peer stored it (its DHT expiration minus the TTL), so the
harness can measure rates from the peers' own counters without the records' staleness.
Stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from pathlib import Path

from hivemind.dht import DHT

from dhtio.identity import load_or_create_rsa_key
from dhtio.records import fetch_stages
from dhtio.validators import make_validators
from swarm.manifest import load_manifest
from swarm.records import RECORD_TTL


def _write(path: Path, data) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--manifest", required=True)
    parser.add_argument("--host", required=True, help="IPv4 address to listen on")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--out", required=True, help="directory for maddrs.json and records.json")
    parser.add_argument("--interval", type=float, default=1.0)
    args = parser.parse_args(argv)
    manifest = load_manifest(args.manifest)
    out = Path(args.out)
    _, validators = make_validators(manifest, load_or_create_rsa_key(None))
    dht = DHT(start=True, host_maddrs=[f"/ip4/{args.host}/tcp/{args.port}"], record_validators=validators)
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    try:
        _write(out / "maddrs.json", [str(a) for a in dht.get_visible_maddrs()])
        while not stopping:
            started = time.time()
            try:
                stages = fetch_stages(dht, manifest)
            except Exception as exc:  # noqa: BLE001 - keep polling; the harness sees stale data
                print(f"bootstrap: fetch failed: {exc}", flush=True)
                stages = None
            if stages is not None:
                records = []
                for entries in stages.values():
                    for entry in entries:
                        record = entry.record.dict()
                        record["announced_at"] = entry.expiration - RECORD_TTL
                        records.append(record)
                _write(out / "records.json", {"time": time.time(), "records": records})
            time.sleep(max(0.05, args.interval - (time.time() - started)))
    finally:
        dht.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
