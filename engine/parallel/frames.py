"""Length-prefixed pickled frames over a byte stream (a pipe between processes of one
engine: the data-parallel replicas and their front end). Torch-free."""

from __future__ import annotations

import asyncio
import pickle
import struct
from typing import Any, BinaryIO

_LEN = struct.Struct("<Q")


def encode(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(data)) + data


def read_frame(stream: BinaryIO) -> Any | None:
    """The next object, or None at the end of the stream."""
    head = _read_exact(stream, _LEN.size)
    if head is None:
        return None
    data = _read_exact(stream, _LEN.unpack(head)[0])
    if data is None:
        return None
    return pickle.loads(data)


def _read_exact(stream: BinaryIO, n: int) -> bytes | None:
    parts, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


class FrameWriter:
    """Frames sent from an event loop's thread, written together once per loop turn
    (one write for every output of an engine step)."""

    def __init__(self, stream: BinaryIO, loop: asyncio.AbstractEventLoop) -> None:
        self.stream, self.loop = stream, loop
        self._pending: list[bytes] = []
        self.closed = False

    def send(self, obj: Any) -> None:
        if not self._pending:
            self.loop.call_soon(self.flush)
        self._pending.append(encode(obj))

    def flush(self) -> None:
        if not self._pending or self.closed:
            return
        data, self._pending = b"".join(self._pending), []
        try:
            self.stream.write(data)
            self.stream.flush()
        except (BrokenPipeError, ValueError):  # the other side is gone
            self.closed = True
