"""A ``raymem://`` (or ``raynode://``) file open for writing."""
from __future__ import annotations

import time

import numpy as np

from ...storage import METADATA_NAME

__all__ = ["MemWriter"]


class MemWriter:
    """A file open for writing: bytes collect in memory and go to the holders on ``close``
    (a ``with`` block that raises discards them: no partial file is ever held)."""

    mode = "wb"

    def __init__(self, fs, path: str):
        self.fs, self.path = fs, path
        self._buf = bytearray()
        self._created = time.time_ns()
        self.closed = False

    def write(self, data) -> int:
        view = memoryview(data)
        self._buf += view
        return view.nbytes

    def tell(self) -> int:
        return len(self._buf)

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        buf, self._buf = self._buf, bytearray()
        if self.path.rsplit("/", 1)[-1] == METADATA_NAME:
            self.fs.commit_metadata(self.path, bytes(buf))
        else:
            self.fs.hold(self.path, np.frombuffer(buf, dtype=np.uint8), self._created)

    def discard(self) -> None:
        self.closed = True
        self._buf = bytearray()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.discard()
