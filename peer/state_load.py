"""A peer takes a stage's state from another only when the stage's records vouch for it (issue 26).

hivemind's Optimizer loads a stage's state when a peer joins, and again whenever it falls an epoch behind: it
asks the peers that declared themselves state donors, the highest declared priority (an epoch: a claim) first,
and copies in whatever the first to answer streams, after allocating whatever dtype and size it names. One
hostile peer declaring a large epoch would hand every joiner, and every peer that fell behind, weights of its
choosing (finite ones pass the stage's finiteness check), or make it allocate without bound. Here, instead:

- the stream is read by `p2pio/state_stream.py` against our own state's layout (every tensor's dtype and shape,
  the same model and optimizer) within a time budget per donor, at most `MAX_DONORS` donors per load;
- a donor's parameters are hashed as records hash them and taken only when the stage's signed records vouch for
  that "epoch:hash" (`records_vouch`: two online peers of the stage, or the one there is; the donor by the state
  it says it served, others by the states they held; a peer that itself loaded the state is no witness:
  `swarm/live_state.py confirmations`), the records read again for up to `CONFIRM_WAIT` while they catch up;
- a state the records do not vouch for is refused with one line, and the next donor is asked.

Not checked: the optimizer statistics that come with vouched parameters (no record hashes them: a hostile donor
serving the honest parameters can still skew the moments a joiner starts from), and peers that are one
operator's many identities (two of them vouch for each other).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.timed_storage import ValueWithExpiration

from dhtio.records import fetch_stages
from p2pio.state_stream import StateStream, read_state
from swarm.live_state import LiveStateError, confirmations, copies_entry, online_peers, witnesses_needed
from swarm.manifest import Manifest
from swarm.model import PipelineStage
from swarm.records import ANNOUNCE_INTERVAL, PeerEntry

logger = logging.getLogger("peer.state_load")

MAX_DONORS = 4  # donors one load asks at most (each costs its stream's budget, and CONFIRM_WAIT if refused)
CONFIRM_WAIT = 2 * ANNOUNCE_INTERVAL  # how long a downloaded state may wait for the records that announce it
CONFIRM_POLL = 2.0

Layout = list[tuple[str, tuple[int, ...]]]  # (dtype as hivemind names it, shape) of each tensor of a state
Vouch = Callable[[int, list[torch.Tensor], str], bool]  # (epoch, parameters, donor) -> take it?


def layout_of(tensors: Sequence[torch.Tensor]) -> Layout:
    return [(str(t.dtype).replace("torch.", ""), tuple(t.shape)) for t in tensors]


class VerifiedStateLoad(DecentralizedAverager):
    """Replaces DecentralizedAverager's state download in a TrainingStateAverager: that class calls it and
    applies what it returns, so this one comes after it in the averager's bases (`peer/stage_optimizer.py`).
    The owner sets `vouch` (None: every well-formed state is taken)."""

    vouch: Vouch | None = None

    def local_state_layout(self) -> Layout:
        """Our own state's tensors, as a donor streams its own: same model, same optimizer, so the same layout
        (TrainingStateAverager's listing, not a subclass's, which may note what it serves)."""
        _, tensors, _ = TrainingStateAverager.get_current_state(self)
        return layout_of(tensors)

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None):
        """(metadata, tensors) of the first donor's state the records vouch for, or None. Blocking (`wait` must
        be True: the checks need the state); `timeout` is hivemind's per-message one, replaced by the budget."""
        if not wait:
            raise ValueError("a state download is checked before it is returned: wait=False is not supported")
        layout, refused = self.local_state_layout(), []
        while len(refused) < MAX_DONORS:
            future = MPFuture()
            self._outer_pipe.send(("_download_state", [], dict(future=future, layout=layout, skip=list(refused))))
            got = future.result()
            if got is None:
                return None
            metadata, tensors, donor = got
            parameters = tensors[: len(self.main_parameters)]
            if self.vouch is None or self.vouch(metadata["epoch"], parameters, donor):
                return metadata, tensors
            refused.append(donor)
        return None

    async def _download_state(self, future: MPFuture, layout: Layout, skip: list[str]) -> None:
        """In the averager's process: the state of the first donor (by declared priority, not in `skip`) whose
        stream reads well, as (metadata, tensors, donor id), or None."""
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
            donors = [p for p in sorted(priority, key=priority.get, reverse=True) if p not in skip and p != own]
            for donor in donors[: MAX_DONORS - len(skip)]:
                reader = StateStream([shape for _, shape in layout], [dtype for dtype, _ in layout])
                stub = self.get_stub(self._p2p, PeerID.from_base58(donor), namespace=self.prefix)
                try:
                    await read_state(lambda s=stub: s.rpc_download_state(averaging_pb2.DownloadRequest()), reader,
                                     reader.budget)
                except LiveStateError as exc:
                    logger.warning("state from peer %s refused: %s", donor[-8:], exc)
                    continue
                future.set_result((reader.metadata, reader.tensors, donor))
                return
        finally:
            if not future.done():
                future.set_result(None)


def records_vouch(
    fetch: Callable[[], list[PeerEntry]],
    index: int,
    own_id: str,
    t_fixed_sha256: str,
    entry: str,
    donor: str,
    label: str,
    wait: float = CONFIRM_WAIT,
    poll: float = CONFIRM_POLL,
) -> bool:
    """Whether the stage's records vouch for the state `entry` that `donor` sent: enough of the stage's other
    online peers (at the run's T_fixed) announce it (`witnesses_needed`), read again until they do or `wait`
    passed. Blocking; logs one line either way."""
    until = time.monotonic() + wait
    while True:
        try:
            entries = fetch()
        except Exception as exc:  # noqa: BLE001 - the DHT may be briefly unreachable: read again
            logger.debug("%s records unreadable: %s", label, exc)
            entries = []
        online = [e for e in online_peers(entries, index, t_fixed_sha256) if e.record.peer_id != own_id]
        found, needed = confirmations(online, index, entry, donor), witnesses_needed(len(online))
        if len(found) >= needed:
            logger.info("%s state %s from peer %s: announced by %d of the stage's peers", label, entry, donor[-8:],
                        len(found))
            return True
        if time.monotonic() + poll > until:
            logger.warning("%s refused the state %s peer %s sent: announced by %d of the stage's %d other peers, "
                           "%d needed", label, entry, donor[-8:], len(found), len(online), needed)
            return False
        time.sleep(poll)


def stage_vouch(stage: PipelineStage, main: Sequence[torch.Tensor], dht, manifest: Manifest, index: int,
                label: str) -> Vouch:
    """The `vouch` of a stage's averager: hash the parameters received as the donor hashed what it served
    (`copies_entry`), then ask the stage's records (`records_vouch`)."""
    own_id, t_fixed_sha256 = dht.peer_id.to_base58(), stage.subspace.t_fixed_sha256

    def vouch(epoch: int, parameters: list[torch.Tensor], donor: str) -> bool:
        entry = copies_entry(stage, main, epoch, parameters)
        return records_vouch(lambda: fetch_stages(dht, manifest, [index])[index], index, own_id, t_fixed_sha256,
                             entry, donor, label)

    return vouch
