"""Protocol-level bounds on everything that crosses the wire (executor socket and peer link).

Every string, count, array and float a message carries is bounded here, and the bounds are
part of the message types (``Annotated[..., msgspec.Meta(...)]``), so the decoder refuses an
out-of-range value with a :class:`~protocol.errors.ProtocolError` *before* the daemon sizes
anything from it. The bounds are generous for real deployments (the largest NVL72 layouts,
million-token requests) and small enough that no single message can make the daemon allocate,
log or loop without limit. Floats must be finite: ``ge``/``le`` bounds reject NaN and ±inf.

The bounds never change meaning once released; raising one is a compatible change, lowering
one is not. ``docs/security.md`` lists them with the daemon's configurable limits.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

__all__ = [
    "MAX_BLOCK_ID",
    "MAX_BLOCK_IDS",
    "MAX_BYTES",
    "MAX_COUNT",
    "MAX_DEADLINE_S",
    "MAX_HEAD_DIM",
    "MAX_HELLO_FRAME",
    "MAX_KV_HEADS",
    "MAX_LAYERS",
    "MAX_NAME_LEN",
    "MAX_NUM_BLOCKS",
    "MAX_POOLS",
    "MAX_REGIONS",
    "MAX_REQUEST_ID_LEN",
    "MAX_SLOTS",
    "MAX_TEXT_LEN",
    "MAX_TOKENS_PER_BLOCK",
    "MAX_WORLD_SIZE",
    "BlockId",
    "BlockIds",
    "ByteCount",
    "Count",
    "DeadlineS",
    "Name",
    "OptionalRanks",
    "Rank",
    "RequestId",
    "Text",
    "TimeoutS",
    "clip_text",
]

#: Names: client names, pool names, node (peer) names. Also the longest name kvd logs as is.
MAX_NAME_LEN = 256
#: Request ids (the executor's string id of one KV transfer).
MAX_REQUEST_ID_LEN = 256
#: Free text from the other side: error messages, close reasons, software versions, paths.
MAX_TEXT_LEN = 4096
#: Block ids in one message (per rank): a 32M-token request of 32-token blocks.
MAX_BLOCK_IDS = 1 << 20
#: Largest block id (and pool size in blocks).
MAX_BLOCK_ID = 2**31 - 1
MAX_NUM_BLOCKS = MAX_BLOCK_ID
#: Ranks of one layout (tp_size * pp_size), and bounds of the model geometry.
MAX_WORLD_SIZE = 4096
MAX_LAYERS = 4096
MAX_KV_HEADS = 4096
MAX_HEAD_DIM = 65536
MAX_TOKENS_PER_BLOCK = 65536
#: Pools and receive regions a peer may describe in its welcome.
MAX_POOLS = 256
MAX_REGIONS = 64
#: Receive slots of one bounce region (slot indices are below this).
MAX_SLOTS = 1 << 20
#: The first frame of an executor connection (its Hello, a few hundred bytes), checked as soon
#: as its length arrives: a connection not through its handshake holds no more of the daemon's
#: memory than this (as a peer before it authenticated, ``protocol.peer.PRE_AUTH_MAX_FRAME_SIZE``).
MAX_HELLO_FRAME = 64 * 1024
#: Deadlines and wait timeouts, seconds (one day).
MAX_DEADLINE_S = 86400.0
#: Counters (bytes, writes, chunks) and other non-negative integers: a signed 64-bit value.
MAX_COUNT = 2**63 - 1
MAX_BYTES = MAX_COUNT

Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_LEN)]
#: A request id is never empty: "" named no request (and read as "no peer" in places).
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REQUEST_ID_LEN)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT_LEN)]
BlockId = Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_ID)]
#: Block ids of one message. The values are checked by the pool (an unknown id is
#: ``block_not_leased``, with the id named); the decoder bounds how many there are.
BlockIds = Annotated[list[int], msgspec.Meta(max_length=MAX_BLOCK_IDS)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_WORLD_SIZE)]
#: Participating ranks of an ``Expect``/``Publish`` (checked against the layout by the daemon).
OptionalRanks = Annotated[list[int], msgspec.Meta(max_length=MAX_WORLD_SIZE)] | None
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
ByteCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_BYTES)]
#: A deadline: finite, positive, at most :data:`MAX_DEADLINE_S`.
DeadlineS = Annotated[float, msgspec.Meta(gt=0.0, le=MAX_DEADLINE_S)]
#: A wait timeout: finite, zero (poll) or positive, at most :data:`MAX_DEADLINE_S`.
TimeoutS = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_DEADLINE_S)]


def clip_text(text: str, limit: int = MAX_TEXT_LEN) -> str:
    """``text`` cut to at most ``limit`` characters (with a marker), for messages we send."""
    if len(text) <= limit:
        return text
    kept = max(0, limit - 40)  # the marker below is shorter than 40 characters
    return f"{text[:kept]}... ({len(text) - kept} more characters)"
