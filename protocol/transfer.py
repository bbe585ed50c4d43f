"""Transfer-control messages between two kvd daemons (over the authenticated peer link).

Sans-IO data only. The bytes themselves go over NIXL; these messages match a request across
the daemons, hand out receive credits and report the outcome:

    ctx daemon                                 gen daemon
    XferOffer(layout, blocks, deadline)  ──▶   (waits until its executors' Expect is complete)
                                         ◀──   XferAccept(layout, blocks, pool regions, slots)
    -- both plan the same regroup; path = direct (equal layouts) or bounce --
    XferPath(bounce, chunk_bytes, credits="notif") ──▶
                                         ◀──   Credit(slots)          (NIXL notification: receive slots
                                                                        beyond those granted up front;
                                                                        XferGrant(slot) on the link when
                                                                        the sender did not ask for them)
    NIXL WRITE staging slot → remote slot, notification (request, seq, slot)
                                               scatter slot → blocks, slot freed, next credit
    XferPath(mapped | fragment): no receive slots needed (same-node mapped pools, or
    no credit in time: per-fragment NIXL writes straight into the blocks)
    XferDone(writes, bytes)              ──▶
                                         ◀──   XferComplete(bytes)
    XferFail(code, message) either way, at any point.

When the gen executors name their ctx peer (``expect(..., peer=...)``) the gen daemon sends
its destination unasked as soon as every gen rank registered, with receive slots granted up
front; a ``publish`` that finds it moves bytes with zero peer round trips::

                                         ◀──   XferAnnounce(layout, blocks, pools, slots, deadline)
    XferPath(path, ctx layout, ctx blocks) ──▶   (gen plans the same regroup for its scatters)
    NIXL writes / mapped copies
    XferDone(writes, bytes)              ──▶   gen done once it saw ``writes`` notifications

On the mapped path between GPUs of one node the path message may name a *landed event*
(:class:`LandedEvent`): a CUDA interprocess event the ctx daemon recorded right after the
request's one kernel launch, on the stream it launched on. The gen daemon opens it and, when it
completes, knows every byte is in its blocks without waiting for ``XferDone`` (which still
follows, and is then a harmless confirmation); ``XferFail`` before that still fails gen::

    XferPath(mapped, landed=(device, slot, handle, nbytes)) ──▶   gen polls the event
    XferDone(0, bytes)                   ──▶   (gen may be done already)

A side that fails sends one ``XferFail``; ctx sends it only once none of its writes can land
(``writes_stopped``), and gen reports failure (and frees its blocks) only after that. ctx sends
it also when it failed before the gen daemon said anything (``deadline_s`` > 0): gen ranks
waiting for an offer fail at once, and those that expect the request later are refused. The
per-request rules live in :mod:`protocol.transfer_fsm`.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from protocol.layout import KVLayout
from protocol.limits import (
    MAX_SLOTS,
    MAX_WORLD_SIZE,
    BlockIds,
    ByteCount,
    Count,
    Name,
    Rank,
    RequestId,
    Text,
    TimeoutS,
)

#: Rank -> that rank's block ids (at most MAX_WORLD_SIZE ranks).
RankBlocks = Annotated[dict[Rank, BlockIds], msgspec.Meta(max_length=MAX_WORLD_SIZE)]
Slot = Annotated[int, msgspec.Meta(ge=0, lt=MAX_SLOTS)]
#: A slot of gen's completion page (kvd.mapping.words; -1: none) and the token it will hold.
Word = Annotated[int, msgspec.Meta(ge=-1, lt=1 << 24)]
Token = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
#: Receive slots granted with a destination (a few).
Slots = Annotated[list[Slot], msgspec.Meta(max_length=64)]


class RemoteRegion(msgspec.Struct, frozen=True, kw_only=True):
    """A NIXL-registered memory region of the peer daemon."""

    addr: ByteCount
    nbytes: ByteCount
    device: Annotated[int, msgspec.Meta(ge=-1, lt=1 << 16)]  # -1 = host memory (DRAM), else CUDA ordinal (VRAM)


class XferMessage(msgspec.Struct, frozen=True, tag_field="type", kw_only=True):
    """Base of the transfer-control messages; ``request_id`` names the request."""

    request_id: RequestId


class XferOffer(XferMessage, frozen=True, tag="xfer_offer"):
    layout: KVLayout
    blocks: RankBlocks
    deadline_s: TimeoutS  # seconds left on the ctx side when sent (finite, >= 0)
    # the sender's number for this request (its Transfer.ref, unique in its daemon while it
    # runs, ids reused or not): the other side names it in this request's NIXL notifications
    # to the sender, which drops one naming another (a late one of an earlier request of the
    # same id). 0: an older daemon (then notifications are matched by request id alone)
    ref: Token = 0


class XferAccept(XferMessage, frozen=True, tag="xfer_accept"):
    layout: KVLayout
    blocks: RankBlocks
    # gen rank -> its pool region (for direct/fallback writes)
    pools: Annotated[dict[Rank, RemoteRegion], msgspec.Meta(max_length=MAX_WORLD_SIZE)]
    # gen rank -> pool name (for the same-node mapped path)
    pool_names: Annotated[dict[Rank, Name], msgspec.Meta(max_length=MAX_WORLD_SIZE)] = {}
    slots: Slots = []  # receive slots granted up front (bounce path)
    chunking: Name = ""  # CHUNKING_RANGES: gen scatters the chunks XferPath.chunk_bytes cuts ("" = older daemon)
    # gen's completion slot and token: on the mapped path ctx's GPU stores the token there
    # after its kernel, and gen's spinning executors are done (-1: no slot)
    word: Word = -1
    token: Token = 0
    ref: Token = 0  # as XferOffer.ref


class XferAnnounce(XferMessage, frozen=True, tag="xfer_announce"):
    """gen's destination, sent unasked once every gen rank registered with ``peer=``."""

    layout: KVLayout
    blocks: RankBlocks
    pools: Annotated[dict[Rank, RemoteRegion], msgspec.Meta(max_length=MAX_WORLD_SIZE)]
    pool_names: Annotated[dict[Rank, Name], msgspec.Meta(max_length=MAX_WORLD_SIZE)] = {}
    slots: Slots = []  # receive slots granted up front (bounce path)
    deadline_s: TimeoutS = 0.0  # seconds left on the gen side when sent (0 = ctx's own deadline)
    chunking: Name = ""  # as XferAccept.chunking
    word: Word = -1  # as XferAccept.word
    token: Token = 0
    ref: Token = 0  # as XferOffer.ref


class XferGrant(XferMessage, frozen=True, tag="xfer_grant"):
    """One receive slot for the bounce path, over the link (when the sender did not ask for
    :class:`Credit` notifications)."""

    slot: Slot


#: Bytes of a CUDA interprocess event handle (``CUipcEventHandle``).
IPC_EVENT_HANDLE_BYTES = 64
#: Landed-event slots a ctx daemon cycles through per device and stream.
MAX_LANDED_SLOTS = 1024


class LandedEvent(msgspec.Struct, frozen=True, kw_only=True):
    """A CUDA interprocess event the ctx daemon recorded after the request's last write was
    enqueued (see the module docstring). ``slot`` numbers the ctx daemon's events (it reuses
    them in turn on one stream, so a reused slot completes only after the request that named
    it before: a late reader waits longer, never less); ``nbytes`` and ``chunks`` are what the
    request moves, as ``XferDone`` would say."""

    device: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]  # ctx's CUDA ordinal
    slot: Annotated[int, msgspec.Meta(ge=0, lt=MAX_LANDED_SLOTS)]
    handle: Annotated[bytes, msgspec.Meta(min_length=IPC_EVENT_HANDLE_BYTES, max_length=IPC_EVENT_HANDLE_BYTES)]
    nbytes: ByteCount
    chunks: Count


class XferPath(XferMessage, frozen=True, tag="xfer_path"):
    """The path the sender takes ("mapped", "direct", "bounce", or "fragment" when no receive
    slot came in time after "bounce"), sent before its first write; with the ctx side's layout
    and blocks when gen announced its destination (it got no offer to plan with)."""

    path: Name
    reason: Text = ""
    # the ctx side's layout and blocks, when gen announced its destination and got no offer
    layout: KVLayout | None = None
    blocks: RankBlocks = {}
    # bounce: every (ctx rank, gen rank) pair's byte stream is cut every chunk_bytes (the
    # receiver's chunk list; 0 from older daemons), and credits = CREDITS_NOTIF asks for the
    # receive slots as Credit notifications rather than XferGrant messages
    chunk_bytes: ByteCount = 0
    credits: Name = ""
    # mapped: the event that completes when every byte is in gen's blocks (None: wait for XferDone)
    landed: LandedEvent | None = None
    ref: Token = 0  # as XferOffer.ref


class XferDone(XferMessage, frozen=True, tag="xfer_done"):
    writes: Count  # NIXL writes (notifications) the receiver must have seen
    bytes: ByteCount
    chunks: Count


class XferComplete(XferMessage, frozen=True, tag="xfer_complete"):
    bytes: ByteCount


class XferFail(XferMessage, frozen=True, tag="xfer_fail"):
    code: Name
    message: Text
    writes_stopped: bool = True  # none of the sender's writes into the receiver can land any more
    sender: Name = ""  # "ctx" | "gen": the side that failed ("" from older daemons)
    # > 0: the sender (ctx) never heard from the receiver about this request, which may not know
    # it at all; seconds left of its deadline: the receiver keeps the failure that long for its
    # ranks that register later. 0: the receiver knows the request (or an older daemon sent it)
    deadline_s: TimeoutS = 0.0
    # the sender's number for the request (as XferOffer.ref): a daemon that no longer knows
    # the request answers the notice naming it back as peer_ref
    ref: Token = 0
    # the receiver's number for the request as the sender knows it (from its offer, accept,
    # announce or path message, or the notice this answers): the receiver drops a notice
    # naming another of its requests (an earlier one of this id). 0: the sender never heard
    # of it (or an older daemon)
    peer_ref: Token = 0


#: ``chunking`` of a receiver that cuts every (ctx rank, gen rank) pair's byte stream (its
#: runs in the planner's fragment order) every ``XferPath.chunk_bytes``, chunk ``seq`` being
#: the ``seq``-th over the pairs in sorted order.
CHUNKING_RANGES = "ranges"
#: ``XferPath.credits`` of a sender that takes receive slots as :class:`Credit` notifications.
CREDITS_NOTIF = "notif"

XFER_MESSAGES = (XferOffer, XferAccept, XferAnnounce, XferGrant, XferPath, XferDone, XferComplete, XferFail)


class Notif(msgspec.Struct, frozen=True, array_like=True):
    """NIXL notification payload of one write: which request, which write, which slot."""

    request_id: RequestId
    seq: Count
    slot: Annotated[int, msgspec.Meta(ge=-1, lt=MAX_SLOTS)]  # receive slot for bounce writes, -1 straight into the blocks
    # the receiver's number for the request (its XferAccept/XferAnnounce.ref; 0: not known).
    # Last, with a default: an older daemon's decoder ignores it, and its notifications lack it
    ref: Token = 0


#: Receive slots one :class:`Credit` carries at most.
MAX_CREDITS = 1024


class Credit(msgspec.Struct, frozen=True, array_like=True, tag="credit"):
    """NIXL notification from the receiver to the sender: receive slots it may write into
    (the bounce path's credits). Encoded ``["credit", request_id, [slot, ...]]``: never
    mistaken for a :class:`Notif` (whose second field is an integer)."""

    request_id: RequestId
    slots: Annotated[list[Slot], msgspec.Meta(min_length=1, max_length=MAX_CREDITS)]
    ref: Token = 0  # the receiver's (ctx's) number for the request (XferOffer/XferPath.ref; 0: not known)


_notif_encoder = msgspec.msgpack.Encoder()
_notif_decoder = msgspec.msgpack.Decoder(Notif)
_credit_decoder = msgspec.msgpack.Decoder(Credit)


def encode_notif(n: Notif | Credit) -> bytes:
    return _notif_encoder.encode(n)


def decode_notif(data: bytes) -> Notif | Credit | None:
    """Decode a notification (a write's, or a credit); ``None`` when it is not one of ours."""
    for decoder in (_notif_decoder, _credit_decoder):
        try:
            return decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            continue
    return None
