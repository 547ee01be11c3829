"""A peer takes a stage's state from others only when the stage vouches for it (issue 26).

hivemind's Optimizer loads a stage's state when a peer joins, and again whenever it falls an epoch behind: it
asks the peers that declared themselves state donors, the highest declared priority (an epoch: a claim) first,
and copies in whatever the first to answer streams, after allocating whatever dtype and size it names. One
hostile peer declaring a large epoch would hand every joiner, and every peer that fell behind, weights of its
choosing (finite ones pass the stage's finiteness check), or make it allocate without bound. Here, instead:

- streams are read by `p2pio/state_stream.py` against our own state's layout (every tensor's dtype and shape:
  same model, same optimizer) within a time budget per donor: up to `MAX_STATES` states from the first
  `MAX_ASKED` donors by declared priority (a load costs up to three downloads, where hivemind's cost one);
- each state's parameters are hashed as a donor hashes what it serves, and the first state the stage's signed
  records vouch for is taken (`records_pick`: two of the stage's other online peers announce that
  "epoch:hash", or the one there is; the donor by the state it served, others by states they held; a peer
  that itself loaded the state is no witness: `swarm/live_state.py confirmations`), the records read again
  for up to `CONFIRM_WAIT` while they catch up;
- where the records vouch for none (peers of a stage hold one state only while averaging keeps them in step),
  the state the others agree with is taken (`swarm/live_state.py agreeing_state`): of three with one hostile,
  an honest one; of two that disagree, neither;
- a load that took nothing says why in one line; a peer downloads at most once per `RETRY_S`, taken or not
  (hivemind asks at every step while the peer is behind; in between, a peer holding a state moves its epoch:
  `StageOptimizer`), so neither a refused load nor a stage whose epochs outrun a download holds the stage
  thread trip after trip.

- the optimizer state that comes with the parameters is no record's (replicas' moments differ), so it is checked
  on its own before any choice (`swarm/optimizer_state.py`): our entries one for one, the run's hyperparameters,
  whole step counts, and moments Adam's recurrences can produce; a state that fails is dropped whatever its
  parameters, one that passes is loaded with our own values (the learning rate too).

Not checked: moments that are plausible but skewed (they bend a few tens of steps, at an honest step's size), and
peers that are one operator's many identities (two of them vouch for each other).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.nested import nested_flatten, nested_pack
from hivemind.utils.timed_storage import ValueWithExpiration

from dhtio.records import fetch_stages
from p2pio.state_stream import StateStream, read_state
from swarm.live_state import (
    LiveStateError,
    agreeing_state,
    confirmations,
    copies_entry,
    online_peers,
    trained_parameters,
    witnesses_needed,
)
from swarm.manifest import Manifest
from swarm.model import PipelineStage
from swarm.optimizer_state import canonical_leaves, optimizer_state_refusal
from swarm.records import ANNOUNCE_INTERVAL, PeerEntry

logger = logging.getLogger("peer.state_load")

MAX_STATES = 3  # states one load downloads at most (three: a medoid outvotes one hostile donor)
MAX_ASKED = 6  # donors one load asks at most (each costs its stream's budget at worst)
CONFIRM_WAIT = 2 * ANNOUNCE_INTERVAL  # how long downloaded states may wait for the records that announce them
CONFIRM_POLL = 2.0
RETRY_S = 60.0  # seconds from one download to the next, whether it took a state or not

Layout = list[tuple[str, tuple[int, ...]]]  # (dtype as hivemind names it, shape) of each tensor of a state
Candidate = tuple[int, list[torch.Tensor], str]  # (epoch, parameters, donor) of a downloaded state
Choose = Callable[[list[Candidate]], "int | None"]  # which downloaded state to take, if any


def layout_of(tensors: Sequence[torch.Tensor]) -> Layout:
    return [(str(t.dtype).replace("torch.", ""), tuple(t.shape)) for t in tensors]


class VerifiedStateLoad(DecentralizedAverager):
    """Replaces DecentralizedAverager's state download in a TrainingStateAverager: that class calls it and
    applies what it returns, so this one comes after it in the averager's bases (`peer/stage_optimizer.py`).
    The owner sets `choose` (None: the first well-formed state is taken)."""

    choose: Choose | None = None
    retry_at = -float("inf")  # (this process's clock) no download before this
    taken = False  # whether the last load returned a state (it may equal ours: two peers still at the seed)

    def __init__(self, *args, **kwargs):
        # hivemind starts each download task without keeping it, and the DHT future it awaits is held only
        # weakly: a task nobody references is collected while it waits (measured: "Task was destroyed but it
        # is pending", the owner waiting for ever). The averager holds its downloads here until they end; set
        # before hivemind starts the averager's process, where they run
        self._downloads: set[asyncio.Task] = set()
        super().__init__(*args, **kwargs)

    def local_state_layout(self) -> Layout:
        """Our own state's tensors, as a donor streams its own: same model, same optimizer, so the same layout
        (TrainingStateAverager's listing, not a subclass's, which may note what it serves)."""
        _, tensors, _ = TrainingStateAverager.get_current_state(self)
        return layout_of(tensors)

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None):
        """(metadata, tensors) of the downloaded state `choose` picks, or None. Blocking (`wait` must be True:
        the checks need the states); `timeout` is hivemind's per-message one, replaced by each donor's budget."""
        if not wait:
            raise ValueError("a state download is checked before it is returned: wait=False is not supported")
        self.taken = False
        if time.monotonic() < self.retry_at:
            return None
        self.retry_at = time.monotonic() + RETRY_S
        layout, future = self.local_state_layout(), MPFuture()
        self._outer_pipe.send(("_download_states", [], dict(future=future, layout=layout)))
        budget = StateStream([shape for _, shape in layout], [dtype for dtype, _ in layout]).budget
        try:  # every donor's stream is bounded by its budget: this only guards against a download that never ends
            states = future.result(timeout=MAX_ASKED * budget + CONFIRM_WAIT)
        except TimeoutError:
            logger.warning("the state download did not end within its donors' budgets")
            states = []
        ours = self.optimizer.state_dict()  # once per load: every state is checked against the same
        # hivemind refuses (quietly) a state of an epoch behind ours: such a state is never taken here either
        own_metadata = _metadata_of(ours)
        states = [state for state in states if isinstance(state[0].get("epoch"), int)
                  and state[0]["epoch"] >= self.local_epoch and self._optimizer_state_fits(*state, ours, own_metadata)]
        if states and self.choose is None:
            pick = 0
        else:
            count = len(self.main_parameters)
            pick = self.choose([(m["epoch"], t[:count], donor) for m, t, donor in states]) if states else None
        self.taken = pick is not None
        return None if pick is None else states[pick][:2]

    def _optimizer_state_fits(self, metadata: dict, tensors: list[torch.Tensor], donor: str, ours: dict,
                              own_metadata: list[dict]) -> bool:
        """Whether the optimizer part of a downloaded state may be `ours` (our optimizer's state dict, whose
        `dump_optimizer_state` metadata is `own_metadata`: `swarm/optimizer_state.py`). If it may, its metadata is
        replaced by ours, so hivemind loads the donor's tensors with our own values (the learning rate included)
        in our own order."""
        offset = len(self.main_parameters) + len(self.extra_tensors)
        try:
            leaves = canonical_leaves(own_metadata, metadata.get("optimizer_metadata"), tensors[offset:])
            why = optimizer_state_refusal(ours, nested_pack(leaves, structure=ours))
        except Exception as exc:  # noqa: BLE001 - whatever a donor's metadata makes fail is a refusal, never a retry
            why = f"malformed ({str(exc)[:120]})"
        if why is not None:
            logger.warning("state from peer %s refused: its optimizer state: %s", donor[-8:], why)
            return False
        metadata["optimizer_metadata"] = own_metadata
        return True

    async def _download_states(self, future: MPFuture, layout: Layout) -> None:
        """In the averager's process: up to MAX_STATES states, as (metadata, tensors, donor id), from the first
        MAX_ASKED donors by declared priority whose streams read well."""
        states = []
        self._downloads.add(asyncio.current_task())  # held until it ends (`__init__`)
        try:
            key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
            declared, _ = await self.dht.get(key, latest=True, return_future=True) or ({}, None)
            priority = {  # subkeys are peer ids' bytes, values the declared priorities (any peer may write them)
                PeerID(peer).to_base58(): float(info.value)
                for peer, info in (declared.items() if isinstance(declared, dict) else ())
                if isinstance(peer, bytes) and isinstance(info, ValueWithExpiration)
                and isinstance(info.value, (float, int)) and not isinstance(info.value, bool)
            }
            own = self.peer_id.to_base58()
            donors = [p for p in sorted(priority, key=priority.get, reverse=True) if p != own]
            for donor in donors[:MAX_ASKED]:
                reader = StateStream([shape for _, shape in layout], [dtype for dtype, _ in layout])
                stub = self.get_stub(self._p2p, PeerID.from_base58(donor), namespace=self.prefix)
                try:
                    await read_state(lambda s=stub: s.rpc_download_state(averaging_pb2.DownloadRequest()), reader,
                                     reader.budget)
                except LiveStateError as exc:
                    logger.warning("state from peer %s refused: %s", donor[-8:], exc)
                    continue
                states.append((reader.metadata, reader.tensors, donor))
                if len(states) == MAX_STATES:
                    break
        finally:
            future.set_result(states)
            self._downloads.discard(asyncio.current_task())


def _metadata_of(state_dict: dict) -> list[dict]:
    """hivemind's `dump_optimizer_state` metadata of an optimizer's `state_dict`, without copying its tensors."""
    metadata, count = [], 0
    for leaf in nested_flatten(state_dict):
        if isinstance(leaf, torch.Tensor):
            metadata.append(dict(type="tensor", index=count))
            count += 1
        else:
            metadata.append(dict(type="value", value=leaf))
    return metadata


def records_pick(
    fetch: Callable[[], list[PeerEntry]],
    index: int,
    own_id: str,
    t_fixed_sha256: str,
    offers: list[tuple[str, str]],
    wait: float = CONFIRM_WAIT,
    poll: float = CONFIRM_POLL,
) -> int | None:
    """Which of the `offers` ("epoch:hash" entry, donor) the stage's records vouch for: the first that enough of
    the stage's other online peers at the run's T_fixed announce (`witnesses_needed`), the records read again
    until one is or `wait` passed. Blocking."""
    until = time.monotonic() + wait
    while True:
        try:
            entries = fetch()
        except Exception as exc:  # noqa: BLE001 - the DHT may be briefly unreachable: read again
            logger.debug("records unreadable: %s", exc)
            entries = []
        online = [e for e in online_peers(entries, index, t_fixed_sha256) if e.record.peer_id != own_id]
        needed = witnesses_needed(len(online))
        for at, (entry, donor) in enumerate(offers):
            if len(confirmations(online, index, entry, donor)) >= needed:
                return at
        if time.monotonic() + poll > until:
            return None
        time.sleep(poll)


def _stage_entries(dht, manifest: Manifest, index: int) -> list[PeerEntry]:
    return fetch_stages(dht, manifest, [index])[index]


def stage_choice(stage: PipelineStage, main: Sequence[torch.Tensor], dht, manifest: Manifest, index: int,
                 label: str) -> Choose:
    """The `choose` of a stage's averager. First the records (`records_pick`), each state hashed as its donor
    hashed what it served (`copies_entry`); where they vouch for none (peers of a stage hold one state only
    where averaging keeps them in step: in a local swarm whose epochs are shorter than an averaging round they
    never do), the state the others agree with (`swarm/live_state.py agreeing_state`, measured against the
    seed's parameters). One line says which, or why none."""
    own_id, t_fixed_sha256 = dht.peer_id.to_base58(), stage.subspace.t_fixed_sha256

    def choose(candidates: list[Candidate]) -> int | None:
        offers = [(copies_entry(stage, main, epoch, params), donor) for epoch, params, donor in candidates]
        pick = records_pick(partial(_stage_entries, dht, manifest, index), index, own_id, t_fixed_sha256, offers)
        named = ", ".join(f"{entry} from {donor[-8:]}" for entry, donor in offers)
        if pick is not None:
            logger.info("%s took state %s: its stage's records announce it", label, named.split(", ")[pick])
            return pick
        seed = [p.detach() for _, p in trained_parameters(PipelineStage(manifest, index))]
        pick = agreeing_state(seed, [params for _, params, _ in candidates])
        if pick is None:
            logger.warning("%s refused the states %s: no record announces them and none agrees with another "
                           "(retrying in %.0f s)", label, named, RETRY_S)
        else:
            logger.info("%s took state %s: no record announces it, it is nearest the others", label,
                        named.split(", ")[pick])
        return pick

    return choose
