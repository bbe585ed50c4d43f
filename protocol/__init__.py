"""kvd wire protocol: sans-IO messages, framing and errors (no trio, no sockets).

Messages are tagged frozen msgspec Structs, msgpack-encoded, length-prefixed. See
:mod:`protocol.messages` for the catalogue and :mod:`protocol.errors` for error codes.
"""

from protocol.codec import decode_reply, decode_request, encode, request_id_of
from protocol.errors import *  # noqa: F403 - the error hierarchy is part of the public API
from protocol.errors import ERRORS_BY_CODE, KvdError, error_from_code
from protocol.framing import DEFAULT_MAX_FRAME_SIZE, FrameBuffer, frame
from protocol.layout import DTYPE_SIZES, TRTLLM_AXIS_ORDER, VLLM_AXIS_ORDER, KVLayout
from protocol.messages import *  # noqa: F403 - every message is public
from protocol.messages import PROTOCOL_VERSION, Message, Reply, Request

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "DTYPE_SIZES",
    "ERRORS_BY_CODE",
    "PROTOCOL_VERSION",
    "TRTLLM_AXIS_ORDER",
    "VLLM_AXIS_ORDER",
    "FrameBuffer",
    "KVLayout",
    "KvdError",
    "Message",
    "Reply",
    "Request",
    "decode_reply",
    "decode_request",
    "encode",
    "error_from_code",
    "frame",
    "request_id_of",
]
