"""Joining the run's DHT: the peer's libp2p identity, the record validators bound to it, and the flags its
p2pd starts with (`peer/reachability.py`).

Records are signed with the libp2p identity key itself, so they are bound to this peer id (`dhtio.validators`);
without `--identity` a fresh one is made for this run in a private temporary directory, removed when the peer
stops (or here, when joining fails). The DHT's child process (and the p2pd it starts) inherit SIGINT and
SIGTERM ignored: a signal to the whole process group reaches only the peer, which then leaves in order and stops
them itself (`peer/processes.py`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hivemind.dht import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P
from hivemind.utils.crypto import RSAPrivateKey

from dhtio.identity import load_identity_key
from dhtio.validators import make_validators
from p2pio.sockets import use_own_socket_dir
from peer.options import PeerOptions
from peer.processes import stop_signals_ignored_by_children
from peer.reachability import daemon_flags, relay_options, relay_service_flags, route_source
from swarm.manifest import Manifest


@dataclass
class Joined:
    dht: DHT
    signer: RSASignatureValidator  # signs this peer's records (`dhtio.validators.make_validators`)
    signing_key: RSAPrivateKey  # the signer's key: hivemind's progress tracker must sign with it too
    temp_identity: Path | None  # the throwaway identity's directory, None with --identity


def join_dht(manifest: Manifest, options: PeerOptions) -> Joined:
    use_own_socket_dir()  # before the DHT forks: its p2pd, and every process after it, put their sockets there
    identity, temp = options.identity, None
    kwargs: dict = dict(start=True, host_maddrs=options.host_maddrs, initial_peers=options.initial_peers)
    if identity is None:
        temp = Path(tempfile.mkdtemp(prefix="protocol-peer-id-"))
        identity = str(temp / "identity")
    try:
        if not os.path.exists(identity):
            Path(identity).parent.mkdir(parents=True, exist_ok=True)
            P2P.generate_identity(identity)
            kwargs["check_if_identity_free"] = False  # made just now: nobody else can hold it
        key = load_identity_key(identity)
        signer, validators = make_validators(manifest, key)
        kwargs["record_validators"] = validators
        kwargs["identity_path"] = identity
        if options.announce_maddrs:
            kwargs["announce_maddrs"] = options.announce_maddrs
        kwargs.update(relay_options(options.relay, options.announce_maddrs, options.host_maddrs, route_source()))
        flags = relay_service_flags(options.relay_service, options.relay_budget)
        with stop_signals_ignored_by_children(), daemon_flags(flags):
            return Joined(DHT(**kwargs), signer, key, temp)
    except BaseException:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
        raise
