"""The two ends of a conversion: a raydcp checkpoint read as whole tensors, and the destination.

:class:`TensorSource` reads a raydcp checkpoint as whole tensors, a bounded group at a time: it
plans groups of keys whose bytes add up to at most ``budget_bytes`` (a tensor larger than the
budget forms a group of its own) and loads each group with one ``raydcp.load`` call into freshly
allocated full tensors. Only one group is held at a time, so an export needs about
``max(budget_bytes, largest tensor)`` plus what the output format itself buffers.

:class:`Destination` is where a conversion writes (a local path or fsspec URL); it refuses to
write over something that exists unless told to overwrite.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import torch
from fsspec.implementations.local import LocalFileSystem

from ..codec import dtype_from_name
from ..engine import read_metadata
from ..engine.load import load_with
from ..errors import CheckpointError
from ..metadata import Metadata, TensorMeta
from ..planner import numel
from ..planner.tiling import piece_problems
from ..storage.paths import location_to_fs
from ..transport import LocalTransport
from .keys import KeySelection
from .sizes import parse_size

__all__ = ["DEFAULT_BUDGET", "Progress", "TensorSource", "parse_size", "tensor_nbytes", "ConvertResult",
           "Destination"]

DEFAULT_BUDGET = 1 << 30
Progress = Callable[[int, int], None]  # (bytes done, bytes in total)

def tensor_nbytes(tm: TensorMeta) -> int:
    """Bytes of the whole tensor (not of its stored pieces, which could in principle overlap)."""
    return numel(tm.shape) * dtype_from_name(tm.dtype).itemsize


class TensorSource:
    """A committed raydcp checkpoint, read as whole tensors in bounded groups.

    With a :class:`~raydcp.convert.keys.KeySelection`, :attr:`keys` are the source keys it keeps,
    and :meth:`load_group` / :meth:`iter_tensors` / :attr:`values` give them under their
    destination names, cast to their destination dtypes.
    """

    def __init__(self, checkpoint_id, storage_options: dict | None = None, *,
                 budget_bytes: int = DEFAULT_BUDGET, metadata: Metadata | None = None,
                 select: KeySelection | None = None):
        if not isinstance(budget_bytes, int) or budget_bytes < 1:
            raise CheckpointError(f"budget_bytes must be a positive integer, got {budget_bytes!r}")
        self.checkpoint_id = checkpoint_id
        self.storage_options = storage_options
        self.budget = budget_bytes
        if metadata is None:
            metadata = read_metadata(checkpoint_id, storage_options=storage_options)
        self.metadata = metadata
        self.select = select or KeySelection()
        self.names = self.select.names(metadata.keys())  # source key -> destination key, keys kept

    @property
    def keys(self) -> list[str]:
        """The source keys of the tensors kept, sorted."""
        return sorted(k for k in self.metadata.tensors if k in self.names)

    @property
    def values(self) -> dict:
        """The plain values kept, by destination name."""
        return {self.names[k]: v for k, v in self.metadata.values.items() if k in self.names}

    @property
    def dropped(self) -> list[str]:
        return sorted(k for k in self.metadata.keys() if k not in self.names)

    def dest_dtype(self, key: str) -> str:
        return self.select.cast(key, self.metadata.tensors[key].dtype)

    def dest_nbytes(self, key: str) -> int:
        return numel(self.metadata.tensors[key].shape) * dtype_from_name(self.dest_dtype(key)).itemsize

    def nbytes(self, keys: Iterable[str] | None = None) -> int:
        """Bytes of the tensors ``keys`` (source keys; all kept by default) as they are written."""
        return sum(self.dest_nbytes(k) for k in (self.keys if keys is None else keys))

    def groups(self, keys: Sequence[str], max_bytes: int | None = None) -> list[list[str]]:
        """``keys`` (in order) cut into consecutive groups of at most ``max_bytes`` (the budget)."""
        limit = self.budget if max_bytes is None else max_bytes
        out: list[list[str]] = []
        size = 0
        for key in keys:
            n = tensor_nbytes(self.metadata.tensors[key])
            if not out or size + n > limit:
                out.append([])
                size = 0
            out[-1].append(key)
            size += n
        return out

    def load_group(self, keys: Sequence[str]) -> dict[str, torch.Tensor]:
        """Whole tensors for the source ``keys``, freshly allocated and filled by ``raydcp.load``,
        by destination name and in the destination dtype."""
        tensors = self.metadata.tensors
        missing = [k for k in keys if k not in tensors]
        if missing:
            raise CheckpointError(f"{self.checkpoint_id}: no tensor named {', '.join(missing[:5])} in the checkpoint")
        # raydcp.load fills only what the stored pieces cover: refuse pieces that leave a gap
        # rather than hand on the uninitialized memory of torch.empty
        gaps = [p for k in keys for p in piece_problems(k, tensors[k].shape, [(c.offsets, c.sizes)
                                                                                 for c in tensors[k].chunks])]
        if gaps:
            raise CheckpointError(f"{self.checkpoint_id}: the metadata's pieces do not form whole tensors "
                                  f"(run `raydcp verify`): {'; '.join(gaps[:5])}")
        out = {k: torch.empty(tensors[k].shape, dtype=dtype_from_name(tensors[k].dtype)) for k in keys}
        if out:
            load_with(LocalTransport(), out, self.checkpoint_id, strict=False, storage_options=self.storage_options,
                      warn_skipped=False, fresh=True)  # a subset of the keys, on purpose; new tensors: no undo copy
        named = {}
        for k in keys:
            t = out.pop(k)
            dtype = self.dest_dtype(k)
            named[self.names.get(k, k)] = t if dtype == tensors[k].dtype else t.to(dtype_from_name(dtype))
        return named

    def iter_tensors(self, keys: Sequence[str] | None = None,
                     progress: Progress | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(destination key, whole tensor)`` in ``keys`` order (all kept tensors, sorted, by default)."""
        keys = self.keys if keys is None else list(keys)
        total, done = self.nbytes(keys), 0
        if progress:
            progress(0, total)
        for group in self.groups(keys):
            loaded = self.load_group(group)
            for key in group:
                name = self.names.get(key, key)
                t = loaded.pop(name)
                yield name, t
                done += t.numel() * t.element_size()
                if progress:
                    progress(done, total)


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
    dropped: int = 0  # keys left out by the KeySelection


class Destination:
    """An output file or directory of an export (``dst`` is a local path or fsspec URL)."""

    def __init__(self, dst, storage_options: dict | None = None):
        self.url = os.fspath(dst)
        try:
            self.fs, self.path = location_to_fs(self.url, storage_options)
        except Exception as exc:
            raise CheckpointError(f"cannot open {self.url}: {type(exc).__name__}: {exc}") from exc
        self.local = isinstance(self.fs, LocalFileSystem)

    @contextmanager
    def guard(self, action: str) -> Iterator[None]:
        """Turn an OS or fsspec error into a CheckpointError naming the destination."""
        try:
            yield
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"could not {action} {self.url}: {type(exc).__name__}: {exc}") from exc

    def check_free(self, *, directory: bool, overwrite: bool) -> None:
        """Refuse to write over an existing file or a non-empty directory unless ``overwrite``."""
        with self.guard("look up"):
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
        with self.guard("create"):
            self.fs.makedirs(self.path, exist_ok=True)

    def open(self, path: str, mode: str = "wb"):
        return self.fs.open(path, mode)

    def write_bytes(self, path: str, data: bytes) -> None:
        with self.guard("write"):
            self.fs.pipe_file(path, data)

    def display(self, path: str) -> str:
        return path if self.local else self.fs.unstrip_protocol(path)

