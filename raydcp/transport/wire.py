"""Control-plane values on the wire: :func:`encode` / :func:`decode` and the :class:`Wire` they travel as.

Transports whose control-plane values cross processes send them as :class:`Wire`: a
plain pickle in which local plans travel as their columns only (tensor specs and
:class:`~raydcp.planner.ItemColumns`, no per-piece objects); the receiving side gets
plans whose ``items`` and ``tensors`` are built from the columns on first use, which
the planners' array paths never do. A Wire only travels between processes of one
running job (the same code on both sides); nothing persists one.
"""
from __future__ import annotations

import dataclasses
import io
import pickle
from typing import Any, Mapping

from ..lazy import LazyMapping, LazySequence
from ..planner.types import (Delivery, FileSlot, LocalLoadPlan, LocalSavePlan, ReadItem, SourceChunk, TensorSpec,
                             WriteItem)

__all__ = ["Wire", "encode", "decode"]


class Wire:
    """A control-plane value pickled by :func:`encode` (one bytes object: cheap for any carrier)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes):
        self.data = data

    def __reduce__(self):
        return (Wire, (self.data,))


class _Specs(LazyMapping):
    """A plan's ``tensors`` (key -> TensorSpec) from three lists, the dict built on first lookup."""

    __slots__ = ("names", "dtypes", "shapes")

    def __init__(self, names: list, dtypes: list, shapes: list):
        self.names, self.dtypes, self.shapes = names, dtypes, shapes
        self._dict: dict | None = None

    def _build(self) -> dict:
        return dict(zip(self.names, map(TensorSpec, self.dtypes, self.shapes)))

    def __reduce__(self):
        return (_Specs, (self.names, self.dtypes, self.shapes))


class _PlanItems(LazySequence):
    """A plan's ``items`` (WriteItem or ReadItem) from its ItemColumns, built on first use."""

    __slots__ = ("columns", "save")

    def __init__(self, columns, save: bool):
        self.columns, self.save = columns, save
        self._objs: tuple | None = None

    def _build(self) -> tuple:
        c = self.columns
        keys, kid, nds = c.keys, c.key.tolist(), c.ndim.tolist()
        off, size = c.offsets.tolist(), c.sizes.tolist()
        if self.save:
            nb, crc = c.nbytes.tolist(), c.checksum.tolist()
            return tuple(WriteItem(keys[k], tuple(o[:n]), tuple(s[:n]), b, None if x < 0 else x)
                         for k, n, o, s, b, x in zip(kid, nds, off, size, nb, crc))
        return tuple(ReadItem(keys[k], tuple(o[:n]), tuple(s[:n])) for k, n, o, s in zip(kid, nds, off, size))

    def __len__(self) -> int:
        return len(self.columns.key)

    def __reduce__(self):
        return (tuple, (self._all(),))


def _spec_lists(tensors: Mapping) -> tuple[list, list, list] | None:
    if isinstance(tensors, _Specs) and tensors._dict is None:
        return tensors.names, tensors.dtypes, tensors.shapes
    specs = list(tensors.values())
    if not all(type(s) is TensorSpec for s in specs):
        return None
    return list(tensors), [s.dtype for s in specs], [s.shape for s in specs]


def _plan_columns(plan) -> tuple | None:
    """What a local plan travels as, or None where its columns cannot stand for its items."""
    cols = getattr(plan, "columns", None)
    if cols is None or len(cols.key) != len(plan.items) or (len(cols.ndim) and int(cols.ndim.min()) < 0):
        return None
    if isinstance(plan, LocalSavePlan) and (cols.nbytes is None or cols.checksum is None):
        return None
    specs = _spec_lists(plan.tensors)
    return None if specs is None else (plan.rank, specs, cols)


def _save_plan(rank: int, specs: tuple, columns, values) -> LocalSavePlan:
    plan = object.__new__(LocalSavePlan)  # its columns came with it: no __post_init__ pass over the items
    plan.__dict__.update(rank=rank, tensors=_Specs(*specs), items=_PlanItems(columns, True), values=values,
                         columns=columns)
    return plan


def _load_plan(rank: int, specs: tuple, columns, values, strict: bool) -> LocalLoadPlan:
    plan = object.__new__(LocalLoadPlan)
    plan.__dict__.update(rank=rank, tensors=_Specs(*specs), items=_PlanItems(columns, False), values=values,
                         strict=strict, columns=columns)
    return plan


# slots dataclasses travel as their constructor's arguments (their default pickling runs Python code per object)
_POSITIONAL = {cls: tuple(f.name for f in dataclasses.fields(cls))
               for cls in (TensorSpec, WriteItem, ReadItem, FileSlot, SourceChunk, Delivery)}


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        cls = type(obj)
        names = _POSITIONAL.get(cls)
        if names is not None:
            return cls, tuple([getattr(obj, n) for n in names])
        if cls is LocalSavePlan:
            packed = _plan_columns(obj)
            if packed is not None:
                return _save_plan, (*packed, obj.values)
        elif cls is LocalLoadPlan:
            packed = _plan_columns(obj)
            if packed is not None:
                return _load_plan, (*packed, obj.values, obj.strict)
        return NotImplemented


def encode(value: Any) -> Wire:
    """``value`` as a :class:`Wire`; raises what pickling raises (callers fall back to their carrier's own)."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return Wire(buf.getvalue())


def decode(value: Any) -> Any:
    """The value an :func:`encode` made (anything else is returned as it is)."""
    return pickle.loads(value.data) if isinstance(value, Wire) else value
