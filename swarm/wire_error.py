"""A refused message: the codes a peer answers with and the exception that carries one.

Apart from `swarm/wire.py` so that what decodes a payload's values (`swarm/wire_dtype.py`, which
the manifest sizes payloads with) refuses bytes the same way without importing the wire format.
"""

from __future__ import annotations

import enum


class ErrorCode(str, enum.Enum):
    MALFORMED = "malformed"
    TOO_LARGE = "too_large"
    WRONG_RUN = "wrong_run"
    WRONG_VERSION = "wrong_u_version"
    WRONG_HASH = "wrong_t_fixed_hash"
    WRONG_STAGE = "wrong_stage"
    WRONG_KIND = "wrong_kind"
    WRONG_SHAPE = "wrong_shape"
    WRONG_DTYPE = "wrong_dtype"
    BAD_TOKENS = "bad_tokens"
    NOT_FINITE = "not_finite"
    OUT_OF_RANGE = "out_of_range"
    OVERLOADED = "overloaded"
    LEAVING = "leaving"
    NO_PEER = "no_peer"
    UNREACHABLE = "unreachable"
    TIMEOUT = "timeout"
    INTERNAL = "internal"
    UNKNOWN_SENDER = "unknown_sender"
    WRONG_CP_VERSION = "wrong_cp_version"  # context parallelism's K/V basis (issue 17), apart from U's version
    WRONG_CP_HASH = "wrong_cp_hash"


class WireError(Exception):
    """A refusal. `hops` says how far down the pipeline it was raised (0: here, 1: by the peer we
    sent to, 2: by the peer after that...), so a hop that relays a refusal is not blamed for it."""

    def __init__(self, code: ErrorCode, message: str, hops: int = 0):
        super().__init__(f"{code.value}: {message}")
        self.code, self.message, self.hops = code, message, hops
