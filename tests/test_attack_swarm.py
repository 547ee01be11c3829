"""Attacks on a live peer by a raw hivemind client: what a hostile volunteer can and cannot make a peer do."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import torch
from builders import dht_with_record
from harness import entries_by_name, online, swarm_of, wait_for
from hivemind.p2p import PeerID

from peer.transport import send_trip
from swarm.codec import BoundaryCodec
from swarm.model import SubspaceState
from swarm.presets import preset
from swarm.wire import ErrorCode, WireError, expectation_for, raise_if_error

pytestmark = pytest.mark.slow


def test_an_unknown_sender_gets_no_compute_and_a_fresh_driver_is_served():
    manifest = preset("tiny", stages=2)
    codec = BoundaryCodec(manifest, SubspaceState(manifest))
    batch, seq = manifest.batch.microbatch_size, manifest.batch.seq_len
    limit = expectation_for(manifest, 1, "forward", 0, manifest.t_fixed_sha256).max_bytes

    def well_formed_trip() -> bytes:
        tokens = torch.randint(0, manifest.model.vocab_size, (batch, seq))
        hidden = torch.randn(batch, seq, manifest.model.d_model) * 0.02
        return codec.encode_forward(hidden, tokens, uuid.uuid4().hex, to_stage=1)

    trips = [well_formed_trip() for _ in range(4)]
    attempts = 200

    with swarm_of(manifest, name="unknown-sender") as swarm:
        swarm.spawn_peer("tail", "1")
        tail = wait_for(lambda: online(swarm, ["tail"]), 120, "the tail peer online")["tail"].record
        stranger = dht_with_record(swarm.bootstrap, manifest, None, swarm.workdir, "stranger")

        async def send_all(dht, blobs: list[bytes]) -> list[ErrorCode | None]:
            p2p = await dht.replicate_p2p()
            slots = asyncio.Semaphore(4)  # what a driver keeps in flight

            async def one(blob: bytes) -> ErrorCode | None:
                try:
                    async with slots:
                        reply = await send_trip(
                            p2p, PeerID.from_base58(tail.peer_id), manifest.run_id, blob, timeout=60, max_reply=limit
                        )
                    raise_if_error(reply)
                except WireError as exc:
                    return exc.code
                return None

            return await asyncio.gather(*(one(blob) for blob in blobs))

        started = time.monotonic()
        codes = asyncio.run(send_all(stranger, [trips[i % len(trips)] for i in range(attempts)]))
        seconds = time.monotonic() - started
        # refused with `unknown_sender`; a stream the peer refuses before reading it (the transport's `admit`)
        # may reach the sender as a reset instead when the refusal overtakes the sender's own writing
        assert set(codes) <= {ErrorCode.UNKNOWN_SENDER, ErrorCode.UNREACHABLE}, codes
        assert codes.count(ErrorCode.UNKNOWN_SENDER) >= 1
        print(
            f"{attempts} trips of an unknown sender refused in {seconds:.1f}s: "
            f"{codes.count(ErrorCode.UNKNOWN_SENDER)} answered unknown_sender, the rest reset"
        )

        def counted():
            entry = online(swarm, ["tail"])
            return entry and entry["tail"].record.errors >= attempts and entry["tail"]

        record = wait_for(counted, 30, "the tail's record to count the refusals").record
        assert record.trips == 0 and record.tokens == 0 and record.optimizer_epoch == 0

        # a peer that announced a stage-0 record a moment ago is served (the tail re-reads the DHT on a miss)
        driver = dht_with_record(swarm.bootstrap, manifest, 0, swarm.workdir, "driver")
        deadline = time.monotonic() + 15
        while (code := asyncio.run(send_all(driver, trips[:1]))[0]) == ErrorCode.UNKNOWN_SENDER:
            assert time.monotonic() < deadline, "a freshly announced driver was still refused after 15s"
            time.sleep(0.5)
        assert code is None
        def served():
            entry = online(swarm, ["tail"])
            return entry and entry["tail"].record.trips >= 1 and entry["tail"]

        assert wait_for(served, 30, "the served trip in the tail's record").record.trips == 1

        # all the refusals are one log line (per sender and interval), not one per trip
        log = swarm.children[0].log
        stranger_id = str(stranger.peer_id)
        wait_for(lambda: stranger_id in log.read_text(), 30, "the aggregated refusal line")
        lines = [ln for ln in log.read_text().splitlines() if stranger_id in ln]
        assert len(lines) == 1 and f"unknown_sender {attempts}" in lines[0], lines
        stranger.shutdown()
        driver.shutdown()


def test_a_record_claiming_another_peers_id_is_not_stored():
    """An impersonating record (signed with key B, naming peer A's id, claiming 1e12 tokens/s) is refused by
    the DHT nodes it is stored on, so no reader ever sees it beside A's real record."""
    manifest = preset("tiny", stages=2)
    with swarm_of(manifest, name="impersonation") as swarm:
        from builders import stage_record

        from dhtio.identity import load_identity_key
        from dhtio.records import announce, fetch_stages
        from dhtio.validators import make_validators

        honest = dht_with_record(swarm.bootstrap, manifest, 1, swarm.workdir, "honest")
        liar = dht_with_record(swarm.bootstrap, manifest, None, swarm.workdir, "liar")
        liar_signer, _ = make_validators(manifest, load_identity_key(swarm.workdir / "liar.id"))
        forged = stage_record(1, "forged", manifest=manifest, peer_id=str(honest.peer_id), throughput=1e12)
        assert not announce(liar, manifest, liar_signer, forged)
        stages = fetch_stages(swarm.dht, manifest)
        assert [e.record.public_name for e in stages[1]] == ["honest"]
        honest.shutdown()
        liar.shutdown()


FAKE_LOSS = 0.0123


def test_a_fast_liar_in_stage_1_gets_audited_out_and_its_loss_is_never_published():
    """Issue 12's bar for audit trips (peer/audit.py): a hostile peer announcing stage 1 with a claim of 1e12
    tokens/s that answers every trip at once with zero gradients and FAKE_LOSS joins a warmed-up 2-stage swarm.
    Its replies are only ever duplicates compared with the honest tail's: after the first mismatch it is banned
    for minutes, the honest tail carries >= 90% of the trips and the driver never publishes the fake loss. It
    claims the stage's epoch, read from its progress records, so that its replies are compared (peer/audit.py
    AUDIT_MAX_LAG; a liar far in epochs is banned only after LAG_GRACE: tests/test_audit.py)."""
    import threading

    from builders import stage_record

    from benchmarks.attacks import progress_epoch
    from dhtio.identity import load_identity_key
    from dhtio.records import announce
    from dhtio.validators import make_validators
    from peer.transport import TripServicer

    manifest = preset("tiny", stages=2)
    codec = BoundaryCodec(manifest, SubspaceState(manifest))
    served = {"trips": 0}
    claimed = {"epoch": 0}
    stop = threading.Event()

    async def on_trip(blob: bytes, remote: PeerID) -> bytes:
        served["trips"] += 1
        header, hidden, _ = codec.decode_forward(blob, stage=1)
        return codec.encode_backward(torch.zeros_like(hidden), header.trip_id, to_stage=0, loss=FAKE_LOSS,
                                     extra={"versions": [header.u_version], "epochs": [claimed["epoch"]]})

    with swarm_of(manifest, name="fast-liar") as swarm:
        swarm.spawn_peer("driver", "0")
        swarm.spawn_peer("tail", "1")

        def warmed():  # the driver verified the tail by trust on first use (3 clean trips) and kept going
            entries = online(swarm, ["driver", "tail"])
            return entries and entries["driver"].record.trips >= 5 and entries

        warmed_up = wait_for(warmed, 120, "the honest pipeline to carry 5 trips")
        liar = dht_with_record(swarm.bootstrap, manifest, None, swarm.workdir, "liar")
        signer, _ = make_validators(manifest, load_identity_key(swarm.workdir / "liar.id"))

        def serve() -> None:
            async def main() -> None:
                p2p = await liar.replicate_p2p()
                await TripServicer(on_trip, max_bytes=1 << 24).add_p2p_handlers(p2p, namespace=manifest.run_id)
                announced = -float("inf")
                while not stop.is_set():
                    claimed["epoch"] = await asyncio.to_thread(progress_epoch, liar, manifest, 1)
                    if time.monotonic() - announced > 2.0:
                        announced = time.monotonic()
                        record = stage_record(1, "liar", manifest=manifest, peer_id=str(liar.peer_id),
                                              throughput=1e12)
                        await asyncio.to_thread(announce, liar, manifest, signer, record, ttl=60.0)
                    await asyncio.sleep(0.5)

            asyncio.run(main())

        # the liar attacks once the stage's progress records tell its epoch (a lone peer publishes every 10 s:
        # its first record, at epoch 0, extrapolates to nothing)
        wait_for(lambda: progress_epoch(swarm.dht, manifest, 1) >= entries_by_name(swarm)["tail"].record.optimizer_epoch
                 > 0, 60, "the stage's progress records to tell its epoch")
        server = threading.Thread(target=serve, daemon=True)
        liar_before = served["trips"]  # counted from its first announce: the driver may read it before we do
        server.start()
        try:
            wait_for(lambda: len(swarm.poll().get(1, [])) == 2, 30, "the liar's record in the DHT")
            start = entries_by_name(swarm)
            losses = set()
            # 15 s of trips, longer (up to 60 s) until a duplicate reached the liar: the driver first has to
            # read its record and dial it, which a loaded machine can slow down
            started = time.monotonic()
            while time.monotonic() - started < 15 or (served["trips"] == liar_before
                                                       and time.monotonic() - started < 60):
                driver = entries_by_name(swarm).get("driver")
                if driver is not None and driver.record.loss is not None:
                    losses.add(driver.record.loss)
                time.sleep(0.5)
            end = entries_by_name(swarm)
        finally:
            stop.set()
            server.join(timeout=10)
            liar.shutdown()
        driver_trips = end["driver"].record.trips - start["driver"].record.trips
        honest_trips = end["tail"].record.trips - start["tail"].record.trips
        liar_trips = served["trips"] - liar_before
        print(f"after warm-up ({warmed_up['driver'].record.trips} trips): driver {driver_trips} trips, "
              f"honest tail {honest_trips}, liar {liar_trips}; published losses {sorted(losses)[:5]}...")
        assert driver_trips >= 5
        log = next(c.log for c in swarm.children if c.name == "driver").read_text()
        about_liar = [line for line in log.splitlines() if str(liar.peer_id)[-6:] in line][-5:]
        assert liar_trips >= 1, f"the liar was never audited: no duplicate reached it; driver said {about_liar}"
        assert honest_trips >= 0.9 * driver_trips and liar_trips <= max(1, driver_trips // 10)
        assert FAKE_LOSS not in losses and all(loss > 1.0 for loss in losses)
        audits = [line for line in log.splitlines() if "audit:" in line]
        assert len(audits) == 1 and str(liar.peer_id)[-6:] in audits[0], audits
