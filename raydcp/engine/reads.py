"""Executing a rank's load plan: read source chunks once, deliver each part where it is needed."""
from __future__ import annotations

import abc
import bisect
from typing import Any, Callable, Sequence

import torch

from ..codec import checksum, itemsize, tensor_bytes, tensor_from_bytes
from ..errors import CheckpointError
from ..metadata import BLOCK_BYTES
from ..planner import ChunkRead, Delivery, byte_runs, merge_runs
from ..state import TensorLeaf

__all__ = ["ChunkReader", "FileChunkReader", "LiveChunkReader", "Deliverer"]


def _narrow(t: torch.Tensor, base, offsets, sizes) -> torch.Tensor:
    """The view of ``t`` (whose first element sits at global ``base``) holding the global box."""
    for d, (o, n, b) in enumerate(zip(offsets, sizes, base)):
        t = t.narrow(d, o - b, n)
    return t


def _region(leaf: TensorLeaf, offsets, sizes) -> torch.Tensor:
    return _narrow(leaf.tensor, leaf.offsets, offsets, sizes)


class Deliverer:
    """Puts delivered parts into this rank's tensors, or queues them for other ranks."""

    def __init__(self, rank: int, leaves: Sequence[TensorLeaf]):
        self.rank = rank
        self.leaves = leaves
        self.outgoing: dict[int, list[tuple[Any, torch.Tensor]]] = {}
        self.received = 0

    def deliver(self, d: Delivery, src: torch.Tensor) -> None:
        if d.rank == self.rank:
            _region(self.leaves[d.item], d.offsets, d.sizes).copy_(src)
        else:
            self.outgoing.setdefault(d.rank, []).append(((d.item, d.offsets, d.sizes), tensor_bytes(src)))

    def accept(self, tag: Any, buf: Any) -> None:
        item, offsets, sizes = tag
        leaf = self.leaves[item]
        _region(leaf, offsets, sizes).copy_(tensor_from_bytes(buf, leaf.dtype, tuple(sizes)))
        self.received += 1


def _verifiable(runs: list[tuple[int, int]], ch) -> list[tuple[int, int]]:
    """Widen partial reads to what a checksum covers: whole blocks, or the whole (small) chunk."""
    if runs == [(0, ch.nbytes)] or ch.checksum is None:
        return runs
    if not ch.block_checksums:
        return [(0, ch.nbytes)]
    return merge_runs([(s // BLOCK_BYTES * BLOCK_BYTES, min(-(-e // BLOCK_BYTES) * BLOCK_BYTES, ch.nbytes))
                       for s, e in runs])


class ChunkReader(abc.ABC):
    @abc.abstractmethod
    def read(self, cr: ChunkRead, out: Deliverer) -> int:
        """Deliver every part of the chunk ``cr``; return the bytes read from the source."""


class FileChunkReader(ChunkReader):
    """Reads stored chunks through a CheckpointStorage: only the needed byte runs, each once."""

    def __init__(self, storage):
        self.storage = storage

    def read(self, cr: ChunkRead, out: Deliverer) -> int:
        ch = cr.source
        isz = itemsize(ch.dtype)
        if ch.nbytes == 0:
            return 0
        if len(cr.deliveries) == 1:
            d = cr.deliveries[0]
            if d.rank == out.rank and d.sizes == ch.sizes and self._read_direct(cr, d, out):
                return ch.nbytes
        per_delivery = [byte_runs(ch.offsets, ch.sizes, d.offsets, d.sizes, isz) for d in cr.deliveries]
        runs = _verifiable(merge_runs([r for rs in per_delivery for r in rs]), ch)
        bufs = self._fetch(ch, runs)
        if runs == [(0, ch.nbytes)]:  # the whole chunk: verify it, then slice deliveries from it
            self._verify(ch, bufs[0])
            whole = tensor_from_bytes(bufs[0], ch.dtype, ch.sizes)
            for d in cr.deliveries:
                out.deliver(d, _narrow(whole, ch.offsets, d.offsets, d.sizes))
        else:  # parts of the chunk: verify the blocks read, assemble each delivery from them
            for (s, e), buf in zip(runs, bufs):
                self._verify_blocks(ch, s, e, buf)
            starts = [s for s, _ in runs]
            for d, drs in zip(cr.deliveries, per_delivery):
                parts = []
                for s, e in drs:
                    j = bisect.bisect_right(starts, s) - 1
                    base = runs[j][0]
                    parts.append(memoryview(bufs[j])[s - base:e - base])
                data = parts[0] if len(parts) == 1 else b"".join(parts)
                out.deliver(d, tensor_from_bytes(data, ch.dtype, d.sizes))
        return sum(e - s for s, e in runs)

    def _fetch(self, ch, runs):
        try:
            return self.storage.read_ranges(ch.file, [(ch.byte_offset + s, ch.byte_offset + e) for s, e in runs])
        except CheckpointError as exc:
            raise CheckpointError(f"{ch.key}: {exc}") from None

    def _read_direct(self, cr: ChunkRead, d: Delivery, out: Deliverer) -> bool:
        """Read a whole chunk straight into this rank's tensor memory when it is contiguous on the host."""
        dest = _region(out.leaves[d.item], d.offsets, d.sizes)
        if dest.device.type != "cpu" or not dest.is_contiguous():
            return False
        ch = cr.source
        view = dest.reshape(-1).view(torch.uint8).numpy()
        try:
            self.storage.read_into(ch.file, ch.byte_offset, memoryview(view))
        except CheckpointError as exc:
            raise CheckpointError(f"{ch.key}: {exc}") from None
        self._verify(ch, view)
        return True

    @staticmethod
    def _verify_blocks(ch, start: int, end: int, buf) -> None:
        view = memoryview(buf)
        for b in range(start // BLOCK_BYTES, -(-end // BLOCK_BYTES)):
            lo, hi = b * BLOCK_BYTES, min((b + 1) * BLOCK_BYTES, ch.nbytes)
            if checksum(view[lo - start:hi - start]) != ch.block_checksums[b]:
                raise CheckpointError(
                    f"{ch.key}: checksum mismatch in {ch.file} at bytes {ch.byte_offset + lo}..{ch.byte_offset + hi} "
                    f"(piece at {list(ch.offsets)}); the checkpoint is damaged: restore it from another copy"
                )

    @staticmethod
    def _verify(ch, buf) -> None:
        if ch.checksum is not None and checksum(buf) != ch.checksum:
            raise CheckpointError(
                f"{ch.key}: checksum mismatch in {ch.file} at bytes {ch.byte_offset}..{ch.byte_offset + ch.nbytes} "
                f"(piece at {list(ch.offsets)}); the checkpoint is damaged: restore it from another copy"
            )


class LiveChunkReader(ChunkReader):
    """Serves chunks from tensors this rank holds in memory (in-memory reshard)."""

    def __init__(self, pieces: Callable[[str], torch.Tensor]):
        self.pieces = pieces  # key -> this rank's piece of that tensor

    def read(self, cr: ChunkRead, out: Deliverer) -> int:
        ch = cr.source
        whole = self.pieces(ch.key)
        for d in cr.deliveries:
            out.deliver(d, _narrow(whole, ch.offsets, d.offsets, d.sizes))
        return 0
