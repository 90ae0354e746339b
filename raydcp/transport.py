"""The one seam through which the ranks of a collective save or load talk.

The engine (``raydcp.engine``) never imports Ray. It is handed a
:class:`Transport`, and every distributed step goes through two calls:

1. ``reduce_scatter(step, local, reduce_fn)`` -- the control plane. Every rank
   calls it with its local value (plans, records: small metadata, never tensor
   data). In one place (the coordinator) ``reduce_fn(values_by_rank)`` runs and
   returns one value per rank; each rank receives its own. If any rank sent a
   :class:`~raydcp.errors.RankFailure`, ``reduce_fn`` does not run and every
   rank raises one :class:`~raydcp.errors.CheckpointError` naming the failed
   ranks. If ``reduce_fn`` raises a ``CheckpointError``, every rank raises it.
   A rank that does not arrive within the group's timeout makes every waiting
   rank raise a ``CheckpointError`` naming the missing ranks.
2. ``exchange(step, outgoing)`` -- the data plane. ``outgoing`` maps a
   destination rank to a list of ``(tag, buffer)`` pairs, buffers being
   contiguous ``torch.uint8`` tensors. Every rank calls it once per step and
   receives the pairs all ranks addressed to it (``(tag, buffer)`` with a
   bytes-like buffer). Buffers a rank sends stay valid until that rank's next
   ``reduce_scatter`` returns, which is why the engine always ends an operation
   with one.

Every rank makes the same calls in the same order. Implementations:
:class:`LocalTransport` (one participant, ``group=None``), :class:`ThreadTransport`
(N ranks as threads of one process, for tests and tools) and the Ray transport
in ``raydcp.runtime`` (ranks are Ray actors or tasks; a coordinator actor runs
``reduce_fn``; buffers travel through the object store).

Transports whose control-plane values cross processes send them as :class:`Wire`
(:func:`encode` / :func:`decode`): a plain pickle in which local plans travel as
their columns only (tensor specs and :class:`~raydcp.planner.ItemColumns`, no
per-piece objects); the receiving side gets plans whose ``items`` and ``tensors``
are built from the columns on first use, which the planners' array paths never do.
"""
from __future__ import annotations

import abc
import dataclasses
import gc
import io
import pickle
import threading
import time
from typing import Any, Callable, Mapping

import torch

from .errors import CheckpointError, RankFailure, RanksTimedOutError, coordinator_error, raise_failures
from .lazy import LazyMapping, LazySequence
from .planner.types import (Delivery, FileSlot, LocalLoadPlan, LocalSavePlan, ReadItem, SourceChunk, TensorSpec,
                            WriteItem)

__all__ = ["Transport", "LocalTransport", "ThreadTransport", "run_reduce", "Wire", "encode", "decode"]

ReduceFn = Callable[[list[Any]], list[Any]]
Outgoing = dict[int, list[tuple[Any, torch.Tensor]]]


class Transport(abc.ABC):
    rank: int
    world_size: int

    @abc.abstractmethod
    def reduce_scatter(self, step: str, local: Any, reduce_fn: ReduceFn) -> Any:
        """Gather ``local`` from every rank, reduce in one place, scatter: see module doc."""

    @abc.abstractmethod
    def exchange(self, step: str, outgoing: Outgoing) -> list[tuple[Any, Any]]:
        """Send tagged byte buffers to other ranks and receive theirs: see module doc."""

    def close(self) -> None:
        """Release what the transport holds for this operation (called once, at the end)."""


def run_reduce(step: str, values: list[Any], reduce_fn: ReduceFn) -> list[Any]:
    """Apply ``reduce_fn`` the way every transport must: failures first, then one value per rank.

    Returns the per-rank results, or a list holding the same ``CheckpointError``
    for every rank when a rank failed or the reduction raised.
    """
    n = len(values)
    gc_was_on = gc.isenabled()
    gc.disable()  # planning builds many small acyclic objects: collections only cost time here
    try:
        raise_failures(step, [v for v in values if isinstance(v, RankFailure)])
        out = reduce_fn(values)
        if len(out) != n:
            raise CheckpointError(f"{step}: internal error, reduction returned {len(out)} results for {n} ranks")
        return list(out)
    except CheckpointError as exc:
        return [exc] * n
    except Exception as exc:  # a bug in planning must still fail every rank, not hang them
        err = coordinator_error(step, exc)
        return [err] * n
    finally:
        if gc_was_on:
            gc.enable()


def _unwrap(value: Any) -> Any:
    if isinstance(value, CheckpointError):
        raise value.copy()  # a copy per rank: ranks in threads of one process raise it at once
    return value


class LocalTransport(Transport):
    """One participant: reduce runs inline, exchange returns what it sent to itself."""

    def __init__(self) -> None:
        self.rank = 0
        self.world_size = 1

    def reduce_scatter(self, step, local, reduce_fn):
        return _unwrap(run_reduce(step, [local], reduce_fn)[0])

    def exchange(self, step, outgoing):
        bad = [r for r in outgoing if r != 0]
        if bad:
            raise CheckpointError(f"{step}: destination ranks {bad} do not exist in a group of 1")
        return list(outgoing.get(0, []))


class _ThreadHub:
    """Shared state of a ThreadTransport group: one rendezvous per step."""

    def __init__(self, world_size: int, timeout_s: float):
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.cond = threading.Condition()
        self.rounds: dict[tuple[int, str], dict[int, Any]] = {}
        self.results: dict[tuple[int, str], list[Any]] = {}
        self.failed: CheckpointError | None = None  # set once: every later call of the group fails

    def rendezvous(self, seq: int, step: str, rank: int, value: Any, combine: Callable[[list[Any]], list[Any]]):
        key = (seq, step)
        deadline = time.monotonic() + self.timeout_s
        with self.cond:
            if self.failed is not None:
                return self.failed
            arrived = self.rounds.setdefault(key, {})
            if rank in arrived:  # a second caller for this rank: the group's operation fails on every rank
                self.failed = CheckpointError(
                    f"{step}: rank {rank} arrived twice at call {seq}; two callers use the same rank of one "
                    "group (two unrelated operations sharing it?), so the operation fails on every rank")
                for k, got in self.rounds.items():
                    if k not in self.results:
                        self.results[k] = [self.failed] * self.world_size
                self.cond.notify_all()
                return self.failed
            arrived[rank] = value
            if len(arrived) == self.world_size:
                self.results[key] = combine([arrived[r] for r in range(self.world_size)])
                self.cond.notify_all()
            while key not in self.results:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self.world_size)) - set(arrived))
                    raise RanksTimedOutError(
                        f"{step}: ranks {missing} did not arrive within {self.timeout_s:g}s "
                        f"(rank {rank} waited); check that every rank calls with the same group, "
                        f"or raise Group(timeout_s=...)", missing_ranks=missing, timeout_s=self.timeout_s
                    )
                self.cond.wait(left)
            return self.results[key][rank]


class ThreadTransport(Transport):
    """N ranks as threads of one process. Build them together with :meth:`group`."""

    def __init__(self, hub: _ThreadHub, rank: int):
        self._hub = hub
        self._seq = 0
        self.rank = rank
        self.world_size = hub.world_size

    @classmethod
    def group(cls, world_size: int, timeout_s: float = 60.0) -> list["ThreadTransport"]:
        hub = _ThreadHub(world_size, timeout_s)
        return [cls(hub, r) for r in range(world_size)]

    def reduce_scatter(self, step, local, reduce_fn):
        self._seq += 1
        combine = lambda values: run_reduce(step, values, reduce_fn)  # noqa: E731
        return _unwrap(self._hub.rendezvous(self._seq, step, self.rank, local, combine))

    def exchange(self, step, outgoing):
        self._seq += 1
        n = self.world_size

        def route(values: list[Outgoing]) -> list[Any]:
            inbox: list[list[tuple[Any, Any]]] = [[] for _ in range(n)]
            for src, out in enumerate(values):
                for dest, items in out.items():
                    if not 0 <= dest < n:  # fail every rank, not just the one that routes
                        return [CheckpointError(f"{step}: rank {src} addressed rank {dest}, outside a group of {n}")] * n
                    inbox[dest].extend(items)
            return inbox

        return _unwrap(self._hub.rendezvous(self._seq, step, self.rank, outgoing, route))


# ----------------------------------------------------------------------------- values on the wire

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
