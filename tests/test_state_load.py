"""A peer takes another's stage state only when the stage's records vouch for it (peer/state_load.py): real
hivemind state averagers (own processes, one DHT each), hostile donors declaring epochs far ahead so that they
are asked first; and the records' rule over signed records, pure."""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import AsyncIterator  # noqa: UP035 - hivemind's servicer reads typing's generic names

import pytest
import torch
from builders import stage_record, tiny_manifest
from hivemind.dht import DHT
from hivemind.optim.state_averager import TrainingStateAverager, dump_optimizer_state
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

import p2pio.state_stream
from p2pio.state_stream import StateStream, read_state
from peer.stage_averagers import PoisonedStateDonor, SnapshotStateAverager
from peer.state_load import _metadata_of, records_pick
from swarm.live_state import LiveStateError, agreeing_state, witnesses_needed
from swarm.model import PipelineStage
from swarm.optim import make_optimizer, parameter_groups
from swarm.records import PeerEntry

PREFIX = "run_stage1_state_averager"
SIZE = 4096


async def _huge_state(
    self, _request: averaging_pb2.DownloadRequest, _context: P2PContext
) -> AsyncIterator[averaging_pb2.DownloadData]:
    """A donor naming a tensor of 2^40 float32 elements: hivemind's own reader would allocate it."""
    metadata = MSGPackSerializer.dumps({"epoch": 10**9})
    yield averaging_pb2.DownloadData(
        metadata=metadata, tensor_part=runtime_pb2.Tensor(dtype="float32", size=[2**40], buffer=b"\0" * 16)
    )


# hivemind names RPC handlers after the class: hostile donors answer under the honest class's name
HugeDonor = type("SnapshotStateAverager", (TrainingStateAverager,), {"rpc_download_state": _huge_state})


def _averager(cls, dht: DHT, value: float, weight_decay: float = 0.0) -> TrainingStateAverager:
    params = [torch.nn.Parameter(torch.full((SIZE,), value))]
    return cls(dht=dht, optimizer=partial(torch.optim.Adam, lr=0.1, weight_decay=weight_decay), params=params,
               prefix=PREFIX, min_matchmaking_time=1.0, request_timeout=3.0, start=True)


def _declared(dht: DHT) -> list[float]:
    """The priorities the stage's donors declared, highest first."""
    found = dht.get(f"{PREFIX}.all_averagers", latest=True)
    return sorted((info.value for info in found.value.values()), reverse=True) if found is not None else []


@pytest.mark.slow
def test_a_joiner_refuses_states_the_records_do_not_vouch_for_and_takes_the_next_donors():
    first = DHT(start=True)
    dhts, averagers = [first], []
    try:
        dhts += [DHT(start=True, initial_peers=first.get_visible_maddrs()) for _ in range(4)]
        honest = _averager(SnapshotStateAverager, dhts[1], 1.0)
        poisoned = _averager(PoisonedStateDonor, dhts[2], 1.0)  # serves 1.5, declares a million epochs ahead
        huge = _averager(HugeDonor, dhts[3], 1.0)
        # honest parameters, but an optimizer whose weight decay of 100 would flip every weight's sign at a step
        decaying = _averager(SnapshotStateAverager, dhts[4], 1.0, weight_decay=100.0)
        averagers += [honest, poisoned, huge, decaying]
        honest.state_sharing_priority = 1.0
        poisoned.state_sharing_priority = 1.0
        decaying.state_sharing_priority = 1e5
        huge.state_sharing_priority = 2e6  # asked first of all
        joiner = _averager(SnapshotStateAverager, first, 0.0)
        averagers.append(joiner)
        deadline = time.monotonic() + 60
        while _declared(first)[:4] != [2e6, 1e6 + 1, 1e5, 1.0]:
            assert time.monotonic() < deadline, "the donors never declared themselves"
            time.sleep(0.5)
        offered: list[list[tuple[str, float]]] = []

        def choose(candidates: list[tuple[int, list[torch.Tensor], str]]) -> int | None:
            offered.append([(donor, float(params[0].mean())) for _, params, donor in candidates])
            honest_ones = [i for i, (_, params, _) in enumerate(candidates) if torch.equal(params[0], torch.ones(SIZE))]
            return honest_ones[0] if honest_ones else None  # what the test's records would announce

        joiner.choose = choose
        joiner.load_state_from_peers()
        ids = {a.peer_id.to_base58(): name for a, name in ((honest, "honest"), (poisoned, "poisoned"))}
        # the huge donor was read first and refused by the reader (never offered), the decaying one's optimizer
        # state refused before any choice (never offered either), the poisoned and the honest states were offered
        # in priority order, and the honest one taken
        assert [[(ids[d], v) for d, v in offer] for offer in offered] == [[("poisoned", 1.5), ("honest", 1.0)]]
        assert torch.equal(joiner.main_parameters[0].detach(), torch.ones(SIZE))
        # one download per RETRY_S, taken or not: hivemind's next request within it downloads nothing
        assert joiner.load_state_from_peers() is None and len(offered) == 1

        # a minute later, with only hostile donors left (the honest one's declaration outlives it) nothing is
        # taken, the joiner keeps its state, and again the next request within RETRY_S downloads nothing
        honest.shutdown()
        averagers.remove(honest)
        joiner.retry_at = time.monotonic()
        assert joiner.load_state_from_peers() is None
        assert [[ids[d] for d, _ in offer] for offer in offered[1:]] == [["poisoned"]]
        assert torch.equal(joiner.main_parameters[0].detach(), torch.ones(SIZE))  # what it took before, kept
        assert joiner.load_state_from_peers() is None and len(offered) == 2
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()


def test_a_donor_that_pauses_is_dropped(monkeypatch):
    monkeypatch.setattr(p2pio.state_stream, "IDLE_S", 0.3)
    metadata = MSGPackSerializer.dumps({"epoch": 3})

    async def stalls():
        yield averaging_pb2.DownloadData(metadata=metadata, tensor_part=runtime_pb2.Tensor(
            dtype="float32", size=[4], buffer=b"\0" * 8))
        await asyncio.sleep(60)

    async def opened():
        return stalls()

    started = time.monotonic()
    with pytest.raises(LiveStateError, match="paused"):
        asyncio.run(read_state(opened, StateStream([(4,)]), timeout=30.0))
    assert time.monotonic() - started < 5


def test_a_state_stream_reads_the_dtypes_it_expects():
    metadata = MSGPackSerializer.dumps({"epoch": 3, "optimizer_metadata": [1, 2]})
    reader = StateStream([(2,), ()], ["float32", "int64"])
    reader.feed(averaging_pb2.DownloadData(metadata=metadata, tensor_part=runtime_pb2.Tensor(
        dtype="float32", size=[2], buffer=torch.tensor([1.0, 2.0]).numpy().tobytes())))
    reader.feed(averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(
        dtype="int64", size=[], buffer=torch.tensor(7).numpy().tobytes())))
    epoch, tensors = reader.end()
    assert epoch == 3 and reader.metadata["optimizer_metadata"] == [1, 2]
    assert tensors[0].tolist() == [1.0, 2.0] and tensors[1].item() == 7 and tensors[1].dtype == torch.int64
    wrong = StateStream([(2,)], ["int64"])
    with pytest.raises(LiveStateError, match="expected int64"):
        wrong.feed(averaging_pb2.DownloadData(metadata=metadata, tensor_part=runtime_pb2.Tensor(
            dtype="float32", size=[2], buffer=b"\0" * 8)))


# --- the records' rule -----------------------------------------------------------------------------------

MANIFEST = tiny_manifest(stages=2)
ENTRY = "7:00112233445566ff"


def _peer(name: str, **changes) -> PeerEntry:
    return PeerEntry(stage_record(1, name, MANIFEST, **changes), expiration=0.0, owner=b"")


def _pick(entries: list[PeerEntry], offers: list[tuple[str, str]], own: str = "me") -> int | None:
    t_fixed = entries[0].record.t_fixed_sha256 if entries else ""
    return records_pick(lambda: entries, 1, own, t_fixed, offers, wait=0.0)


def test_the_records_vouch_with_two_witnesses_or_the_only_other_peer():
    assert [witnesses_needed(n) for n in (0, 1, 2, 5)] == [1, 1, 2, 2]
    donor = _peer("donor", served_states=[ENTRY])
    other = _peer("other", state_hashes=[ENTRY])
    liar = _peer("liar", state_hashes=["7:ffffffffffffffff"])
    offer = [(ENTRY, donor.record.peer_id)]
    assert _pick([donor], offer) == 0  # alone in the stage: its own word
    assert _pick([donor, other, liar], offer) == 0
    assert _pick([donor, liar], offer) is None  # one of two others: not enough
    # the liar's own state, offered first, is announced by the liar only
    assert _pick([donor, other, liar], [("7:ffffffffffffffff", liar.record.peer_id), *offer]) == 1
    laundered = _peer("joined", state_hashes=[ENTRY], loaded_state=ENTRY)  # it holds the state only by loading it
    assert _pick([donor, laundered], offer) is None
    moved_on = _peer("caught-up", state_hashes=[ENTRY], loaded_state="6:00112233445566ff")  # loaded at another epoch
    assert _pick([donor, moved_on], offer) is None
    # our own record is no witness
    me = _peer("me", state_hashes=[ENTRY])
    assert _pick([donor, liar, me], offer, own=me.record.peer_id) is None
    assert _pick([], offer) is None


def test_where_no_record_vouches_the_state_the_others_agree_with_is_taken():
    generator = torch.Generator().manual_seed(0)
    seed = [torch.zeros(1000)]
    trained = torch.randn(1000, generator=generator)  # where training moved the stage
    honest = [[trained + 0.4 * torch.randn(1000, generator=generator)] for _ in range(2)]  # trained apart
    hostile = [trained + 5.0]
    assert agreeing_state(seed, [hostile, *honest]) in (1, 2)  # the medoid of three is honest
    assert agreeing_state(seed, [*honest, hostile]) in (0, 1)
    assert agreeing_state(seed, [hostile, honest[0]]) is None  # two that disagree: neither
    assert agreeing_state(seed, honest) == 0  # two honest ones agree more closely than they moved
    assert agreeing_state(seed, [honest[0]]) is None  # one state: nothing to agree with
    near = [honest[0][0] + 0.1]  # a hostile state that close to an honest one is taken: the documented bound
    assert agreeing_state(seed, [near, honest[0]]) == 0
    assert agreeing_state(seed, [[torch.full((1000,), float("nan"))], *honest]) is None
    assert agreeing_state(seed, [[torch.zeros(10)], [torch.zeros(10)]]) is None  # not this stage's shape


def test_honest_states_of_unequal_epochs_agree_where_three_are_offered_and_a_far_one_never_does():
    generator = torch.Generator().manual_seed(1)
    seed = [torch.zeros(1000)]
    trained = torch.randn(1000, generator=generator)
    early = [0.4 * trained + 0.2 * torch.randn(1000, generator=generator)]  # fewer epochs: moved less than apart
    late = [trained + 0.2 * torch.randn(1000, generator=generator)]
    moved = float(early[0].norm())
    assert float((late[0] - early[0]).norm()) > moved  # the lesser move would refuse the honest pair
    far = [trained + 5.0]
    assert agreeing_state(seed, [far, early, late]) in (1, 2)  # of three, one of the honest two
    assert agreeing_state(seed, [far, late]) is None  # of two, a far one inflates its own move in vain
    assert agreeing_state(seed, [far, early]) is None
    assert agreeing_state(seed, [[trained * 50.0], early, late]) in (1, 2)  # however far it moved
    assert agreeing_state(seed, [far, [torch.zeros(1000)], late]) == 2  # beside a peer still at the seed
    opposed = [-late[0]]  # moves at more than a right angle are no agreement
    assert agreeing_state(seed, [far, opposed, late]) is None


def test_a_load_reads_our_optimizer_metadata_as_hivemind_dumps_it_without_copying_tensors():
    stage = PipelineStage(MANIFEST, 1)
    optimizer = make_optimizer(stage, parameter_groups(stage))
    for param in stage.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    assert _metadata_of(optimizer.state_dict()) == dump_optimizer_state(optimizer)[0]
