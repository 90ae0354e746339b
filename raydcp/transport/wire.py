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

import numpy as np

from ..lazy import LazyMapping, LazySequence
from ..planner.types import (Delivery, FileSlot, ItemColumns, LocalLoadPlan, LocalSavePlan, PackedNames, ReadItem,
                             SourceChunk, TensorSpec, WriteItem)

__all__ = ["Wire", "encode", "decode"]


class Wire:
    """A control-plane value pickled by :func:`encode` (one bytes object: cheap for any carrier)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes):
        self.data = data

    def __reduce__(self):
        return (Wire, (self.data,))


class _Specs(LazyMapping):
    """A plan's ``tensors`` (key -> TensorSpec) from three lists, the dict built on first lookup.
    On the wire the lists travel as one pickled blob, unpickled on first use: a coordinator that
    compares the plans' signatures (every rank describing the same tensors) reads one rank's."""

    __slots__ = ("_lists", "_blob")

    def __init__(self, names: list, dtypes: list, shapes: list):
        self._lists, self._blob = (names, dtypes, shapes), None
        self._dict: dict | None = None

    @classmethod
    def _of_blob(cls, blob: bytes) -> "_Specs":
        specs = object.__new__(cls)
        specs._lists, specs._blob, specs._dict = None, blob, None
        return specs

    def lists(self) -> tuple[list, list, list]:
        if self._lists is None:
            self._lists = pickle.loads(self._blob)
        return self._lists

    def _build(self) -> dict:
        names, dtypes, shapes = self.lists()
        return dict(zip(names, map(TensorSpec, dtypes, shapes)))

    def blob(self) -> bytes:
        if self._blob is None:
            self._blob = pickle.dumps(self._lists, protocol=pickle.HIGHEST_PROTOCOL)
        return self._blob

    def __reduce__(self):
        return (_Specs._of_blob, (self.blob(),))


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


def _spec_lists(tensors: Mapping) -> _Specs | None:
    if isinstance(tensors, _Specs) and tensors._dict is None:
        return tensors
    specs = list(tensors.values())
    if not all(type(s) is TensorSpec for s in specs):
        return None
    return _Specs(list(tensors), [s.dtype for s in specs], [s.shape for s in specs])


def _plan_columns(plan) -> tuple | None:
    """What a local plan travels as, or None where its columns cannot stand for its items:
    its rank, its tensor specs (one blob) and its columns (:func:`_packed_columns`)."""
    cols = getattr(plan, "columns", None)
    if cols is None or len(cols.key) != len(plan.items) or (len(cols.ndim) and int(cols.ndim.min()) < 0):
        return None
    save = isinstance(plan, LocalSavePlan)
    if save and (cols.nbytes is None or cols.checksum is None):
        return None
    specs = _spec_lists(plan.tensors)
    return None if specs is None else (plan.rank, specs.blob(), _packed_columns(cols, save))


def _packed_columns(cols, save: bool) -> tuple:
    """An ItemColumns as one int64 array (key, ndim, [nbytes, checksum,] offsets, sizes, one after
    another) and the few values beside it: one buffer to unpickle per rank, not one per column."""
    n, width = cols.offsets.shape
    parts = [cols.key, cols.ndim, *((cols.nbytes, cols.checksum) if save else ()), cols.offsets.reshape(-1),
             cols.sizes.reshape(-1)]
    return (PackedNames.of(cols.keys), cols.keys_digest, cols.signature, getattr(cols, "layout", None), n, width,
            np.concatenate([np.asarray(x, np.int64).reshape(-1) for x in parts]))


def _unpacked_columns(keys, keys_digest, signature, layout, n: int, width: int, buf: np.ndarray,
                      save: bool) -> ItemColumns:
    c = object.__new__(ItemColumns)
    c.keys, c.keys_digest, c.signature, c.layout = keys, keys_digest, signature, layout
    c.key, c.ndim = buf[:n], buf[n:2 * n]
    at = 2 * n
    if save:
        c.nbytes, c.checksum = buf[at:at + n], buf[at + n:at + 2 * n]
        at += 2 * n
    else:
        c.nbytes = c.checksum = None
    c.offsets = buf[at:at + n * width].reshape(n, width)
    c.sizes = buf[at + n * width:at + 2 * n * width].reshape(n, width)
    return c


def _save_plan(rank: int, specs: bytes, columns: tuple, values) -> LocalSavePlan:
    plan = object.__new__(LocalSavePlan)  # its columns came with it: no __post_init__ pass over the items
    cols = _unpacked_columns(*columns, True)
    plan.__dict__.update(rank=rank, tensors=_Specs._of_blob(specs), items=_PlanItems(cols, True), values=values,
                         columns=cols)
    return plan


def _load_plan(rank: int, specs: bytes, columns: tuple, values, strict: bool) -> LocalLoadPlan:
    plan = object.__new__(LocalLoadPlan)
    cols = _unpacked_columns(*columns, False)
    plan.__dict__.update(rank=rank, tensors=_Specs._of_blob(specs), items=_PlanItems(cols, False), values=values,
                         strict=strict, columns=cols)
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
