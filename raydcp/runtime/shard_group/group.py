"""``raydcp.ShardGroup``: a group of actors holding a sharded state, for jobs and tools.

Protocol, as seen from the driver (each step is a collective operation of the
actors, and of the driver itself for ``full_state_dict``):

1. ``ShardGroup(M)`` reserves M bundles in a placement group (``num_gpus_per_actor``
   GPUs each; CPU actors, with a warning, on a cluster without GPU resources) and
   starts one :class:`ShardActor` per bundle. Tensors live on the actor's GPU when
   CUDA is available there, on the CPU otherwise.
2. ``load(checkpoint_id)``: the first load (or one given ``layout=``) reads the
   metadata once on the driver and has every actor allocate its pieces of each
   tensor in the layout, then load them collectively; a later load fills the
   held pieces in place (``strict`` as in ``raydcp.load``).
3. ``save(checkpoint_id)``: a collective ``raydcp.save`` of the held pieces.
4. ``reshard(M2)``: a new ShardGroup of M2 ranks receives the state from this one in
   memory, no storage round trip: the driver plans the moves from the two layouts and
   each old rank sends one message per new rank it serves, through the object store or
   by Ray Direct Transport (``raydcp.runtime.shard_group.group_reshard``; no coordinator round).
   The new group keeps this group's actors where they already hold the most of
   their new pieces (``planner.layouts.reuse_ranks``; those bytes are copied within the
   actor), so it starts actors only for the ranks it adds, and a 4 -> 6 reshard
   needs 6 GPUs, not 10. Both groups stay usable; an actor ends when the last
   group using it shuts down. ``prepare_reshard(M2)`` starts the actors a later
   ``reshard(M2)`` will add ahead of time (while training goes on).
5. ``full_state_dict()``: the driver joins a transfer as one more rank and
   receives whole tensors (CPU), keyed by flat FQN, plus the plain values.
6. ``shutdown()``: drops this group's state from its actors and ends those no
   other group uses; a placement group is freed once its last actor ended.

Every operation runs under a fresh group name, so a failed one never leaves the
next out of step, and all of them in the group's one coordinator host actor,
started in the background with the group (``RayTransport(..., host=)``) and shared with
the groups its reshards make: an operation starts no actor. The driver gathers each actor's outcome and raises one
``CheckpointError`` naming the failed, dead or stuck ranks; once an actor died
the group refuses further operations (load the last checkpoint into a new one).
"""
from __future__ import annotations

import logging
import os
import uuid
import warnings
from typing import Any, Callable

import ray

from ...engine import read_metadata, transfer_with
from ...errors import CheckpointError
from ...group import Group
from ...options import SaveOptions
from ...planner.layouts import check_layout, reuse_ranks
from ..outcomes import gather_outcomes
from ..ray_transport import RayTransport
from . import rdt
from .actor import ShardActor
from .group_reshard import check_backend, choose_transport, participants, run_reshard
from .piece_tensors import empty_state
from .members import Host, Member, start_members
from .rdt import check_transport

__all__ = ["ShardGroup"]

log = logging.getLogger(__name__)

# A placement group bundle cannot be empty: CPU actors without a CPU share get this token amount.
_TOKEN_CPU = 0.001
# How long the driver keeps waiting for the other ranks once one failed (on top of timeout_s).
_STRAGGLER_GRACE_S = 5.0


def plan_placement(cluster: dict, world_size: int, num_gpus: float, num_cpus: float):
    """The bundles for ``world_size`` actors: ``(bundles, gpus_per_actor, warning or None)``.

    Without any GPU in the cluster, actors are placed on CPUs (and the caller warns);
    with too few GPUs in total it fails at once rather than waiting forever.
    """
    note = None
    total_gpus = float(cluster.get("GPU", 0))
    if num_gpus > 0 and total_gpus == 0:
        note = (
            f"ShardGroup: the Ray cluster has no GPU resources; placing {world_size} CPU actors instead "
            f"(num_gpus_per_actor={num_gpus:g} ignored, tensors stay on CPU)"
        )
        num_gpus = 0.0
    elif num_gpus * world_size > total_gpus + 1e-9:
        fit = total_gpus / world_size
        raise CheckpointError(
            f"ShardGroup({world_size}, num_gpus_per_actor={num_gpus:g}) needs {num_gpus * world_size:g} GPUs but "
            f"the Ray cluster has {total_gpus:g}; use fewer actors or num_gpus_per_actor <= {fit:g}"
        )
    bundle = {k: v for k, v in (("GPU", num_gpus), ("CPU", num_cpus)) if v > 0} or {"CPU": _TOKEN_CPU}
    return [dict(bundle) for _ in range(world_size)], num_gpus, note


def _local_path(checkpoint_id: Any) -> str:
    """Checkpoint ids as the actors must see them: local paths made absolute (actors' cwd differs)."""
    if isinstance(checkpoint_id, os.PathLike):
        checkpoint_id = os.fspath(checkpoint_id)
    if not isinstance(checkpoint_id, str) or not checkpoint_id:
        raise CheckpointError(f"checkpoint_id must be a path or fsspec URL, got {checkpoint_id!r}")
    if "://" not in checkpoint_id:
        return os.path.abspath(checkpoint_id)
    return checkpoint_id


class ShardGroup:
    """M actors holding a sharded state dict (see the module doc for the protocol).

    Options (keyword-only, checked here): ``num_gpus_per_actor`` (fractions share a
    GPU; 0 for CPU actors), ``layout`` ("dim0", "dim1" or "replicated"; see
    ``raydcp.planner.layouts``), ``timeout_s`` (bounds every wait for peers and the
    placement), ``num_cpus_per_actor`` (CPUs reserved per actor, default none).
    """

    def __init__(self, world_size: int, *, num_gpus_per_actor: float = 1, layout: str = "dim0",
                 timeout_s: float = 600.0, num_cpus_per_actor: float = 0.0, name: str | None = None,
                 _actor_cls: type = ShardActor, _members: list | None = None, _host: Host | None = None):
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise CheckpointError(f"ShardGroup: world_size must be an int >= 1, got {world_size!r}")
        for knob, v in (("num_gpus_per_actor", num_gpus_per_actor), ("num_cpus_per_actor", num_cpus_per_actor)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise CheckpointError(f"ShardGroup: {knob} must be a number >= 0, got {v!r}")
        if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise CheckpointError(f"ShardGroup: timeout_s must be > 0, got {timeout_s!r}")
        if not (isinstance(_actor_cls, type) and issubclass(_actor_cls, ShardActor)):
            raise CheckpointError("ShardGroup: _actor_cls must be ShardActor or a subclass")
        self.world_size = world_size
        self.layout = check_layout(layout)
        self.timeout_s = float(timeout_s)
        self.name = name or f"shardgroup-{uuid.uuid4().hex[:12]}"
        self._requested_gpus = float(num_gpus_per_actor)
        self._num_cpus = float(num_cpus_per_actor)
        self._cls = _actor_cls
        self._ops = 0
        self._specs: tuple[dict, list] | None = None  # ({fqn: (shape, dtype)}, value keys) of the held state
        self._broken: str | None = None
        self._stragglers: list = []
        self._members: list[Member] = []
        self._spares: list[Member] = []  # started by prepare_reshard for a later reshard
        self._prepared: list = []  # prepare_reshard's allocations in the actors, still running
        self._rdt_pending = None  # prepare_reshard's RDT collective group, being made
        self.last_transfer: dict | None = None  # where the reshard that made this group spent its time

        if not ray.is_initialized():
            ray.init()
        self._bundles, gpus, note = plan_placement(ray.cluster_resources(), world_size, self._requested_gpus,
                                                   self._num_cpus)
        if note:
            log.warning(note)
            warnings.warn(note, RuntimeWarning, stacklevel=2)
        self.num_gpus_per_actor = gpus
        # Actors start in the background (several groups can start at once); the first
        # operation, or .info, waits for them. Members handed over (by reshard) are up already.
        given = list(_members) if _members is not None else [None] * world_size
        fresh = start_members(self._cls, given.count(None), self._bundles, num_gpus=gpus, num_cpus=self._num_cpus,
                              timeout_s=self.timeout_s, world_size=world_size)
        it = iter(fresh)
        self._members = [(m if m is not None else next(it)).join(self.name) for m in given]
        self._info_refs = {r: m.handle.info.remote() for r, m in enumerate(self._members)}
        self._info: dict | None = None
        self._host = (_host or Host(self.name, world_size)).join(self.name)  # the operations' coordinator host

    # -- public operations -------------------------------------------------------------------
    @property
    def actors(self) -> list:
        """The actor handles, by rank (for inspection: ``actor.apply.remote(fn)`` runs ``fn(state)``)."""
        return [m.handle for m in self._members]

    @property
    def info(self) -> dict[int, dict]:
        """Per rank: pid, device, CUDA_VISIBLE_DEVICES, ... (waits for the actors to be up)."""
        if self._info is None:
            self._begin("start")
            info = self._gather("start", dict(self._info_refs))
            for r, d in info.items():  # the rank in this group; the key count of this group's state
                d["rank"], d["keys"] = r, d["keys"].get(self.name, 0)
            self._info = info
        return self._info

    @property
    def devices(self) -> list[str]:
        """The device each rank's tensors live on: its GPU where CUDA is available, else "cpu"."""
        return [self.info[r]["device"] for r in range(self.world_size)]

    def load(self, checkpoint_id, *, strict: bool = True, layout: str | None = None,
             storage_options: dict | None = None) -> "ShardGroup":
        """Load a checkpoint into the actors (fresh pieces in ``layout``, or in place); returns self."""
        ckpt = _local_path(checkpoint_id)
        self._begin("load")
        fresh = None
        if layout is not None or self._specs is None:
            lay = check_layout(layout or self.layout)
            md = read_metadata(ckpt, storage_options)
            specs = {k: (tuple(t.shape), t.dtype) for k, t in md.tensors.items()}
            fresh = (specs, sorted(md.values), lay)
        spec = self._spec()
        self._gather(f"load({ckpt!r})",
                     {r: a.load.remote(self.name, spec(r), ckpt, fresh, strict, storage_options)
                      for r, a in enumerate(self.actors)})
        if fresh is not None:
            self._specs, self.layout = (fresh[0], fresh[1]), fresh[2]
        return self

    def save(self, checkpoint_id, *, storage_options: dict | None = None, options=None):
        """Save the held state as one checkpoint; returns its ``raydcp.Metadata``. ``options``: a
        :class:`raydcp.SaveOptions` (file size cap, IOOptions), the same for every actor."""
        ckpt = _local_path(checkpoint_id)
        if options is not None and not isinstance(options, SaveOptions):
            raise CheckpointError(f"options must be a raydcp.SaveOptions (or None), got {type(options).__name__}")
        if options is not None and options.survivors:  # its actors' deaths break the group: nothing survives
            raise CheckpointError("ShardGroup.save does not take SaveOptions(survivors=True): a ShardGroup whose "
                                  "actor dies is broken; save with raydcp.save(..., group=raydcp.Group(...)) from "
                                  "your own actors for a save that commits without lost ranks")
        self._begin("save", need_state=True)
        spec = self._spec()
        out = self._gather(f"save({ckpt!r})",
                           {r: a.save.remote(self.name, spec(r), ckpt, storage_options, options)
                            for r, a in enumerate(self.actors)})
        return out[0]

    def reshard(self, world_size: int, *, layout: str | None = None, num_gpus_per_actor: float | None = None,
                transport: str | None = None) -> "ShardGroup":
        """A new ShardGroup of ``world_size`` ranks holding this state, moved in memory.

        The new group keeps this group's actors where they hold the most of their new
        pieces and starts actors (or takes those ``prepare_reshard`` started) for the
        rest; this group keeps its state and stays usable. ``transport``: "object_store"
        (Ray's object store, any devices), "rdt" (Ray Direct Transport: NCCL between CUDA
        actors, gloo between CPU actors) or None (RDT over NCCL where the tensors are CUDA
        and Ray's NCCL groups are available, else the object store).
        """
        self._begin("reshard", need_state=True)
        lay = check_layout(layout or self.layout)
        transport = choose_transport(self, check_transport(transport))
        if self._prepared:  # pieces still being allocated: a receive must not start before them
            ray.wait(self._prepared, num_returns=len(self._prepared), timeout=self.timeout_s)
            self._prepared = []
        specs, keys = self._specs
        reuse = self._reuse_plan(world_size, lay, num_gpus_per_actor)
        given = [self._members[i] if i is not None else (self._spares.pop(0) if self._spares else None)
                 for i in reuse]
        try:
            new = ShardGroup(world_size, layout=lay, timeout_s=self.timeout_s,
                             num_gpus_per_actor=self._requested_gpus if num_gpus_per_actor is None else num_gpus_per_actor,
                             num_cpus_per_actor=self._num_cpus, _actor_cls=self._cls, _members=given,
                             _host=self._host)
        except BaseException:
            for m in given:  # spares taken for it end here; this group's own actors stay
                if m is not None and not m.groups:
                    m.end()
            raise
        try:
            backend, pending = None, None
            if transport == "rdt":
                what = f"ShardGroup '{self.name}' reshard({world_size})"
                backend = check_backend(self, new.devices, what)
                pending, self._rdt_pending = self._rdt_pending, None
                everyone = participants(self, new.actors)
                if pending is None or not pending.matches(everyone, backend):
                    pending = rdt.prepare(everyone, backend, self.timeout_s)
            new.last_transfer = run_reshard(self, new, reuse, specs, keys, transport, backend, pending)
        except BaseException:
            new.shutdown()
            raise
        new._specs = self._specs
        return new

    def prepare_reshard(self, world_size: int, *, layout: str | None = None,
                        transport: str | None = None) -> "ShardGroup":
        """Start now, in the background, the actors a later ``reshard(world_size, layout=...)`` adds,
        and have every actor of that reshard allocate its new pieces; returns self.

        For elastic scale-up: the new workers' actors start (imports, placement) and the
        destination memory is allocated while training goes on, and the reshard then only
        moves the pieces. With ``transport="rdt"`` (or None where ``reshard`` would pick it)
        the collective group RDT sends through is made in the background too. Unused actors end with this group; unused pieces are
        freed by the next reshard or when this group shuts down.
        """
        self._begin("prepare_reshard", need_state=True)
        lay = check_layout(layout or self.layout)
        transport = choose_transport(self, check_transport(transport))
        reuse = self._reuse_plan(world_size, lay, None)
        added = [j for j, i in enumerate(reuse) if i is None]
        more = len(added) - len(self._spares)
        if more > 0:
            bundles, gpus, _ = plan_placement(ray.cluster_resources(), more, self._requested_gpus, self._num_cpus)
            self._spares += start_members(self._cls, more, bundles, num_gpus=gpus, num_cpus=self._num_cpus,
                                          timeout_s=self.timeout_s, first_rank=self.world_size,
                                          world_size=world_size)
        specs, keys = self._specs
        self._prepared = []  # the reshard waits for these, so that each receive finds its pieces
        new_actors = []
        for j, i in enumerate(reuse):
            actor = self._members[i].handle if i is not None else self._spares[added.index(j)].handle
            new_actors.append(actor)
            self._prepared.append(actor.prepare_receive.remote(self.name, j, world_size, specs, keys, lay))
        if transport == "rdt":  # the spares' devices are not known yet: the backend follows this group's
            backend = rdt.backend_for(self.devices, f"ShardGroup '{self.name}' prepare_reshard({world_size})")
            self._rdt_pending = rdt.prepare(participants(self, new_actors), backend, self.timeout_s)
        return self

    def _reuse_plan(self, world_size: int, layout: str, num_gpus_per_actor: float | None) -> list[int | None]:
        """For each new rank, the rank of this group whose actor takes it, or None (an actor to add)."""
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise CheckpointError(f"ShardGroup: world_size must be an int >= 1, got {world_size!r}")
        if num_gpus_per_actor is not None and float(num_gpus_per_actor) != self._requested_gpus:
            for m in self._spares:  # other resources: no actor of this group, and no spare, fits
                m.end()
            self._spares = []
            return [None] * world_size
        specs, _ = self._specs
        return reuse_ranks(specs, self.layout, self.world_size, layout, world_size)

    def full_state_dict(self) -> dict:
        """Every tensor whole, on the driver's CPU, keyed by flat FQN; plain values included."""
        self._begin("full_state_dict", need_state=True)
        n = self.world_size
        spec = self._spec(n + 1)
        specs, keys = self._specs
        refs = {r: a.send.remote(self.name, spec(r)) for r, a in enumerate(self.actors)}
        dest = empty_state(specs, keys, "replicated", 0, 1, "cpu")
        mine: CheckpointError | None = None
        try:
            transport = RayTransport(Group(*spec(n)[:3], timeout_s=self.timeout_s), 0, host=self._host.name)
            try:
                transfer_with(transport, None, dest, fresh=True)  # dropped when it fails
            finally:
                transport.close()
        except CheckpointError as exc:
            mine = exc
        self._gather("full_state_dict()", refs, local={n: mine}, note=f"rank {n}: the driver")
        return dest

    def apply(self, fn: Callable, *args) -> list:
        """``fn(state, *args)`` on every rank's state of this group (inspection, tests, tools); results by rank."""
        return ray.get([self.apply_remote(r, fn, *args) for r in range(self.world_size)])

    def apply_remote(self, rank: int, fn: Callable, *args):
        """``fn(state, *args)`` on rank ``rank``'s state of this group, as an ObjectRef."""
        return self._members[rank].handle.apply_to.remote(self.name, fn, *args)

    def shutdown(self) -> None:
        """Drop this group's state from its actors, end those no other group uses (idempotent)."""
        for m in self._members:
            m.leave(self.name)
        for m in self._spares:
            m.end()
        self._members, self._spares = [], []
        self._stragglers = []
        if getattr(self, "_host", None) is not None:
            self._host.leave(self.name)
        self._broken = self._broken or "it was shut down"

    def __enter__(self) -> "ShardGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return (f"ShardGroup(name={self.name!r}, world_size={self.world_size}, layout={self.layout!r}, "
                f"num_gpus_per_actor={self.num_gpus_per_actor:g})")

    # -- helpers --------------------------------------------------------------------------------
    def _begin(self, what: str, need_state: bool = False) -> None:
        if self._broken:
            raise CheckpointError(
                f"ShardGroup '{self.name}' cannot {what}: {self._broken}; shut it down and load the last "
                f"checkpoint into a new ShardGroup"
            )
        if self._stragglers:  # ranks still inside the previous, failed operation: let them finish first
            _, pending = ray.wait(self._stragglers, num_returns=len(self._stragglers), timeout=self.timeout_s)
            if pending:
                self._broken = "some of its actors are stuck in an earlier operation"
                raise CheckpointError(f"ShardGroup '{self.name}' cannot {what}: {self._broken}")
            self._stragglers = []
        if self._info is None and what != "start":  # the first operation: every actor up first, so that
            self.info  # noqa: B018  (no rank's timeout_s is spent waiting for another's start)
        if need_state and self._specs is None:
            raise CheckpointError(f"ShardGroup '{self.name}' holds no state to {what}; call .load(checkpoint_id) first")

    def _spec(self, world_size: int | None = None) -> Callable[[int], tuple]:
        """Group specs of a fresh operation: every rank gets ``(name, rank, world_size, timeout_s, host)``."""
        name = f"{self.name}.{self._ops}"
        self._ops += 1
        w = world_size or self.world_size
        return lambda r: (name, r, w, self.timeout_s, self._host.name)

    def _gather(self, what: str, refs: dict, members: dict | None = None, *, local: dict | None = None,
                note: str = "") -> dict:
        """Wait for every rank's outcome (:func:`~raydcp.runtime.outcomes.gather_outcomes`); raise one
        CheckpointError naming failed, dead and stuck ranks. Stuck ranks become stragglers the next
        operation waits for; a dead actor breaks every group it serves.

        ``members`` maps a rank to the groups its actor serves, where that is not just this group.
        """
        members = members or {}
        out = gather_outcomes(refs, grace_s=self.timeout_s + _STRAGGLER_GRACE_S, errors=local)
        if out.ok:
            return out.results
        for ref, r in out.pending.items():
            for group in members.get(r, [self]):
                group.note_stragglers([ref])
        for r in out.dead:
            for group in members.get(r, [self]):
                group.mark_broken(f"the actors of ranks {out.dead} died during {what}")
        raise out.error(f"ShardGroup '{self.name}' {what}", note=note)

    def note_stragglers(self, refs: list) -> None:
        """Tasks of a failed operation still running on this group's actors: the next operation
        waits for them (within ``timeout_s``) before it starts."""
        self._stragglers.extend(refs)

    def mark_broken(self, reason: str) -> None:
        """An actor of this group died: every later operation fails at once with ``reason`` (the first one kept)."""
        self._broken = self._broken or reason
