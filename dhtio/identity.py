"""Who signs a peer's records: its RSA key files and the libp2p peer id a signing key stands for.

Here rather than in `swarm.records` because they are built on hivemind's key, key-format and peer id
classes, and importing any of hivemind loads its DHT node and P2P daemon (tests/test_layering.py).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path

import multihash
from cryptography.hazmat.primitives import serialization
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey


def load_or_create_rsa_key(path: str | Path | None) -> RSAPrivateKey:
    """The key that signs this peer's records; persisted so a restart keeps its identity."""
    if path is None:
        return RSAPrivateKey()
    path = Path(path)
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    if path.exists():
        key.__setstate__({"_private_key": path.read_bytes()})
        return key
    key = RSAPrivateKey()
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # private from the first byte
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(key.to_bytes())
    return key


def load_identity_key(identity_path: str | Path) -> RSAPrivateKey:
    """The RSA key inside a libp2p identity file (hivemind's `P2P.generate_identity` format): signing
    records with it binds them to the peer id libp2p derives from the same key."""
    data = crypto_pb2.PrivateKey.FromString(Path(identity_path).read_bytes())
    if data.key_type != crypto_pb2.KeyType.RSA:
        raise ValueError(f"identity {identity_path} is not an RSA key")
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": data.data})
    return key


_OWNER_RE = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX)


@functools.lru_cache(maxsize=4096)
def peer_id_of_owner(owner: bytes) -> str | None:
    """The libp2p peer id (base58) of the RSA key in a subkey `[owner:ssh-rsa ...]`, None if it has none.

    The same derivation as hivemind's `PeerID.from_identity`: sha2-256 multihash of the protobuf
    `PublicKey(RSA, DER SubjectPublicKeyInfo)`."""
    found = _OWNER_RE.findall(owner)
    if len(set(found)) != 1:
        return None
    try:
        public = serialization.load_ssh_public_key(found[0])
        der = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    except (ValueError, TypeError):
        return None
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()
