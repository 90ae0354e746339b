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
4. ``reshard(M2)``: a new ShardGroup of M2 actors receives the state from this
   one through the object store (``raydcp.engine.transfer``), no storage round trip.
5. ``full_state_dict()``: the driver joins a transfer as one more rank and
   receives whole tensors (CPU), keyed by flat FQN, plus the plain values.
6. ``shutdown()``: ends the actors and frees the placement group.

Every operation runs under a fresh group name, so a failed one never leaves the
next out of step. The driver gathers each actor's outcome and raises one
``CheckpointError`` naming the failed, dead or stuck ranks; once an actor died
the group refuses further operations (load the last checkpoint into a new one).
"""
from __future__ import annotations

import logging
import os
import time
import uuid
import warnings
from typing import Any, Callable

import ray
from ray import exceptions as rex
from ray.util.placement_group import placement_group, remove_placement_group

from ..engine import read_metadata, transfer
from ..errors import CheckpointError
from ..group import Group
from . import actors
from .actors import start_shard_actor
from .layouts import check_layout, empty_state
from .shard_actor import ShardActor

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
    ``raydcp.runtime.layouts``), ``timeout_s`` (bounds every wait for peers and the
    placement), ``num_cpus_per_actor`` (CPUs reserved per actor, default none).
    """

    def __init__(self, world_size: int, *, num_gpus_per_actor: float = 1, layout: str = "dim0",
                 timeout_s: float = 600.0, num_cpus_per_actor: float = 0.0, name: str | None = None,
                 _actor_cls: type = ShardActor):
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
        self._actors: list = []
        self._pg = None

        if not ray.is_initialized():
            ray.init()
        bundles, gpus, note = plan_placement(ray.cluster_resources(), world_size, self._requested_gpus, self._num_cpus)
        if note:
            log.warning(note)
            warnings.warn(note, RuntimeWarning, stacklevel=2)
        self.num_gpus_per_actor = gpus
        self._pg = placement_group(bundles, strategy="PACK")
        try:
            ray.get(self._pg.ready(), timeout=self.timeout_s)
        except rex.GetTimeoutError:
            self.shutdown()
            free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
            raise CheckpointError(
                f"ShardGroup: could not reserve {world_size} x {bundles[0]} within {self.timeout_s:g}s; the cluster "
                f"has {free} free; free resources or raise timeout_s"
            ) from None
        # Actors start in the background (several groups can start at once); the first
        # operation, or .info, waits for them.
        self._actors = [start_shard_actor(self._cls, r, world_size, self._pg, num_gpus=gpus, num_cpus=self._num_cpus)
                        for r in range(world_size)]
        self._info_refs = {r: a.info.remote() for r, a in enumerate(self._actors)}
        self._info: dict | None = None

    # -- public operations -------------------------------------------------------------------
    @property
    def actors(self) -> list:
        """The actor handles, by rank (for inspection: ``actor.apply.remote(fn)`` runs ``fn(state)``)."""
        return list(self._actors)

    @property
    def info(self) -> dict[int, dict]:
        """Per rank: pid, device, CUDA_VISIBLE_DEVICES, ... (waits for the actors to be up)."""
        if self._info is None:
            self._begin("start")
            self._info = self._gather("start", dict(self._info_refs))
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
                     {r: a.load.remote(spec(r), ckpt, fresh, strict, storage_options) for r, a in enumerate(self._actors)})
        if fresh is not None:
            self._specs, self.layout = (fresh[0], fresh[1]), fresh[2]
        return self

    def save(self, checkpoint_id, *, storage_options: dict | None = None):
        """Save the held state as one checkpoint; returns its ``raydcp.Metadata``."""
        ckpt = _local_path(checkpoint_id)
        self._begin("save", need_state=True)
        spec = self._spec()
        out = self._gather(f"save({ckpt!r})",
                           {r: a.save.remote(spec(r), ckpt, storage_options) for r, a in enumerate(self._actors)})
        return out[0]

    def reshard(self, world_size: int, *, layout: str | None = None,
                num_gpus_per_actor: float | None = None) -> "ShardGroup":
        """A new ShardGroup of ``world_size`` actors holding this state (through the object store)."""
        self._begin("reshard", need_state=True)
        new = ShardGroup(world_size, layout=layout or self.layout, timeout_s=self.timeout_s,
                         num_gpus_per_actor=self._requested_gpus if num_gpus_per_actor is None else num_gpus_per_actor,
                         num_cpus_per_actor=self._num_cpus, _actor_cls=self._cls)
        try:
            n = self.world_size
            spec = self._spec(n + world_size)
            specs, keys = self._specs
            refs = {r: a.send.remote(spec(r)) for r, a in enumerate(self._actors)}
            refs.update({n + j: a.receive.remote(spec(n + j), specs, keys, new.layout)
                         for j, a in enumerate(new._actors)})
            self._gather(f"reshard({world_size})", refs, members={n + j: (new, j) for j in range(world_size)},
                         note=f"ranks 0-{n - 1}: this group, {n}-{n + world_size - 1}: the new one")
        except BaseException:
            new.shutdown()
            raise
        new._specs = self._specs
        return new

    def full_state_dict(self) -> dict:
        """Every tensor whole, on the driver's CPU, keyed by flat FQN; plain values included."""
        self._begin("full_state_dict", need_state=True)
        n = self.world_size
        spec = self._spec(n + 1)
        specs, keys = self._specs
        refs = {r: a.send.remote(spec(r)) for r, a in enumerate(self._actors)}
        dest = empty_state(specs, keys, "replicated", 0, 1, "cpu")
        mine: CheckpointError | None = None
        try:
            transfer(None, dest, group=Group(*spec(n)[:3], timeout_s=self.timeout_s))
        except CheckpointError as exc:
            mine = exc
        self._gather("full_state_dict()", refs, local={n: mine}, note=f"rank {n}: the driver")
        return dest

    def shutdown(self) -> None:
        """End the actors and free their placement group (idempotent)."""
        for a in self._actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        self._actors = []
        self._stragglers = []
        if self._pg is not None:
            try:
                remove_placement_group(self._pg)
            except Exception:
                pass
            self._pg = None
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
        if need_state and self._specs is None:
            raise CheckpointError(f"ShardGroup '{self.name}' holds no state to {what}; call .load(checkpoint_id) first")

    def _spec(self, world_size: int | None = None) -> Callable[[int], tuple]:
        """Group specs of a fresh operation: every rank gets ``(name, rank, world_size, timeout_s)``."""
        name = f"{self.name}.{self._ops}"
        self._ops += 1
        self._op_group = name
        w = world_size or self.world_size
        return lambda r: (name, r, w, self.timeout_s)

    def _gather(self, what: str, refs: dict, members: dict | None = None, *, local: dict | None = None,
                note: str = "") -> dict:
        """Wait for every rank's outcome; raise one CheckpointError naming failed, dead and stuck ranks.

        ``members`` maps a rank to ``(group, rank)`` where it is not this group's actor of the same rank.
        """
        try:
            return self._await(what, refs, members, local=local, note=note)
        finally:  # each operation has its own group name: its coordinator host is done with
            if getattr(self, "_op_group", None):
                actors.end_group(self._op_group)
                self._op_group = None

    def _await(self, what: str, refs: dict, members: dict | None, *, local: dict | None, note: str) -> dict:
        members = members or {}
        results: dict[int, Any] = {}
        errors: dict[int, CheckpointError] = {r: e for r, e in (local or {}).items() if e is not None}
        dead: list[int] = []
        pending = {ref: r for r, ref in refs.items()}
        deadline = time.monotonic() + self.timeout_s + _STRAGGLER_GRACE_S if errors else None
        while pending:
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait_s)
            if not ready:
                break
            for ref in ready:
                r = pending.pop(ref)
                try:
                    value = ray.get(ref)
                except rex.RayActorError:
                    dead.append(r)
                    continue
                except rex.RayError as exc:  # a bug, not a CheckpointError: still name the rank
                    value = CheckpointError(f"unexpected {type(exc).__name__} on rank {r}: {exc}")
                if isinstance(value, CheckpointError):
                    errors[r] = value
                else:
                    results[r] = value
            if (errors or dead) and deadline is None:
                deadline = time.monotonic() + self.timeout_s + _STRAGGLER_GRACE_S
        stuck = sorted(pending.values())
        if not (errors or dead or stuck):
            return results
        self._stragglers.extend(ref for ref, r in pending.items() if r not in members)
        for r in dead:
            group, _ = members.get(r, (self, r))
            group._broken = group._broken or f"the actors of ranks {sorted(dead)} died during {what}"
        raise _combined_error(self.name, what, errors, sorted(dead), stuck, note)


def _combined_error(name: str, what: str, errors: dict, dead: list, stuck: list, note: str) -> CheckpointError:
    by_message: dict[str, list[int]] = {}
    failures: dict[int, str] = {}
    for r in sorted(errors):
        by_message.setdefault(str(errors[r]), []).append(r)
        failures.update(errors[r].failures)
    parts = [f"on ranks {ranks}: {msg}" for msg, ranks in by_message.items()]
    if dead:
        parts.append(f"the actors of ranks {dead} died")
        failures.update({r: "its actor died" for r in dead})
    if stuck:
        parts.append(f"ranks {stuck} did not finish")
        failures.update({r: failures.get(r, "did not finish") for r in stuck})
    where = f" ({note})" if note else ""
    if len(parts) == 1:
        return CheckpointError(f"ShardGroup '{name}' {what} failed {parts[0]}{where}", failures)
    body = "\n".join(f"  {p}" for p in parts)
    return CheckpointError(f"ShardGroup '{name}' {what} failed{where}:\n{body}", failures)

