"""Reshard planning (pure): which tensors go into the destination, in which layout, in which rounds.

A reshard copies a committed checkpoint SRC to DST laid out for ``world_size`` ranks, optionally
casting floating tensors (``dtype``), dropping keys (``drop_optimizer``, ``drop_prefixes``) or
consolidating every tensor into one whole piece (``consolidate``). It streams: the tensors are
cut into *rounds* whose pieces fit ``memory_budget`` bytes per process, and each round is loaded
and written before the next one starts (:mod:`raydcp.engine.rounds` commits them as one checkpoint).

Layouts (:mod:`raydcp.planner.layouts`, the same as ``raydcp.ShardGroup``'s): ``dim0`` splits dimension 0 into ``torch.chunk``
pieces (trailing ranks may hold empty pieces), ``dim1`` the same along dimension 1 (1-D tensors
along dimension 0), ``replicated`` gives every rank the whole tensor (written once); 0-D tensors
are replicated. ``consolidate`` gives each tensor, whole, to one rank (balanced by bytes).

A tensor whose pieces alone exceed the budget is cut into blocks of dimension-0 rows, each a
part of its own (with ``consolidate`` that is an error: a whole tensor must fit).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from ..codec import itemsize
from ..convert.keys import OPTIMIZER_PREFIXES, KeySelection, dtype_alias
from ..errors import CheckpointError
from ..metadata import Metadata
from ..options import SaveOptions
from ..planner import TensorSpec
from ..planner.boxes import numel
from ..planner.layouts import LAYOUTS, piece_box
from ..planner.save import ALIGN
from ..planner.tiling import require_tiling

__all__ = ["LAYOUTS", "OPTIMIZER_PREFIXES", "ReshardOptions", "Part", "Round", "ReshardPlan", "plan_reshard",
           "part_box", "dtype_alias"]

# the two ways of counting a round's memory: one process holds every rank's pieces (threads),
# or one process per rank (actors)
PER_PROCESS = ("sum", "max")


@dataclass(frozen=True, kw_only=True)
class ReshardOptions:
    """What the destination holds and how the work is cut (validated here)."""

    world_size: int
    layout: str = "dim0"
    dtype: str | None = None             # cast the model's floating tensors to it (see KeySelection)
    drop_optimizer: bool = False         # drop keys under OPTIMIZER_PREFIXES
    drop_prefixes: tuple[str, ...] = ()  # drop these keys and everything under them (dotted FQNs)
    strip_prefixes: tuple[str, ...] = ()  # remove "PREFIX." from the keys that start with it
    dtype_all: bool = False              # with dtype: the optimizer's floating tensors too (never `step`)
    consolidate: bool = False            # each tensor whole, on one rank
    memory_budget: int = 1 << 30         # bytes of tensor data one process holds at a time
    max_file_bytes: int = 256 << 20      # a rank's pieces of a round are coalesced into files up to this
    compression: str | None = None       # each piece of DST compressed with this codec (SaveOptions.compression)

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or isinstance(self.world_size, bool) or self.world_size < 1:
            raise CheckpointError(f"--world-size must be an integer >= 1, got {self.world_size!r}")
        if self.layout not in LAYOUTS:
            raise CheckpointError(f"unknown layout {self.layout!r}; choose one of {', '.join(LAYOUTS)}")
        keys = KeySelection(drop_optimizer=self.drop_optimizer, drop_prefixes=self.drop_prefixes,
                            strip_prefixes=self.strip_prefixes, dtype=self.dtype, dtype_all=self.dtype_all)
        for name in ("dtype", "drop_prefixes", "strip_prefixes"):
            object.__setattr__(self, name, getattr(keys, name))
        for knob in ("memory_budget", "max_file_bytes"):
            v = getattr(self, knob)
            if not isinstance(v, int) or isinstance(v, bool) or v < ALIGN:
                raise CheckpointError(f"{knob.replace('_', '-')} must be at least {ALIGN} bytes, got {v!r}")
        SaveOptions(compression=self.compression)  # a codec this raydcp writes, or an error naming the option

    @property
    def save_options(self) -> SaveOptions:
        """The :class:`~raydcp.options.SaveOptions` the rounds write with."""
        return SaveOptions(max_file_bytes=self.max_file_bytes, compression=self.compression)

    def identity(self) -> dict:
        """The options that decide what the destination holds (recorded in its metadata)."""
        out = asdict(self)
        out.pop("memory_budget")
        out.pop("max_file_bytes")
        out.pop("compression")  # how DST stores its pieces, not what it holds (as max_file_bytes)
        out["drop_prefixes"] = list(self.drop_prefixes)
        for knob, default in (("strip_prefixes", ()), ("dtype_all", False)):  # recorded only when used
            value = out.pop(knob)
            if value != default:
                out[knob] = list(value) if isinstance(value, tuple) else value
        if self.consolidate:
            out["layout"] = "consolidated"
        return out

    @property
    def keys(self) -> KeySelection:
        """The key filters and casts, shared with ``raydcp convert``."""
        return KeySelection(drop_optimizer=self.drop_optimizer, drop_prefixes=self.drop_prefixes,
                            strip_prefixes=self.strip_prefixes, dtype=self.dtype, dtype_all=self.dtype_all)

    def dropped(self, key: str) -> bool:
        return self.keys.dropped(key)


@dataclass(frozen=True)
class Part:
    """One unit of work: tensor ``tensor`` whole, or the block ``rows`` of its dimension-0 rows.

    ``key`` names the part inside its round (the tensor's key, or ``<key>#<n>`` for block n).
    """

    key: str
    tensor: str
    shape: tuple[int, ...]
    src_dtype: str
    dst_dtype: str
    rows: tuple[int, int] | None = None
    owner: int | None = None             # consolidate: the one rank holding it

    @property
    def box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The part's box in the tensor."""
        if self.rows is None:
            return (0,) * len(self.shape), tuple(self.shape)
        lo, hi = self.rows
        return (lo,) + (0,) * (len(self.shape) - 1), (hi - lo,) + tuple(self.shape[1:])


@dataclass(frozen=True)
class Round:
    index: int
    parts: tuple[Part, ...]
    nbytes: int          # bytes the round writes
    peak_bytes: int      # tensor bytes one process holds during the round (the budgeted quantity)


@dataclass(frozen=True)
class ReshardPlan:
    options: ReshardOptions
    per_process: str
    source_save_id: str
    source_world_size: int
    tensors: Mapping[str, TensorSpec]    # the destination's tensors
    values: Mapping[str, Any]            # the destination's plain values
    dropped: tuple[str, ...]
    rounds: tuple[Round, ...]
    placement: Mapping[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # round key -> (key, offsets)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rounds)

    def identity(self) -> dict:
        """What makes a run of this plan the same job (journal, idempotency)."""
        return {"source_save_id": self.source_save_id, "options": self.options.identity()}


def part_box(part: Part, layout: str, rank: int, world_size: int):
    """The box of the tensor that ``rank`` holds of ``part`` (absolute offsets), or None if nothing."""
    p_off, p_size = part.box
    if part.owner is not None:
        return (p_off, p_size) if rank == part.owner else None
    if numel(p_size) == 0:  # an empty tensor: one rank declares it, so the destination has the key
        return (p_off, p_size) if rank == 0 else None
    box = piece_box(part.shape, layout, rank, world_size)
    if box is None:
        return p_off, p_size
    off = tuple(max(a, b) for a, b in zip(box[0], p_off))
    end = tuple(min(a + n, b + m) for a, n, b, m in zip(box[0], box[1], p_off, p_size))
    size = tuple(max(0, e - o) for o, e in zip(off, end))
    return (off, size) if numel(size) > 0 else None


def _bytes_per_rank(part: Part, layout: str, world_size: int) -> list[int]:
    """Tensor bytes each rank holds for ``part``: the loaded piece plus its cast copy."""
    per_elem = itemsize(part.src_dtype) + (itemsize(part.dst_dtype) if part.dst_dtype != part.src_dtype else 0)
    out = []
    for r in range(world_size):
        box = part_box(part, layout, r, world_size)
        out.append(0 if box is None else numel(box[1]) * per_elem)
    return out


class _Cost:
    """A round's memory per process, as the budget counts it.

    A rank holds its pieces (and their cast copies) and, while loading, the source bytes it
    read for other ranks until the exchange. Each source byte is read by one rank, balanced:
    with one process per rank (``max``) that is about 1/M of the round's source bytes plus at
    most the largest source chunk region of the round; with every rank in one process (``sum``)
    all of them.
    """

    def __init__(self, world: int, per_process: str):
        self.world, self.per_process = world, per_process
        self.held = [0] * world
        self.read = 0        # source bytes of the round (each read once)
        self.largest = 0     # the largest region of one source chunk in the round

    def plus(self, held: list[int], read: int, largest: int) -> "_Cost":
        out = _Cost(self.world, self.per_process)
        out.held = [a + b for a, b in zip(self.held, held)]
        out.read, out.largest = self.read + read, max(self.largest, largest)
        return out

    @property
    def bytes(self) -> int:
        if self.per_process == "sum":
            return sum(self.held) + self.read
        return max(self.held) + -(-self.read // self.world) + self.largest


def _part_cost(md: Metadata, part: Part, layout: str, world: int) -> tuple[list[int], int, int]:
    """``(held per rank, source bytes, largest source chunk region)`` of ``part``."""
    isz = itemsize(part.src_dtype)
    off, size = part.box
    largest = 0
    for c in md.tensors[part.tensor].chunks:
        lo = [max(a, b) for a, b in zip(c.offsets, off)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(c.offsets, c.sizes, off, size)]
        largest = max(largest, numel([max(0, h - lo_) for lo_, h in zip(lo, hi)]) * isz)
    return _bytes_per_rank(part, layout, world), numel(size) * isz, largest


def plan_reshard(md: Metadata, options: ReshardOptions, *, per_process: str = "max") -> ReshardPlan:
    """Cut the reshard of the checkpoint described by ``md`` into rounds (pure; CheckpointError).

    ``per_process`` says how a round's memory is counted against ``options.memory_budget``
    (see :class:`_Cost`): ``"max"`` when each rank is its own process (actors), ``"sum"`` when
    one process runs every rank (threads).
    """
    if per_process not in PER_PROCESS:
        raise CheckpointError(f"per_process must be one of {PER_PROCESS}, got {per_process!r}")
    world, budget, layout = options.world_size, options.memory_budget, options.layout
    require_tiling(md.tensors, "the source checkpoint")
    select = options.keys
    names = select.names(md.keys())  # source key -> destination key, for the keys kept
    dropped = tuple(k for k in md.keys() if k not in names)
    keep = [k for k in sorted(md.tensors) if k in names]
    values = {names[k]: v for k, v in md.values.items() if k in names}

    def cast(key: str) -> str:
        return select.cast(key, md.tensors[key].dtype)

    tensors = {names[k]: TensorSpec(cast(k), tuple(md.tensors[k].shape)) for k in keep}

    def alone(part: Part) -> int:
        return _Cost(world, per_process).plus(*_part_cost(md, part, layout, world)).bytes

    rounds: list[Round] = []
    placement: dict[str, tuple[str, tuple[int, ...]]] = {}
    parts: list[Part] = []
    cost = _Cost(world, per_process)
    held: set[str] = set()

    def close() -> None:
        nonlocal parts, cost, held
        if parts:
            nbytes = sum(numel(p.box[1]) * itemsize(p.dst_dtype) for p in parts)
            rounds.append(Round(len(rounds), tuple(parts), nbytes, cost.bytes))
        parts, cost, held = [], _Cost(world, per_process), set()

    def add(part: Part) -> None:
        nonlocal cost
        if options.consolidate:  # the least loaded rank of the round holds it
            part = Part(**{**part.__dict__, "owner": min(range(world), key=lambda r: (cost.held[r], r))})
        new = cost.plus(*_part_cost(md, part, layout, world))
        if parts and (new.bytes > budget or part.tensor in held):
            close()
            if options.consolidate:
                part = Part(**{**part.__dict__, "owner": 0})
            new = cost.plus(*_part_cost(md, part, layout, world))
        parts.append(part)
        held.add(part.tensor)
        cost = new

    for key in keep:
        t = md.tensors[key]
        new = names[key]
        if new != key:  # a renamed tensor: its round key is its new name
            placement[new] = (new, (0,) * len(t.shape))
        whole = Part(new, key, tuple(t.shape), t.dtype, cast(key))
        need = alone(whole if not options.consolidate else Part(**{**whole.__dict__, "owner": 0}))
        if need <= budget or len(t.shape) == 0 or t.shape[0] <= 1:
            if need > budget and options.consolidate:
                raise _too_big(key, need, budget)
            add(whole)  # a tensor that cannot be cut goes alone, over budget
            continue
        if options.consolidate:
            raise _too_big(key, need, budget)
        # blocks of rows: a block of r rows costs at most r times what a block of one row costs
        row = alone(Part(new, key, tuple(t.shape), t.dtype, cast(key), rows=(0, 1)))
        rows = max(1, budget // max(row, 1))
        for n, lo in enumerate(range(0, t.shape[0], rows)):
            rkey = f"{new}#{n}"
            while rkey in tensors:
                rkey += "#"
            hi = min(lo + rows, t.shape[0])
            placement[rkey] = (new, (lo,) + (0,) * (len(t.shape) - 1))
            add(Part(rkey, key, tuple(t.shape), t.dtype, cast(key), rows=(lo, hi)))
    close()
    return ReshardPlan(options, per_process, md.save_id, md.world_size, tensors, values, dropped,
                       tuple(rounds), placement)


def _too_big(key: str, need: int, budget: int) -> CheckpointError:
    return CheckpointError(f"{key} needs {need} bytes of memory whole (its pieces and the bytes read for them), "
                           f"over --memory-budget {budget}: --consolidate keeps every tensor whole, so raise "
                           f"--memory-budget to at least {need}")
