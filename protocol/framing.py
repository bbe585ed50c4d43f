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
DEFAULT_MAX_FRAME_SIZE = 16 * 1024 * 1024


def frame(payload: bytes, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    """Prefix ``payload`` with its length."""
    if len(payload) > max_frame_size:
        raise FrameTooLarge(f"frame of {len(payload)} bytes exceeds the maximum of {max_frame_size}")
    return HEADER.pack(len(payload)) + payload


class FrameBuffer:
    """Accumulates received bytes and splits them into frames."""

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        if max_frame_size < 1:
            raise ValueError("max_frame_size must be positive")
        self.max_frame_size = max_frame_size
        self._buf = bytearray()
        self._broken = False

    def feed(self, data: bytes) -> list[bytes]:
        """Add ``data``; return every frame that is now complete (possibly none)."""
        if self._broken:
            raise ProtocolError("frame buffer is broken by an earlier error")
        self._buf += data
        frames: list[bytes] = []
        while len(self._buf) >= HEADER.size:
            (length,) = HEADER.unpack_from(self._buf)
            if length > self.max_frame_size:
                self._broken = True
                self._buf.clear()
                raise FrameTooLarge(
                    f"frame length {length} exceeds the maximum frame size {self.max_frame_size}"
                )
            end = HEADER.size + length
            if len(self._buf) < end:
                break
            frames.append(bytes(self._buf[HEADER.size : end]))
            del self._buf[:end]
        return frames

    @property
    def pending(self) -> int:
        """Bytes buffered that do not yet form a whole frame."""
        return len(self._buf)
