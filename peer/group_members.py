"""What each member of an averaging group says about itself, checked before hivemind acts on it.

hivemind 1.1.12 gathers one entry per member, `[bandwidth, mode, user data]`, which the group's leader passes to
every member unchecked, and every member then computes the same split of the tensors from the bandwidths
(`load_balance_peers`) and the same modes. One entry it cannot read (a bandwidth that is a string, a mode that is no
`AveragingMode`, bytes that are no such triple) raised in every member's `_aggregate_with_group`, so one member
that sends it, every round, stopped its stage's averaging: each round failed for everyone in its group.

`checked_members` keeps every entry an honest hivemind averager can send, and turns any other into an auxiliary
member: no share of the parts to reduce, no tensors expected from it, no lane, so the round runs without it. It is
not banned for it: the entry reaches this peer through the leader, which may have altered an honest member's, and a
hostile member gains nothing from it but being left out.

The split does not use the bandwidths members claim, only whether a member reduces at all (`split_bandwidths`):
honest peers of this swarm claim none (an equal share each), a claim is a member's word, and hivemind takes a single
claim for every member's bandwidth and solves a linear program on it that fails for a claim of 1e-6 or less, after
which it gives every member an equal share, clients and members left out included (and below about 1e-308 it
raises, failing the round for all again).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hivemind.averaging.allreduce import AveragingMode

Loads = Callable[[bytes], object]


@dataclass(frozen=True)
class Members:
    """A group's entries, checked, per member in the group's order: the bandwidth, mode and user data it gathered
    (a member left out: 0, auxiliary, None), and why each member left out was (by its index in the group)."""

    bandwidths: tuple[float | None, ...]
    modes: tuple[AveragingMode, ...]
    user_data: tuple[object, ...]
    left_out: dict[int, str]

    @property
    def split_bandwidths(self) -> list[float | None]:
        """What the tensors are split by: 0 (no share) for a client, a member that claims a bandwidth of 0 (hivemind:
        it leaves the reducing to the others) or one left out; None (an equal share) for every other member, whatever
        bandwidth it claims (module docstring)."""
        return [0.0 if index in self.left_out or mode == AveragingMode.CLIENT or bandwidth == 0 else None
                for index, (bandwidth, mode) in enumerate(zip(self.bandwidths, self.modes, strict=True))]

    def runner_modes(self, fractions: Sequence[float]) -> tuple[AveragingMode, ...] | None:
        """The modes for the all-reduce given the split: hivemind's own (None: the runner derives them, a member with
        no share a client, the rest nodes) where nobody was left out, else the same with each member left out
        auxiliary (not a sender)."""
        if not self.left_out:
            return None
        return tuple(AveragingMode.AUX if index in self.left_out
                     else AveragingMode.CLIENT if fraction == 0 else AveragingMode.NODE
                     for index, fraction in enumerate(fractions))

    def gathered(self, peer_ids: Sequence[object]) -> dict[object, object]:
        """The round's user data by member, members left out left out (the step's result: how many averaged)."""
        return {peer: data for index, (peer, data) in enumerate(zip(peer_ids, self.user_data, strict=True))
                if index not in self.left_out}


def _entry(blob: object, loads: Loads) -> tuple[float | None, AveragingMode, object]:
    """One member's entry as hivemind reads it; ValueError (why) if it is not one an honest averager sends."""
    if not isinstance(blob, bytes):
        raise ValueError(f"an entry of type {type(blob).__name__}")
    try:
        entry = loads(blob)
    except Exception as exc:  # noqa: BLE001 - anything a member sent
        raise ValueError(f"an entry that does not decode ({type(exc).__name__})") from None
    if not isinstance(entry, list | tuple) or len(entry) != 3:
        raise ValueError("an entry that is not [bandwidth, mode, user data]")
    bandwidth, mode, user = entry
    if bandwidth is not None and (isinstance(bandwidth, bool) or not isinstance(bandwidth, int | float)
                                  or not math.isfinite(bandwidth) or bandwidth < 0):
        raise ValueError(f"a bandwidth of {bandwidth!r:.40}")
    if isinstance(mode, bool) or not isinstance(mode, int) or mode not in {m.value for m in AveragingMode}:
        raise ValueError(f"a mode of {mode!r:.40}")
    if not isinstance(user, bytes):
        raise ValueError(f"user data of type {type(user).__name__}")
    try:
        user_data = loads(user)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"user data that does not decode ({type(exc).__name__})") from None
    return bandwidth, AveragingMode(mode), user_data


def checked_members(gathered: Sequence[object], loads: Loads) -> Members:
    """Each member's entry of `gathered` (in the group's order), read with `loads` (the averager's serializer),
    with those left out as the module docstring says."""
    bandwidths, modes, users, left_out = [], [], [], {}
    for index, blob in enumerate(gathered):
        try:
            bandwidth, mode, user = _entry(blob, loads)
        except ValueError as exc:
            bandwidth, mode, user, left_out[index] = 0.0, AveragingMode.AUX, None, str(exc)
        bandwidths.append(bandwidth)
        modes.append(mode)
        users.append(user)
    return Members(tuple(bandwidths), tuple(modes), tuple(users), left_out)
