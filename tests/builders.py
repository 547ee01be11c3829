"""Small manifests, and schema-valid stage records for tests that need a swarm's worth of them without
running peers."""

from __future__ import annotations

from swarm.manifest import BatchSpec, Manifest, ModelShape
from swarm.presets import preset
from swarm.records import SOFTWARE_VERSION, StagePeerRecord

TINY = preset("tiny", stages=3)


def tiny_manifest(
    compression: str = "subspace",
    n_layers: int = 2,
    stages: int = 2,
    wire_dtype: str = "fp32",
    microbatch: int = 2,
    target: int | None = None,
    vocab_size: int = 256,
    **overrides,
) -> Manifest:
    """A model small enough for unit tests (d=64, k=4, sequences of 32 tokens); `target` defaults to one
    microbatch per optimizer step; other keyword arguments replace manifest fields."""
    shape = ModelShape(
        d_model=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=vocab_size, max_seq_len=64
    )
    batch = BatchSpec(microbatch_size=microbatch, seq_len=32, target_batch_size=target or microbatch)
    return preset(
        "tiny", model=shape, k=4, stages=stages, compression=compression, wire_dtype=wire_dtype, batch=batch,
        **overrides,
    )


def stage_record(stage: int, name: str = "peer", manifest: Manifest = TINY, **changes) -> StagePeerRecord:
    """An idle, online peer of `stage` at U v0 of `manifest`; keyword arguments replace fields."""
    fields = dict(
        peer_id=f"12D3Koo-{stage}-{name}",
        state="online",
        stage=stage,
        throughput=100.0,
        load=0,
        u_version=0,
        u_sha256=manifest.u_sha256,
        t_fixed_sha256=manifest.t_fixed_sha256,
        software_version=SOFTWARE_VERSION,
        public_name=name,
        addrs=[],
        trips=0,
        tokens=0,
        bytes_in=0,
        bytes_out=0,
        errors=0,
        loss=None,
        optimizer_epoch=0,
    )
    fields.update(changes)
    return StagePeerRecord(**fields)


def dht_with_record(initial_peers: list[str], manifest: Manifest, stage: int, workdir, name: str = "outsider"):
    """A hivemind node on loopback with a fresh identity, announcing an online record of `stage` under its
    own peer id (signed with its identity key, as peers do) unless `stage` is None: a stand-in for a
    peer of that stage, or a stranger. Returns the DHT; the caller shuts it down."""
    from pathlib import Path

    from hivemind.dht import DHT
    from hivemind.p2p import P2P

    from dhtio.identity import load_identity_key
    from dhtio.records import announce
    from dhtio.validators import make_validators

    identity = Path(workdir) / f"{name}.id"
    P2P.generate_identity(str(identity))
    signer, validators = make_validators(manifest, load_identity_key(identity))
    dht = DHT(
        start=True,
        initial_peers=initial_peers,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        identity_path=str(identity),
        check_if_identity_free=False,
        record_validators=validators,
    )
    if stage is not None:
        record = stage_record(stage, name, manifest=manifest, peer_id=str(dht.peer_id), throughput=1000.0)
        assert announce(dht, manifest, signer, record, ttl=300.0)
    return dht
