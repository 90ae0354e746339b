"""Flattening state dicts into FQN-addressed leaves, and writing loaded values back.

Leaf kinds (README.md, "What a state dict may hold"):

- ``torch.Tensor``: a whole tensor (offsets all zero).
- ``DTensor``: its local piece; global offsets come from torch's own
  ``compute_local_shape_and_global_offset`` (local, no collectives).
- :class:`Shard`: an explicit piece of a global tensor.
- plain values (None, bool, int, float, str, bytes and containers of them).
- ``nn.Module`` and ``torch.optim.Optimizer``: as ``torch.distributed.checkpoint.state_dict``
  keeps them (model keys by FQN, optimizer state by parameter FQN; :mod:`raydcp.state_modules`).
- Stateful objects (``state_dict()``/``load_state_dict()``): expanded on save; on
  load their ``state_dict()`` is filled and handed back to ``load_state_dict()``.

Dicts flatten to dotted FQNs; lists/tuples holding tensors flatten by index; a
list without tensors is one plain value.
"""
from __future__ import annotations

import ctypes
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple

import numpy as np
import torch

from .codec import DTYPES, dtype_name, is_plain_value
from .errors import CheckpointError, user_code
from .state_modules import ModuleLeaves

__all__ = ["Shard", "TensorLeaf", "FlatState", "UndoCopy", "flatten_state"]


class Shard:
    """A piece of a global tensor, for code that shards by hand.

    ``tensor`` holds the elements at ``offsets`` (one per dimension) of a tensor of
    ``global_shape``.
    """

    __slots__ = ("tensor", "offsets", "global_shape")

    def __init__(self, tensor: torch.Tensor, offsets, global_shape):
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"Shard needs a torch.Tensor, got {type(tensor).__name__}")
        offsets, global_shape = tuple(int(o) for o in offsets), tuple(int(s) for s in global_shape)
        if not (len(offsets) == len(global_shape) == tensor.dim()):
            raise CheckpointError(
                f"Shard: offsets {offsets} and global_shape {global_shape} need one entry per "
                f"dimension of the tensor (shape {tuple(tensor.shape)})"
            )
        for d, (o, n, g) in enumerate(zip(offsets, tensor.shape, global_shape)):
            if o < 0 or o + n > g:
                raise CheckpointError(
                    f"Shard: dimension {d} covers [{o}, {o + n}) outside the global size {g}"
                )
        self.tensor, self.offsets, self.global_shape = tensor, offsets, global_shape

    def __repr__(self) -> str:
        return f"Shard(shape={tuple(self.tensor.shape)}, offsets={self.offsets}, global_shape={self.global_shape})"


class TensorLeaf(NamedTuple):
    """One rank's piece of one global tensor: ``tensor`` is the local data (may be on a device)."""

    fqn: str
    tensor: torch.Tensor
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]
    dtype: str
    replicable: bool  # a whole tensor or a replicated DTensor piece: other ranks may hold the same


class UndoCopy:
    """Host copies of tensors' contents (:meth:`FlatState.undo_copy`): host-contiguous tensors by
    memmove into buffers of up to ``PACK_BYTES`` shared by small tensors (so that a hundred
    thousand small tensors cost one allocation per ``PACK_BYTES``, not one each), a larger one
    into a buffer of its own; others (CUDA, strided views) one host tensor each. ``nbytes``: the
    host memory it holds."""

    PACK_BYTES = 16 << 20

    __slots__ = ("_bufs", "_dense", "_other", "nbytes")

    def __init__(self, tensors: Iterable[torch.Tensor]):
        dense: list[tuple[torch.Tensor, int, int, int]] = []  # (tensor, buffer, offset in it, nbytes)
        other: list[tuple[torch.Tensor, torch.Tensor]] = []
        sizes: list[int] = []  # of the buffers
        pack = self.PACK_BYTES
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "ComplexHalf support is experimental")  # torch's, for complex32
            for t in tensors:
                if t.is_cpu and t.is_contiguous():
                    n = t.nbytes
                    if not n:
                        continue
                    if not sizes or sizes[-1] + n > pack:  # a new buffer (a large tensor always gets one)
                        sizes.append(0)
                    dense.append((t, len(sizes) - 1, sizes[-1], n))
                    sizes[-1] += n
                elif t.numel():
                    other.append((t, torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t.detach())))
        self._bufs = [np.empty(n, np.uint8) for n in sizes]
        bases, memmove = [b.ctypes.data for b in self._bufs], ctypes.memmove
        for t, b, at, n in dense:
            memmove(bases[b] + at, t.data_ptr(), n)
        self._dense, self._other = dense, other
        self.nbytes = sum(sizes) + sum(saved.nbytes for _, saved in other)

    def restore(self) -> None:
        """Copy the saved contents back into the tensors."""
        bases, memmove = [b.ctypes.data for b in self._bufs], ctypes.memmove
        for t, b, at, n in self._dense:
            memmove(t.data_ptr(), bases[b] + at, n)
        with torch.no_grad():
            for t, saved in self._other:
                t.detach().copy_(saved)


@dataclass
class FlatState:
    """A state dict flattened (:func:`flatten_state`). For a load it also holds what puts the state
    back as it was when the load raises (:meth:`undo_copy`, :meth:`rollback`)."""

    tensors: dict[str, TensorLeaf]
    values: dict[str, Any]
    # load only: how to put a loaded plain value back, and Stateful objects to hand back, innermost first
    setters: dict[str, Callable[[Any], None]]
    finalizers: list[Callable[[], None]]
    # load only: optimizer key -> its parameters' FQNs by id, to read integer-keyed checkpoints
    param_orders: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # load only: what reverts the changes flattening itself made (a fresh optimizer's state, which
    # flattening initialises so that a load can fill it); run last by rollback, newest first
    reverts: list[Callable[[], None]] = field(default_factory=list)
    # load only: the plain values finish_load set, and how many finalizers it started
    _values_set: list[str] = field(default_factory=list)
    _finalizers_run: int = 0

    def finish_load(self, values: dict[str, Any]) -> None:
        for fqn, v in values.items():
            self._values_set.append(fqn)
            self.setters[fqn](v)
        for fin in self.finalizers:
            self._finalizers_run += 1  # counted before: one that raises may have applied part of the state
            with user_code("a Stateful's load_state_dict()"):
                fin()

    def undo_copy(self, keys: Iterable[str]) -> "UndoCopy":
        """A host copy of the tensors of ``keys`` as they are now, for :meth:`rollback`. A load takes
        it after planning, before it writes a byte; it costs host memory equal to those tensors'
        bytes (a CUDA tensor's copy is on the host too)."""
        tensors = self.tensors
        return UndoCopy([tensors[k].tensor for k in keys])

    def rollback(self, copies: "UndoCopy | None" = None) -> None:
        """Put the state dict back as it was before a load that raised (every step of it, in order):

        1. the tensors of ``copies`` (:meth:`undo_copy`) get their earlier contents back;
        2. the plain values :meth:`finish_load` replaced get their old values back;
        3. the finalizers it started run again, so that each Stateful object, Module and
           optimizer whose ``load_state_dict`` ran gets its own earlier state back (their state
           dicts now hold it again, by steps 1 and 2);
        4. the reverts run (a fresh optimizer is fresh again).

        Every step runs even when an earlier one raises; the first error is raised at the end."""
        first: BaseException | None = None
        if copies is not None:
            copies.restore()
        for fqn in reversed(self._values_set):
            try:
                self.setters[fqn](self.values[fqn])
            except Exception as exc:  # noqa: PERF203 -- every value gets its chance
                first = first or exc
        ran, self._values_set, self._finalizers_run = self._finalizers_run, [], 0
        for fin in self.finalizers[:ran]:
            try:
                with user_code("a Stateful's load_state_dict() (given its earlier state back)"):
                    fin()
            except Exception as exc:  # noqa: PERF203
                first = first or exc
        for revert in reversed(self.reverts):
            try:
                revert()
            except Exception as exc:  # noqa: PERF203
                first = first or exc
        if first is not None:
            raise first


_STRIDED = torch.strided
_DTYPE_NAMES = {dt: dtype_name(dt) for dt in DTYPES.values()}
_ZERO_OFFSETS = [(0,) * n for n in range(8)]
_new_leaf = tuple.__new__  # a TensorLeaf from its fields without the generated __new__
# exactly these types are plain tensors; subclasses (DTensor, a Parameter holding one) take the general path
_PLAIN_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
_MODULE_TYPES = (torch.nn.Module, torch.optim.Optimizer)


def _is_dtensor(x: Any) -> bool:
    mod = sys.modules.get("torch.distributed.tensor")  # never imported: nothing can be a DTensor
    return mod is not None and isinstance(x, mod.DTensor)


def _dtensor_leaf(fqn: str, t: Any) -> TensorLeaf | None:
    from torch.distributed.tensor import Replicate, Shard as DShard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in t.placements:
        if not (type(p) is Replicate or type(p) is DShard):
            raise CheckpointError(
                f"{fqn}: DTensor placement {p} is not supported (only Shard and Replicate); "
                f"call .redistribute() to Shard/Replicate placements before saving"
            )
    if t.device_mesh.get_coordinate() is None:
        return None  # this rank holds no piece of this tensor
    local = t.to_local()
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(local.shape) != tuple(shape):
        raise CheckpointError(f"{fqn}: DTensor local shape {tuple(local.shape)} differs from its placement's {tuple(shape)}")
    replicable = any(type(p) is Replicate for p in t.placements)
    return TensorLeaf(fqn, local, tuple(offsets), tuple(t.shape), dtype_name(local.dtype), replicable)


def _has_tensor(x: Any) -> bool:
    if isinstance(x, (torch.Tensor, Shard)) or hasattr(x, "state_dict"):
        return True
    if isinstance(x, dict):
        return any(_has_tensor(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_has_tensor(v) for v in x)
    return False


def _is_stateful(x: Any) -> bool:
    return callable(getattr(x, "state_dict", None)) and callable(getattr(x, "load_state_dict", None))


def _resolved(t: torch.Tensor, fqn: str, for_load: bool) -> torch.Tensor:
    """``t``, or for a lazily conjugated or negated view (``t.conj()`` of a complex tensor,
    ``torch._neg_view``), whose memory does not hold its values: on save a materialised copy
    (the values it shows are saved); on load a clear refusal (filling its memory in place would
    store the conjugate or negation of the checkpoint's values)."""
    if not (t.is_conj() or t.is_neg()):
        return t
    what = "a lazily conjugated view (t.conj())" if t.is_conj() else "a lazily negated view"
    if for_load:
        raise CheckpointError(
            f"{fqn}: cannot load in place into {what}: its memory holds other values than it shows; "
            "load into a plain tensor (t.resolve_conj() / t.resolve_neg()) and assign it")
    return t.resolve_conj().resolve_neg()


def flatten_state(state_dict: dict, *, for_load: bool = False) -> FlatState:
    """Flatten ``state_dict`` into tensor leaves and plain values keyed by FQN.

    With ``for_load`` the result also knows how to write loaded plain values back
    into the caller's containers and which Stateful objects to hand back.
    """
    if not isinstance(state_dict, dict):
        raise CheckpointError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    flat = FlatState({}, {}, {}, [])
    tensors, values = flat.tensors, flat.values

    def add(fqn: str) -> None:
        if fqn in tensors or fqn in values:
            raise CheckpointError(f"two entries of the state dict flatten to the same key {fqn!r}; rename one")

    def whole_tensor(x: torch.Tensor, fqn: str) -> None:
        add(fqn)
        if x.layout is not _STRIDED:
            raise CheckpointError(f"{fqn}: {x.layout} tensors are not supported; convert with .to_dense()")
        x = _resolved(x, fqn, for_load)
        shape = tuple(x.shape)
        tensors[fqn] = TensorLeaf(fqn, x, (0,) * len(shape), shape, dtype_name(x.dtype), True)

    def visit(x: Any, fqn: str, setter: Callable[[Any], None]) -> None:
        if _is_dtensor(x):
            add(fqn)
            leaf = _dtensor_leaf(fqn, x)
            if leaf is not None:
                tensors[fqn] = leaf
        elif isinstance(x, torch.Tensor):
            whole_tensor(x, fqn)
        elif isinstance(x, Shard):
            add(fqn)
            tensors[fqn] = TensorLeaf(fqn, _resolved(x.tensor, fqn, for_load), x.offsets, x.global_shape,
                                      dtype_name(x.tensor.dtype), False)
        elif isinstance(x, dict):
            prefix = f"{fqn}." if fqn else ""
            for k, v in list(x.items()):
                if not isinstance(k, (str, int)):
                    raise CheckpointError(f"{fqn or '<root>'}: dict key {k!r} of type {type(k).__name__}; keys must be str or int")
                if type(v) in _PLAIN_TENSOR_TYPES and v.layout is _STRIDED and not v.is_neg() and not v.is_conj():
                    # the common leaf, inline
                    key = f"{prefix}{k}"
                    if key in tensors or key in values:
                        add(key)
                    shape = tuple(v.shape)
                    nd = len(shape)
                    zeros = _ZERO_OFFSETS[nd] if nd < len(_ZERO_OFFSETS) else (0,) * nd
                    name = _DTYPE_NAMES.get(v.dtype) or dtype_name(v.dtype)
                    tensors[key] = _new_leaf(TensorLeaf, (key, v, zeros, shape, name, True))
                else:
                    visit(v, f"{prefix}{k}", _item_setter(x, k))
        elif isinstance(x, (list, tuple)) and _has_tensor(x):
            items = list(x)
            for i, v in enumerate(items):
                visit(v, f"{fqn}.{i}" if fqn else str(i), _seq_setter(x, items, i, setter))
        elif isinstance(x, _MODULE_TYPES):  # before Stateful: DCP's FQN-keyed state (state_modules.py)
            add(fqn)
            if isinstance(x, torch.nn.Module):
                modules.module(fqn, x, visit)
            else:
                modules.optimizer(fqn, x)
        elif _is_stateful(x):
            with user_code(f"{fqn or '<root>'}: {type(x).__name__}.state_dict()"):
                sd = x.state_dict()
            if not isinstance(sd, dict):
                raise CheckpointError(f"{fqn}: {type(x).__name__}.state_dict() returned {type(sd).__name__}, not a dict")
            visit(sd, fqn, lambda v: None)
            if for_load:
                flat.finalizers.append(lambda obj=x, sd=sd: obj.load_state_dict(sd))
        elif is_plain_value(x):
            add(fqn)
            values[fqn] = x
            flat.setters[fqn] = setter
        else:
            raise CheckpointError(
                f"{fqn}: cannot checkpoint a value of type {type(x).__module__}.{type(x).__qualname__}; "
                f"use tensors, plain values (None/bool/int/float/str/bytes and lists/dicts of them), "
                f"raydcp.Shard, DTensor or an object with state_dict()/load_state_dict()"
            )

    modules = ModuleLeaves(for_load, flat.finalizers, flat.reverts)
    try:
        visit(state_dict, "", lambda v: None)
        modules.finish(visit)
    except BaseException:
        for revert in reversed(flat.reverts):  # what flattening changed before it failed
            revert()
        raise
    flat.param_orders = modules.param_orders
    visit = whole_tensor = modules = None  # noqa: F841 -- break the closures' self-references, so tensors are freed without a GC pass
    return flat


def _item_setter(container: dict, key: Any) -> Callable[[Any], None]:
    def set_item(v: Any) -> None:
        container[key] = v
    return set_item


def _seq_setter(seq: Any, items: list, i: int, parent_setter: Callable[[Any], None]) -> Callable[[Any], None]:
    if isinstance(seq, list):
        def set_list(v: Any) -> None:
            seq[i] = v
        return set_list

    def set_tuple(v: Any) -> None:  # tuples are rebuilt and put back into their parent
        items[i] = v
        parent_setter(type(seq)(items) if type(seq) is tuple else type(seq)(*items))
    return set_tuple
