"""Collective load (storage -> ranks) and transfer (live ranks -> ranks), for any N -> M."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..codec import itemsize
from ..errors import CheckpointError, RankFailure, failures_error
from ..metadata import Metadata
from ..metadata_format import decode_metadata
from ..options import DEFAULT_LOAD, LoadOptions
from ..planner import (LocalLoadPlan, RankLoadPlan, ReadItem, TensorSpec,
                       check_requests, plan_load)
from ..planner.load import untiled_sources
from ..planner.transfer import plan_transfer
from ..state import FlatState, UndoCopy, flatten_state
from ..state_modules import legacy_optimizer_renames
from ..storage import CheckpointStorage
from ..transport import Reusing, Transport
from .compressed import CompressedPieces
from .reads import ChunkReader, Deliverer, FileChunkReader, LiveChunkReader, check_shares
from .save import local_save_plan

__all__ = ["LoadStats", "Skipped", "load_with", "transfer_with", "read_metadata"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Skipped:
    """Keys a ``strict=False`` load left alone: the checkpoint's keys no rank asked for, and the
    keys of this rank's state dict the checkpoint lacks (their values stay as they were)."""

    checkpoint_only: tuple[str, ...] = ()
    state_dict_only: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.checkpoint_only or self.state_dict_only)


@dataclass(frozen=True)
class LoadStats:
    """What one rank's load did: bytes it read from the source, bytes its own tensors needed,
    and (``strict=False``) the keys it skipped."""

    bytes_read: int
    bytes_needed: int
    seconds: float
    skipped: Skipped = Skipped()


def read_metadata(checkpoint_id: str, storage_options: dict | None = None) -> Metadata:
    storage = CheckpointStorage(checkpoint_id, storage_options)
    return decode_metadata(storage.read_metadata_bytes(), f"{storage.url}/raydcp.meta")


def local_load_plan(rank: int, flat: FlatState, strict: bool) -> LocalLoadPlan:
    leaves = [flat.tensors[k] for k in sorted(flat.tensors)]
    return LocalLoadPlan(
        rank=rank,
        tensors={leaf.fqn: TensorSpec(leaf.dtype, leaf.global_shape) for leaf in leaves},
        items=tuple([ReadItem(leaf.fqn, leaf.offsets, tuple(leaf.tensor.shape)) for leaf in leaves]),
        values=tuple(sorted(flat.values)),
        strict=strict,
    )


def _stored_sources(md: Metadata):
    """key -> the stored chunks as columns (a sequence of SourceChunk), not yet checked to tile
    their tensors: the load plan checks that (``plan_load(..., tiles=md.tensors)``)."""
    return untiled_sources(md)


def _reduce_load_plan(checkpoint_id: str, storage_options: dict | None, requests: Sequence[tuple], cache=None):
    """Each rank sends (its LocalLoadPlan, its optimizers' parameter FQNs by id, whether it hands
    state back to Stateful objects, Modules or optimizers); each gets back (its RankLoadPlan, its
    Skipped, the group's Skipped: every rank's state-dict-only keys, the compressed pieces of the
    files it reads or None, whether any rank hands state back: then the load ends with a
    "load: commit" step, see :func:`load_with`; whether any rank sends pieces to another: else
    the load has no "load: exchange" step). ``cache``: the group's
    :class:`~raydcp.planner.PlanCache`, where the coordinator keeps one."""
    return _plan_loads(read_metadata(checkpoint_id, storage_options), requests, cache)


def _plan_loads(md: Metadata, requests: Sequence[tuple], cache=None) -> list:
    """:func:`_reduce_load_plan` once the metadata is read: check the requests, plan every rank's reads.

    A checkpoint holding compressed pieces is planned without joint reads: a compressed piece is
    read whole, so each is read by one rank, which forwards the parts others need. ``cache``: a
    :class:`~raydcp.planner.PlanCache` (the plan of the same requests over chunks in the same
    places is reused)."""
    local_plans = [r[0] for r in requests]
    available = {k: TensorSpec(t.dtype, t.shape) for k, t in md.tensors.items()}
    itemsizes = {k: itemsize(t.dtype) for k, t in md.tensors.items()}
    sources, values = _stored_sources(md), md.values
    renames = legacy_optimizer_renames(available, values, _param_orders(r[1] for r in requests))
    if renames:  # integer-keyed optimizer state (an older checkpoint): read under the FQN keys
        get = renames.get
        available = {get(k, k): v for k, v in available.items()}
        itemsizes = {get(k, k): v for k, v in itemsizes.items()}
        sources = {get(k, k): sources[k] for k in sources}
        values = {get(k, k): v for k, v in values.items()}
    check_requests(available, values, local_plans)
    packed = CompressedPieces.of_metadata(md)
    plans = plan_load(sources, local_plans, values, itemsizes, joint_reads=not packed, tiles=md.tensors,
                      cache=cache)
    compressed = [packed.for_plan(p) if packed else None for p in plans]
    commit = any(len(r) > 2 and r[2] for r in requests)
    exchange = any(p.incoming for p in plans)
    if all(lp.strict for lp in local_plans):
        return [(p, None, None, c, commit, exchange) for p, c in zip(plans, compressed)]
    stored = set(available) | set(values)
    wanted = [set(lp.tensors) | set(lp.values) for lp in local_plans]
    ckpt_only = tuple(sorted(stored.difference(*wanted)))
    mine = [tuple(sorted(w - stored)) for w in wanted]
    group = Skipped(ckpt_only, tuple(sorted(set().union(*mine))))
    return [(p, Skipped(ckpt_only, m), group, c, commit, exchange) for p, m, c in zip(plans, mine, compressed)]


def _param_orders(per_rank) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for orders in per_rank:
        for key, order in (orders or {}).items():
            if out.setdefault(key, order) != order:
                raise CheckpointError(f"{key}: ranks disagree on the optimizer's parameters (FQNs by id); "
                                      f"every rank must build the same model and optimizer")
    return out


def _warn_skipped(checkpoint_id: str, skipped: Skipped | None) -> None:
    if not skipped:
        return
    parts = []
    if skipped.checkpoint_only:
        parts.append(f"{len(skipped.checkpoint_only)} checkpoint key(s) not in the state dict (not loaded): "
                     + ", ".join(skipped.checkpoint_only))
    if skipped.state_dict_only:
        parts.append(f"{len(skipped.state_dict_only)} state-dict key(s) not in the checkpoint (left as they "
                     f"were): " + ", ".join(skipped.state_dict_only))
    log.warning("raydcp.load(strict=False) of %s skipped %s", checkpoint_id, "; ".join(parts))


def _execute(transport: Transport, plan: RankLoadPlan, flat: FlatState, reader: ChunkReader,
             written: list[str] | None = None, before: Callable[[], None] | None = None,
             staged: bool = False, exchange: bool = True) -> int:
    """Steps 3-5 of a load: read and deliver, exchange, finish together. Returns bytes read.
    ``before()`` runs first (a failure of it fails the step like a read's); ``written``: see
    :class:`~raydcp.engine.reads.Deliverer`. ``staged``: a two-phase load (the Deliverer's
    ``staged``, the reader's too where it has one): the tensors are written only once the
    finish step has passed, which every rank passes or none. ``exchange``: whether any rank of
    the group sends pieces to another (every rank's plan says the same); without, no exchange step."""
    rank = transport.rank
    leaves = [flat.tensors[k] for k in sorted(flat.tensors)]
    out = Deliverer(rank, leaves, written, staged=staged)
    failure: Any = None
    nread = 0
    try:
        if before is not None:
            before()
        nread = reader.read_all(plan.reads, out)
    except Exception as exc:  # still take part in the exchange, so no rank waits forever
        failure = RankFailure.from_exception(rank, exc)
    if exchange:
        incoming = transport.exchange("load: exchange", out.outgoing)
    else:
        incoming = []
        if failure is None and out.outgoing:
            failure = RankFailure.from_exception(rank, CheckpointError(
                f"rank {rank} has pieces for ranks {sorted(out.outgoing)}, but the load plan has no exchange; "
                f"this is a bug in the load plan"))
    if failure is None:
        try:
            for tag, buf in incoming:
                out.accept(tag, buf)
            if out.received != plan.incoming:
                raise CheckpointError(f"rank {rank} received {out.received} pieces, expected {plan.incoming}")
        except Exception as exc:
            failure = RankFailure.from_exception(rank, exc)
    # the last step doubles as the barrier after which senders may free their buffers; it also
    # verifies the checksum blocks that several ranks read in shares (joint reads)
    shares = getattr(reader, "shares", None) or []
    transport.reduce_scatter("load: finish", failure if failure is not None else shares, _all_done)
    if staged:
        _apply(out, rank)
    return nread


def _apply(out: Deliverer, rank: int) -> None:
    """Phase 2 of a staged load (:meth:`Deliverer.apply`): copies of verified bytes of the right
    sizes into memory the state dict has, which fail only where the memory itself does (a
    device lost); such a failure names what this rank may have written."""
    keys = sorted({key for key, _, _ in out.pending or ()})
    try:
        out.apply()
    except Exception as exc:
        err = CheckpointError(
            f"rank {rank}: copying the verified pieces into the state dict's tensors failed after every rank "
            f"had verified its own ({type(exc).__name__}: {exc}); tensors of this rank may hold a mix of "
            f"states: {', '.join(keys[:_KEYS_SHOWN])}{' ...' if len(keys) > _KEYS_SHOWN else ''}")
        err.written_keys = tuple(keys)
        raise err from exc


def _all_done(values: list) -> list:
    check_shares(share for shares in values if shares for share in shares)
    return [None] * len(values)


def _none(values: list) -> list:
    return [None] * len(values)


def _hand_back(transport: Transport, flat: FlatState, values: dict, commit: bool, step: str = "load: commit") -> None:
    """The plain values and the Statefuls' ``load_state_dict`` (once every rank's tensors are in);
    with ``commit`` (some rank hands state back) a last step, "load: commit", makes a failure
    there fail every rank, so that every rank rolls back."""
    failure: Any = None
    try:
        flat.finish_load(values)
    except Exception as exc:
        failure = RankFailure.from_exception(transport.rank, exc)
        if not commit:
            raise failures_error(step, [failure]) from None
    if commit:
        transport.reduce_scatter(step, failure, _none)


def _rolled_back(flat: FlatState | None, copies, written: list[str] | None, rank: int, exc: BaseException):
    """Roll ``flat`` back after a load raised ``exc`` (:meth:`FlatState.rollback`); returns the
    error to raise: ``exc``, or for a load that is not atomic (``written``) ``exc`` naming the
    keys whose tensors it had written."""
    if flat is not None:
        try:
            flat.rollback(copies)
        except Exception as undo_exc:
            log.error("rank %d: putting the state dict back after a failed load failed too: %s", rank, undo_exc)
            if not isinstance(exc, CheckpointError):
                return exc
            return exc.copy(f"{exc}\n(rank {rank}: putting the state dict back failed too: "
                            f"{type(undo_exc).__name__}: {undo_exc}; do not use it)")
    if written is None or not isinstance(exc, CheckpointError):
        return exc
    keys = sorted(set(written))
    if not keys:
        return exc.copy(f"{exc}\n(rank {rank}: no tensor of the state dict was written)", written_keys=())
    shown = ", ".join(keys[:_KEYS_SHOWN]) + (f" and {len(keys) - _KEYS_SHOWN} more (the error's written_keys)"
                                             if len(keys) > _KEYS_SHOWN else "")
    return exc.copy(f"{exc}\n(rank {rank}: LoadOptions(atomic=False): the load had already written "
                    f"{len(keys)} tensor(s) of the state dict, which now hold a mix of states: {shown})",
                    written_keys=tuple(keys))


_KEYS_SHOWN = 20


def load_with(transport: Transport, state_dict: dict, checkpoint_id: str, *, strict: bool = True,
              storage_options: dict | None = None, warn_skipped: bool = True,
              options: LoadOptions | None = None, fresh: bool = False) -> LoadStats:
    """The load protocol for one rank (every rank of ``transport`` calls it together).

    1. flatten the state dict into the regions this rank wants; 2. reduce_scatter
    "plan": the coordinator reads the metadata once, checks every rank's request
    (one error naming every offending key, on every rank) and assigns each needed
    source byte range to one reader; 3. read assigned chunks, fill local tensors,
    queue parts for other ranks; 4. exchange; 5. reduce_scatter "finish": every
    rank's reads verified, or every rank fails; 6. the plain values and the Statefuls'
    ``load_state_dict``; where a rank has Statefuls, reduce_scatter "commit": every rank's
    step 6 went through, or every rank fails.

    A load that raises, at any step and on any rank, leaves the state dict of every rank as
    it was (:meth:`FlatState.rollback`): with ``options.atomic`` (the default) each rank keeps
    a host copy of the tensors it fills from step 3 until it returns, and copies it back when
    the load fails (on every rank, as the failing steps are collective). Without it there is
    no copy, and the error names the keys this rank had written (``written_keys``). ``fresh``:
    the state dict is new and its caller drops it when the load fails (no copy, nothing named).

    From storage whose reads are views of memory it holds (``CheckpointStorage.memory_reads``:
    ``raymem://``) the load is in two phases: steps 3-5 read and verify every piece and
    write nothing into the tensors; each rank copies its pieces in once step 5 has passed
    (every rank's pieces verified), which cannot fail for the data's sake. A failure up to
    step 5 then leaves the tensors untouched without any copy of them; the undo copy is
    taken only where step 6 can still fail after the tensors are written (some rank hands
    state back to Stateful objects, Modules or optimizers).

    With ``strict=False`` the result names the keys skipped, and rank 0 logs them (all ranks'
    together) in one warning unless ``warn_skipped`` is False (internal partial loads).
    ``options.io`` sizes this rank's reads (:class:`~raydcp.engine.reads.FileChunkReader`).
    """
    options = DEFAULT_LOAD if options is None else options
    t0 = time.perf_counter()
    flat: FlatState | None = None
    try:
        flat = flatten_state(state_dict, for_load=True)
        local: Any = (local_load_plan(transport.rank, flat, strict), flat.param_orders or None,
                      bool(flat.finalizers))
    except Exception as exc:
        local = RankFailure.from_exception(transport.rank, exc)
    copies: list = []
    written = None if options.atomic or fresh else []
    try:
        plan, skipped, group_skipped, compressed, commit, exchange = transport.reduce_scatter(
            "load: plan", local, Reusing(_reduce_load_plan, checkpoint_id, storage_options))
        storage = CheckpointStorage(checkpoint_id, storage_options)
        staged = storage.memory_reads
        before = None
        if options.atomic and not fresh and (commit or not staged):
            def before():
                copies.append(_undo_copy(flat, _filled(flat, skipped)))
        try:
            reader = FileChunkReader(storage, options.io, compressed, staged=staged)
            nread = _execute(transport, plan, flat, reader, written, before, staged, exchange)
        finally:
            storage.close()
        _hand_back(transport, flat, dict(plan.values), commit)
    except BaseException as exc:
        raise _rolled_back(flat, copies[0] if copies else None, written, transport.rank, exc) from None
    if warn_skipped and transport.rank == 0:
        _warn_skipped(checkpoint_id, group_skipped)
    return LoadStats(nread, plan.bytes_needed, time.perf_counter() - t0, skipped or Skipped())


def _undo_copy(flat: FlatState, keys: list[str]) -> UndoCopy:
    """:meth:`FlatState.undo_copy`, a lack of memory for it as a CheckpointError saying what to do."""
    try:
        return flat.undo_copy(keys)
    except (MemoryError, RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and "memory" not in str(exc).lower():
            raise
        need = sum(flat.tensors[k].tensor.nbytes for k in keys)
        raise CheckpointError(
            f"no host memory for the load's undo copy ({need} bytes: the tensors this rank fills, kept so "
            f"that a failed load leaves them as they were): free memory, or load with "
            f"raydcp.LoadOptions(atomic=False) (a failed load then names the tensors it wrote)") from exc


def _filled(flat: FlatState, skipped: Skipped | None) -> list[str]:
    """The keys of ``flat``'s tensors a load fills: all but those the checkpoint lacks (strict=False)."""
    if not skipped or not skipped.state_dict_only:
        return list(flat.tensors)
    absent = set(skipped.state_dict_only)
    return [k for k in flat.tensors if k not in absent]


def transfer_with(transport: Transport, source_state: dict | None, dest_state: dict | None, *,
                  strict: bool = True, fresh: bool = False) -> LoadStats:
    """Move a live group's state to another layout through the transport, no storage round trip.

    Every rank of ``transport`` calls it; a rank may hold source pieces
    (``source_state``), want destination pieces (``dest_state``), or both. The
    plan is a load plan whose source chunks are the source ranks' pieces: each
    needed piece is served by one rank holding it, sliced and sent to the ranks
    that want it (through the object store with the Ray transport).

    A transfer that raises leaves ``dest_state`` as it was, as :func:`load_with` does, by a host
    copy of the tensors it fills; ``fresh``: ``dest_state`` is new and its caller drops it when
    the transfer fails (no copy). The source is only read.
    """
    t0 = time.perf_counter()
    rank = transport.rank
    flat: FlatState | None = None
    try:
        src_flat = flatten_state(source_state) if source_state is not None else None
        staged = local_save_plan(rank, src_flat, compare_replicas=False) if src_flat else None
        flat = flatten_state(dest_state, for_load=True) if dest_state is not None else FlatState({}, {}, {}, [])
        dest = local_load_plan(rank, flat, strict) if dest_state is not None else None
        local: Any = (staged.plan if staged else None, dest)
    except Exception as exc:
        local = RankFailure.from_exception(rank, exc)
    copies: list = []
    try:
        plan = transport.reduce_scatter("transfer: plan", local, plan_transfer)
        reader = LiveChunkReader(lambda key: src_flat.tensors[key].tensor)
        before = None if fresh else lambda: copies.append(_undo_copy(flat, list(flat.tensors)))
        _execute(transport, plan, flat, reader, None, before)
        _hand_back(transport, flat, dict(plan.values), False, "transfer: hand back")
    except BaseException as exc:
        raise _rolled_back(flat, copies[0] if copies else None, None, rank, exc) from None
    return LoadStats(0, plan.bytes_needed, time.perf_counter() - t0)
