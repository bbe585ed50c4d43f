"""Length-prefixed framing, sans-IO.

A frame is a 4-byte big-endian unsigned length followed by that many payload bytes. The
:class:`FrameBuffer` takes whatever bytes arrived and yields complete payloads; a length
above ``max_frame_size`` raises :class:`FrameTooLarge` *before* any of it is buffered, so a
hostile length prefix cannot make the reader allocate.
"""

from __future__ import annotations

import struct

from protocol.errors import FrameTooLarge, ProtocolError

HEADER = struct.Struct(">I")
_HEADER_SIZE = HEADER.size
_unpack_from = HEADER.unpack_from
DEFAULT_MAX_FRAME_SIZE = 16 * 1024 * 1024


def frame(payload: bytes, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    """Prefix ``payload`` with its length."""
    if len(payload) > max_frame_size:
        raise FrameTooLarge(f"frame of {len(payload)} bytes exceeds the maximum of {max_frame_size}")
    return HEADER.pack(len(payload)) + payload


class FrameBuffer:
    """Accumulates received bytes and splits them into frames."""

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, first_frame_size: int | None = None) -> None:
        """``first_frame_size``: a tighter bound for the first frame only (a handshake), checked
        as soon as its length arrives; frames after it, in the same read too, have ``max_frame_size``."""
        if max_frame_size < 1 or (first_frame_size is not None and first_frame_size < 1):
            raise ValueError("frame sizes must be positive")
        self.max_frame_size = max_frame_size
        self._first = first_frame_size  # None once the first frame is cut (or when not given)
        self._buf = bytearray()
        self._broken = False

    def feed(self, data: bytes) -> list[bytes]:
        """Add ``data``; return every frame that is now complete (possibly none)."""
        if self._broken:
            raise ProtocolError("frame buffer is broken by an earlier error")
        # Frames are cut at offsets, and only the tail of an incomplete frame is kept: the
        # usual batch (a few whole frames in one read, nothing pending) is sliced straight out
        # of ``data``, one copy per frame, with no append to and delete from the buffer.
        buf = self._buf
        if buf:
            buf += data
            view: bytes | bytearray = buf
        else:
            view = data
        frames: list[bytes] = []
        size = len(view)
        pos = 0
        first = self._first
        limit = self.max_frame_size if first is None else first
        while size - pos >= _HEADER_SIZE:
            (length,) = _unpack_from(view, pos)
            if length > limit:
                self._broken = True
                buf.clear()
                what = "first frame size" if first is not None else "frame size"
                raise FrameTooLarge(f"frame length {length} exceeds the maximum {what} {limit}")
            end = pos + _HEADER_SIZE + length
            if end > size:
                break
            frames.append(bytes(view[pos + _HEADER_SIZE : end]))
            pos = end
            if first is not None:  # the first frame is cut: the usual bound from here on
                first = self._first = None
                limit = self.max_frame_size
        if view is buf:
            del buf[:pos]
        elif pos < size:
            buf += view[pos:]
        return frames

    @property
    def pending(self) -> int:
        """Bytes buffered that do not yet form a whole frame."""
        return len(self._buf)
