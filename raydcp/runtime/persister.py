"""Background persisting for Ray groups: a persister actor beside each rank.

:class:`RayPersister` is the :class:`~raydcp.engine.background.AsyncPersister` of one rank of a
:class:`raydcp.Group` (the API layer binds it, :func:`raydcp.api.resolve_group`). Per save:

1. ``begin``: numbers the group's next operation on the rank and hands the rank's local plan
   to its persister actor, a Ray actor pinned to the same node (created on first use,
   reused, calls run in order); the actor opens the operation's Ray transport and runs the
   plan step in a :class:`~raydcp.engine.session.PersistSession`, as rank ``g.rank``;
2. ``write``, per batch: the rank copies the batch's pieces into a shared-memory arena kept
   between saves (one memcpy each into memory already mapped; device pieces with non-blocking
   copies on a side stream into the arena, pinned) -- the caller waits only for this -- and the
   actor writes the batch's files from it. When the rank (re)allocates the arena, the actor
   attaches it by name (``attach``, waited for) and the rank then removes the name from
   ``/dev/shm``: both keep it mapped, and nothing is left there when they exit, even killed.
   Where ``/dev/shm`` has no room for the arena (a container's small default), the pieces go
   into Ray's object store instead (one ``ray.put``: a copy into memory the store allocates for
   each save);
3. ``commit``: the actor runs the commit step (every rank's, together) and closes the transport.

The trainer's process never runs the writes, so they never hold its GIL. Without a staging
cap there is one batch and the caller does not wait for the plan step; with a cap
(``max_staging_bytes``, per rank) it waits for it (to know its batches) and for every batch
but the last to be written before staging the next, so no more than the cap is staged at a
time. The stall grows; the staging memory does not.
"""
from __future__ import annotations

import atexit
import os

import numpy as np
import ray
import torch
from ray import exceptions as rex
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..engine.persist import lower_priority
from ..engine.persist_worker import attach_arena
from ..engine.save import StagedState
from ..engine.session import PersistSession
from ..engine.staging import StagingArena
from ..planner.save import ALIGN
from ..errors import CheckpointError, CoordinatorLostError, RankFailure
from ..group import Group
from ..options import AsyncOptions, SaveOptions
from . import connection
from .operations import next_operation, this_caller
from .ray_transport import RayTransport

__all__ = ["RayPersister", "PersisterActor", "persister_for_this_process"]


def _tensors(pieces) -> list[torch.Tensor]:
    return [torch.from_numpy(np.asarray(p)) if p.size else torch.empty(0, dtype=torch.uint8) for p in pieces]


class _Persister:
    """Runs one rank's save sessions from pieces staged in the object store (one save at a time)."""

    def __init__(self, nice: int = 19) -> None:
        lower_priority(nice)  # persisting yields the CPU to the training processes
        self._session: PersistSession | None = None
        self._arena: tuple[str, object, torch.Tensor] | None = None  # the rank's arena: (name, its shm, bytes)

    def attach(self, name: str, size: int) -> bool:
        """Map the rank's new staging arena ``name`` (its first ``size`` bytes), in place of the
        one before, for the writes of this and later saves."""
        self._detach()
        shm, buf = attach_arena(name, size)
        self._arena = (name, shm, buf)
        return True

    def _detach(self) -> None:
        if self._arena is not None:
            shm = self._arena[1]
            self._arena = None  # its tensor first: a mapping with views alive cannot close
            try:
                shm.close()
            except BufferError:  # a write's views still alive: the mapping goes with them
                pass

    def nice(self) -> int:
        return os.nice(0)

    def ready(self) -> bool:
        import raydcp.engine.session  # noqa: F401  (the save path's imports, ahead of the first persist)

        return True

    def begin(self, name: str, rank: int, world: int, timeout_s: float, op: int, checkpoint_id: str,
              storage_options, local_plan, cap: int | None, options: SaveOptions) -> list[list[int]]:
        """Step 1 (the plan round); returns the plan items of each batch of this rank's files."""
        transport = RayTransport(Group(name, rank, world, timeout_s=timeout_s), op)
        self._session = PersistSession(transport, checkpoint_id, storage_options, local_plan, cap, options)
        try:
            return self._session.begin()
        except BaseException:
            transport.close()
            raise

    def write(self, index: int, items: list[int], pieces: list[np.ndarray] | None, arena: dict | None = None) -> bool:
        """Step 2 for batch ``index`` (the pieces of ``items``); False once this save failed. The
        pieces are ``pieces`` (from the object store), or in the rank's shared ``arena``
        (``{"name", "size", "layout": {item: (offset, nbytes)}}``), attached for this batch."""
        session = self._session
        if session.plan_error is not None:
            return False
        data: list = [None] * len(session.local_plan.items)
        if arena is None:
            for i, t in zip(items, _tensors(pieces)):
                data[i] = t
            return session.write(index, StagedState(session.local_plan, data))
        if self._arena is None or self._arena[0] != arena["name"]:
            raise CheckpointError(f"internal error: the persister has not attached the staging arena "
                                  f"{arena['name']!r} of rank {session.transport.rank}; nothing was committed")
        buf = self._arena[2]
        for i, (off, n) in arena["layout"].items():
            data[i] = buf.narrow(0, off, n)
        ok = session.write(index, StagedState(session.local_plan, data))
        del data
        return ok

    def commit(self, error: "RankFailure | str | None" = None):
        """Step 3 (every rank's, together); ``error``: the rank failed while staging."""
        session, self._session = self._session, None
        if error is not None:
            session.fail(error)
        try:
            return session.commit()
        finally:
            session.transport.close()


# attach runs in a group of its own: it must not wait behind a begin (a plan round waiting for the
# other ranks); it never meets a write (a save stages, so attaches, only once the save before it
# and its own earlier batches are written)
_PersisterRemote = ray.remote(num_cpus=0, max_restarts=0, concurrency_groups={"arena": 1})(_Persister)


class _RayFuture:
    def __init__(self, ref: ray.ObjectRef):
        self._ref = ref

    def done(self) -> bool:
        ready, _ = ray.wait([self._ref], timeout=0)
        return bool(ready)

    def result(self, timeout: float | None = None):
        try:
            return ray.get(self._ref, timeout=timeout)
        except rex.GetTimeoutError:
            raise TimeoutError from None
        except rex.RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, CheckpointError):
                raise cause.copy() from None
            raise CheckpointError(f"async save failed: {cause!r}") from None
        except rex.RayActorError as exc:
            raise CoordinatorLostError(
                f"the persister actor died before it reported the commit ({exc.__class__.__name__}): the save "
                f"either committed whole (the actor died just after) or not at all, leaving the previous "
                f"checkpoint at that path intact; raydcp.read_metadata(path) tells which: save again") from None


class PersisterActor:
    """This process's persister actor (one per process, on this node) and its device arena."""

    def __init__(self, nice: int = 19) -> None:
        # Where pieces are staged, kept between saves: the actor reads it until the batch is
        # written, and the next batch or save stages only after that (async saves are ordered).
        self.arena = StagingArena(shared=True)
        self._attached = 0  # the arena allocation the actor has mapped (StagingArena.allocations)
        atexit.register(self.arena.close)
        # without room for it in /dev/shm: device pieces through this pinned one, then ray.put
        # (which copies out before write returns, so the next batch or save may reuse it)
        self.device_arena = StagingArena()
        self.nice = nice
        node = ray.get_runtime_context().get_node_id()
        self.actor = _PersisterRemote.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
        ).remote(nice)
        self._ready = self.actor.ready.remote()  # done once the actor has started
        self._attaching: tuple[int, ray.ObjectRef] | None = None  # (allocation, the actor's attach call)

    def prepare(self, staging_bytes: int = 0, pin: bool = False) -> None:
        """Have the actor start and import the save path now, without waiting for it. With
        ``staging_bytes`` (where ``/dev/shm`` has room for them), also allocate the shared
        arena of that size now, its pages written once, and ask the actor to map it as soon as
        it runs: the first save then stages at a memcpy's speed into memory already mapped."""
        self._ready = self.actor.ready.remote()
        this_caller()  # the first save then finds this process's identity object put (a first put costs most)
        held = self.arena.buffer.numel() if self.arena.buffer is not None else 0
        if staging_bytes <= held or not _shm_room(staging_bytes):
            return
        self.arena.reserve(staging_bytes, pin)
        self._attaching = (self.arena.allocations, self.actor.attach.options(concurrency_group="arena").remote(
            self.arena.shm_name, self.arena.buffer.numel()))

    def stage(self, staged: StagedState, items: list[int], cap: int | None = None) -> tuple[ray.ObjectRef | None, dict | None]:
        """The snapshot of pieces ``items``, one copy of each: into the shared arena (``(None,
        where it is)``) where ``/dev/shm`` has room for it, else into the object store (``(its
        object, None)``; device pieces through the pinned host arena, non-blocking copies on a
        side stream, reused across saves)."""
        need = sum(-(-staged.data[i].numel() // ALIGN) * ALIGN for i in items)
        held = self.arena.buffer.numel() if self.arena.buffer is not None else 0
        room = need <= held and (cap is None or held <= cap)
        fits = room and self._attached == self.arena.allocations
        # a new arena needs the actor up to map it: until it has started (a first save without
        # raydcp.prepare_group(..., async_save=True)), the object store stages instead, without waiting
        if fits or (room or _shm_room(need)) and ray.wait([self._ready], timeout=0)[0]:
            layout = self.arena.stage(staged, items, limit=cap)
            name, size = self.arena.shm_name, self.arena.buffer.numel()
            if self._attached != self.arena.allocations:  # a new arena: the actor maps it, then its name goes
                attaching, self._attaching = self._attaching, None
                try:
                    if attaching is None or attaching[0] != self.arena.allocations:  # not asked by prepare
                        attaching = (0, self.actor.attach.options(concurrency_group="arena").remote(name, size))
                    ray.get(attaching[1])
                finally:
                    self.arena.unlink()  # mapped by the actor, or never to be: the name goes either way
                self._attached = self.arena.allocations
            return None, {"name": name, "size": size, "layout": layout}
        on_device = [i for i in items if staged.data[i].device.type != "cpu"]
        if on_device:
            self.device_arena.stage(staged, on_device, limit=cap)
        return ray.put([staged.data[i].numpy() for i in items]), None


class RayPersister:
    """The AsyncPersister of one rank of a Ray group (see the module doc)."""

    def __init__(self, group: Group, actor: PersisterActor):
        self.group, self.actor = group, actor
        self.rank, self.world_size = group.rank, group.world_size
        self._cap: int | None = None

    def begin(self, plan, checkpoint_id: str, storage_options, options: AsyncOptions,
              save_options: SaveOptions) -> _RayFuture:
        g = self.group
        self._cap = options.max_staging_bytes
        op = next_operation(g)
        return _RayFuture(self.actor.actor.begin.remote(g.name, g.rank, g.world_size, g.timeout_s, op, checkpoint_id,
                                                        storage_options, plan, self._cap, save_options))

    def write(self, index: int, staged: StagedState, items: list[int]) -> _RayFuture:
        pieces, arena = self.actor.stage(staged, items, self._cap)
        return _RayFuture(self.actor.actor.write.remote(index, items, pieces, arena))

    def commit(self, error: "RankFailure | str | None") -> _RayFuture:
        return _RayFuture(self.actor.actor.commit.remote(error))


SHM_DIR = "/dev/shm"


def _shm_room(nbytes: int) -> bool:
    """Whether ``/dev/shm`` has room for ``nbytes`` more with as much again to spare (for the
    object store and others there): a container's default of 64 MiB has not, for a model."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= 2 * nbytes


_PROCESS_PERSISTER: PersisterActor | None = None
_PROCESS_SESSION = None  # the Ray session it was started in: its actor dies with that session


def persister_for_this_process(nice: int = 19) -> PersisterActor:
    """This process's persister actor, started on first use (at CPU priority step ``nice``), and
    again after this process reconnected to Ray (:func:`raydcp.runtime.connection.session`)."""
    global _PROCESS_PERSISTER, _PROCESS_SESSION
    now = connection.session()
    if _PROCESS_PERSISTER is None or _PROCESS_SESSION != now:
        if _PROCESS_PERSISTER is not None:  # its actor went with the old session: so does its arena
            _PROCESS_PERSISTER.arena.close()
        _PROCESS_PERSISTER, _PROCESS_SESSION = PersisterActor(nice), now
    return _PROCESS_PERSISTER
