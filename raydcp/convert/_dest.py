"""Where a conversion writes (a local path or fsspec URL, refused when it already holds
something), and what it reports having written."""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ..errors import CheckpointError

__all__ = ["ConvertResult", "Destination"]


@dataclass
class ConvertResult:
    """What a conversion wrote: counts, bytes, output files and the entries it skipped (with why)."""

    src: str
    dst: str
    fmt: str
    tensors: int = 0
    values: int = 0
    nbytes: int = 0
    files: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


class Destination:
    """An output file or directory of an export (``dst`` is a local path or fsspec URL)."""

    def __init__(self, dst, storage_options: dict | None = None):
        self.url = os.fspath(dst)
        try:
            self.fs, self.path = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        except Exception as exc:
            raise CheckpointError(f"cannot open {self.url}: {type(exc).__name__}: {exc}") from exc
        self.local = isinstance(self.fs, LocalFileSystem)

    @contextmanager
    def _guard(self, action: str) -> Iterator[None]:
        """Turn an OS or fsspec error into a CheckpointError naming the destination."""
        try:
            yield
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"could not {action} {self.url}: {type(exc).__name__}: {exc}") from exc

    def check_free(self, *, directory: bool, overwrite: bool) -> None:
        """Refuse to write over an existing file or a non-empty directory unless ``overwrite``."""
        with self._guard("look up"):
            if not self.fs.exists(self.path):
                return
            is_dir = self.fs.isdir(self.path)
            if is_dir and not directory:
                raise CheckpointError(f"{self.url} is a directory; the output is a single file: give a file path")
            if not is_dir and directory:
                raise CheckpointError(f"{self.url} is a file; the output is a directory: give a directory path")
            if overwrite or (is_dir and not self.fs.ls(self.path)):
                return
        raise CheckpointError(f"{self.url} already exists; pass --overwrite (overwrite=True) to replace its files")

    def join(self, name: str) -> str:
        return f"{self.path.rstrip('/')}/{name}"

    def makedirs(self) -> None:
        with self._guard("create"):
            self.fs.makedirs(self.path, exist_ok=True)

    def open(self, path: str, mode: str = "wb"):
        return self.fs.open(path, mode)

    def write_bytes(self, path: str, data: bytes) -> None:
        with self._guard("write"):
            self.fs.pipe_file(path, data)

    def display(self, path: str) -> str:
        return path if self.local else self.fs.unstrip_protocol(path)

