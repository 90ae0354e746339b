"""Byte-range reads: coalescing of requested ranges, and positional reads of local files.

A load asks for thousands of small ranges of one file. Ranges that touch or overlap are merged
into one *span* and read once; ranges with a gap between them stay separate, so no byte that
nobody asked for is ever read (bytes read / bytes needed <= 1.0). Each requested range is then
returned as a zero-copy memoryview slice of its span.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import CheckpointError


@dataclass(frozen=True)
class RangePlan:
    """Where each requested range lies inside the spans to read.

    ``spans`` are disjoint, non-touching ``(start, end)`` pairs sorted by start;
    ``pieces[i]`` is ``(span_index, offset_in_span, length)`` for requested range ``i``
    (``span_index`` is -1 for an empty range, which needs no read).
    """

    spans: tuple[tuple[int, int], ...]
    pieces: tuple[tuple[int, int, int], ...]

    @property
    def end(self) -> int:
        return self.spans[-1][1] if self.spans else 0

    def slices(self, buffers: Sequence[Any]) -> list[memoryview]:
        """Slice the requested ranges out of one buffer per span (no copies)."""
        views = [byte_view(b) for b in buffers]
        out: list[memoryview] = []
        for span_index, offset, length in self.pieces:
            if span_index < 0:
                out.append(memoryview(b""))
            else:
                out.append(views[span_index][offset : offset + length])
        return out


def plan_ranges(ranges: Sequence[tuple[int, int]], file_url: str) -> RangePlan:
    """Merge touching or overlapping ranges (gap 0) into spans; validate every range."""
    order: list[int] = []
    for i, rng in enumerate(ranges):
        try:
            start, end = rng
        except (TypeError, ValueError):
            raise CheckpointError(f"invalid byte range {rng!r} for {file_url}: expected (start, end)") from None
        if not (isinstance(start, int) and isinstance(end, int)) or start < 0 or end < start:
            raise CheckpointError(
                f"invalid byte range {rng!r} for {file_url}: need integers 0 <= start <= end"
            )
        if end > start:
            order.append(i)
    order.sort(key=lambda i: ranges[i][0])

    spans: list[list[int]] = []
    pieces: list[tuple[int, int, int]] = [(-1, 0, 0)] * len(ranges)
    for i in order:
        start, end = ranges[i]
        if spans and start <= spans[-1][1]:
            span = spans[-1]
            span[1] = max(span[1], end)
        else:
            spans.append([start, end])
        pieces[i] = (len(spans) - 1, start - spans[-1][0], end - start)
    return RangePlan(tuple((s, e) for s, e in spans), tuple(pieces))


def byte_view(buffer: Any, *, writable: bool = False) -> memoryview:
    """A flat unsigned-byte view of any C-contiguous buffer (bytes, memoryview, numpy array)."""
    try:
        view = memoryview(buffer)
    except TypeError:
        raise CheckpointError(
            f"expected a bytes-like buffer (bytes, bytearray, memoryview, numpy array), got "
            f"{type(buffer).__name__}"
        ) from None
    if writable and view.readonly:
        raise CheckpointError("read_into needs a writable buffer; got a read-only one")
    if view.format == "B" and view.ndim == 1:
        return view
    if not view.c_contiguous:
        raise CheckpointError("buffers must be C-contiguous; make a contiguous copy first")
    return view.cast("B")
