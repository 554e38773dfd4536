"""Where each gRPC message ends in one direction of an HTTP/2 connection, from its raw bytes.

The fault proxy forwards bytes unchanged; this scanner only tells it at which byte offsets
gRPC messages begin and end, so that faults can be placed after the N-th message (byte
counts alone are not reproducible: varint sizes of timings and HPACK state vary from run to
run, message counts do not).

HTTP/2 (RFC 9113): the client's side starts with a 24-byte preface; then both sides send
frames of a 9-byte header (24-bit length, type, flags, 31-bit stream id) and a payload.
gRPC messages travel in DATA frames (type 0), each a 5-byte prefix (compressed flag, 32-bit
big-endian length) and the message. One message may span several DATA frames, and one
frame may hold several messages; padding (flag 0x8) is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADER_BYTES = 9
GRPC_PREFIX_BYTES = 5
DATA = 0x0
FLAG_PADDED = 0x8


@dataclass(frozen=True)
class Message:
    index: int  # 0-based, counted over the whole connection in this direction
    stream_id: int
    start: int  # offset of its first prefix byte in this direction's byte stream
    end: int  # offset just past its last byte


class _StreamMessages:
    """The gRPC message being read on one HTTP/2 stream."""

    def __init__(self) -> None:
        self.prefix = bytearray()
        self.left = 0  # message bytes still to come after the prefix
        self.start = 0


class GrpcMessageScanner:
    """Feed it one direction's bytes in order; it returns the messages each chunk ends."""

    def __init__(self, client_side: bool) -> None:
        self.offset = 0  # bytes fed so far
        self.messages = 0  # messages completed so far
        self._preface_left = len(PREFACE) if client_side else 0
        self._header = bytearray()
        self._frame_left = 0  # payload bytes of the current frame not yet fed
        self._frame_type = 0
        self._frame_flags = 0
        self._stream = 0
        self._pad_length: int | None = None  # None until a padded frame's pad byte is read
        self._data_left = 0  # DATA bytes (padding excluded) of the current frame
        self._streams: dict[int, _StreamMessages] = {}

    def feed(self, data: bytes) -> list[Message]:
        done: list[Message] = []
        view = memoryview(data)
        i = 0
        while i < len(view):
            if self._preface_left:
                n = min(self._preface_left, len(view) - i)
                self._preface_left -= n
                i += n
            elif self._frame_left == 0:
                n = min(FRAME_HEADER_BYTES - len(self._header), len(view) - i)
                self._header += view[i:i + n]
                i += n
                if len(self._header) == FRAME_HEADER_BYTES:
                    self._start_frame()
            else:
                i = self._frame_bytes(view, i, done)
        self.offset += len(data)
        return done

    def _start_frame(self) -> None:
        h = self._header
        self._frame_left = int.from_bytes(h[0:3], "big")
        self._frame_type, self._frame_flags = h[3], h[4]
        self._stream = int.from_bytes(h[5:9], "big") & 0x7FFF_FFFF
        self._header = bytearray()
        padded = self._frame_type == DATA and self._frame_flags & FLAG_PADDED
        self._pad_length = None if padded else 0
        self._data_left = self._frame_left if not padded else 0

    def _frame_bytes(self, view: memoryview, i: int, done: list[Message]) -> int:
        """Consumes payload bytes of the current frame from ``view[i:]``; returns the new i."""
        if self._frame_type != DATA:
            n = min(self._frame_left, len(view) - i)
            self._frame_left -= n
            return i + n
        if self._pad_length is None:  # the pad length byte of a padded DATA frame
            self._pad_length = view[i]
            self._frame_left -= 1
            self._data_left = self._frame_left - self._pad_length
            return i + 1
        if self._data_left == 0:  # padding
            n = min(self._frame_left, len(view) - i)
            self._frame_left -= n
            return i + n
        n = min(self._data_left, len(view) - i)
        self._grpc_bytes(view[i:i + n], self.offset + i, done)
        self._data_left -= n
        self._frame_left -= n
        return i + n

    def _grpc_bytes(self, chunk: memoryview, at: int, done: list[Message]) -> None:
        state = self._streams.setdefault(self._stream, _StreamMessages())
        j = 0
        while j < len(chunk):
            if state.left == 0 and len(state.prefix) < GRPC_PREFIX_BYTES:
                if not state.prefix:
                    state.start = at + j
                n = min(GRPC_PREFIX_BYTES - len(state.prefix), len(chunk) - j)
                state.prefix += chunk[j:j + n]
                j += n
                if len(state.prefix) == GRPC_PREFIX_BYTES:
                    state.left = int.from_bytes(state.prefix[1:5], "big")
                    if state.left == 0:
                        self._complete(state, at + j, done)
                continue
            n = min(state.left, len(chunk) - j)
            state.left -= n
            j += n
            if state.left == 0:
                self._complete(state, at + j, done)

    def _complete(self, state: _StreamMessages, end: int, done: list[Message]) -> None:
        done.append(Message(self.messages, self._stream, state.start, end))
        self.messages += 1
        state.prefix = bytearray()
        state.left = 0
