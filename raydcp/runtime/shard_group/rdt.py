"""Ray Direct Transport (RDT) for ShardGroup reshards: the transport choice and the collective group.

With ``transport="rdt"`` a reshard's messages are the results of publish tasks called with
``.options(tensor_transport=backend)``: the tensors stay in the sending actor, and Ray sends them
(``torch.distributed`` gloo for CPU tensors, NCCL for CUDA tensors) to the actor whose receive
task takes them as arguments. Ray needs every pair of actors that exchange such tensors to be in
one collective group, created by the driver (``ray.experimental.collective``), with each actor in
at most one group per backend.

A group here holds exactly the actors of one reshard (old and new ranks), in a fixed order. It is
kept for later reshards of the same actors; a reshard of other actors first destroys every group
that shares an actor with it. Ray's gloo groups initialize ``torch.distributed``'s process-wide
default group once per process (``ray.util.collective``'s ``TorchGLOOGroup``), and a later group
of another size cannot be made in that process ("the new group's world size should be less or
equal to the world size set by init_process_group"): destroying a group here therefore also
destroys that default group in its actors (:func:`_reset_process_group`), which only ShardActors'
RDT uses.

Creating a group takes a rendezvous of all its actors (about 0.1 s on one node):
``ShardGroup.prepare_reshard(..., transport="rdt")`` starts it in the background (:func:`prepare`),
and the reshard waits for it (:meth:`Pending.wait`, bounded by the group's ``timeout_s``).
"""
from __future__ import annotations

import threading
import uuid
from typing import Sequence

import ray

from ...errors import CheckpointError

__all__ = ["TRANSPORTS", "check_transport", "backend_for", "prepare", "Pending"]

TRANSPORTS = ("object_store", "rdt")

# the collective groups made here: name -> (actor ids in rank order, backend, actor handles)
_GROUPS: dict[str, tuple[tuple[str, ...], str, list]] = {}
_LOCK = threading.Lock()


def check_transport(transport) -> str | None:
    """``transport`` if it is None or one of :data:`TRANSPORTS`, else a CheckpointError listing them."""
    if transport is not None and transport not in TRANSPORTS:
        raise CheckpointError(f"unknown reshard transport {transport!r}; choose one of {', '.join(TRANSPORTS)} "
                              f"(or None: RDT over NCCL for CUDA tensors, the object store otherwise)")
    return transport


def backend_for(devices: Sequence[str], what: str) -> str:
    """The RDT backend for actors whose tensors live on ``devices``: "nccl" (all CUDA) or "gloo" (all CPU)."""
    kinds = {d.split(":")[0] for d in devices}
    if kinds == {"cuda"}:
        return "nccl"
    if kinds <= {"cpu"}:
        return "gloo"
    raise CheckpointError(f"{what}: RDT needs the tensors of every actor on one kind of device (all CUDA for "
                          f"NCCL, all CPU for gloo), found {sorted(set(devices))}; use transport='object_store'")


def nccl_usable() -> bool:
    """Whether Ray's NCCL collective groups can be made from this process (they need cupy)."""
    try:
        from ray.util.collective import nccl_available

        return bool(nccl_available())
    except Exception:
        return False


def _ids(handles) -> tuple[str, ...]:
    return tuple(h._actor_id.hex() for h in handles)


def _reset_process_group(actor_self) -> None:
    """In an actor whose RDT group was destroyed: end torch.distributed's default group too (see module doc)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _destroy(name: str, handles: list, timeout_s: float) -> None:
    from ray.experimental.collective import destroy_collective_group

    try:
        destroy_collective_group(name)
    except (ValueError, ray.exceptions.RayError):  # already gone, or an actor of it died
        pass
    refs = []
    for h in handles:
        try:
            refs.append(h.__ray_call__.options(concurrency_group="_ray_system").remote(_reset_process_group))
        except Exception:
            pass
    for ref in refs:
        try:
            ray.get(ref, timeout=timeout_s)
        except ray.exceptions.RayError:  # a dead actor holds no group
            pass


class Pending:
    """A collective group being made in the background for the actors of one reshard."""

    def __init__(self, handles: list, backend: str, timeout_s: float):
        self.handles, self.backend, self.timeout_s = list(handles), backend, timeout_s
        self.ids = _ids(self.handles)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._make, name="raydcp-rdt-group", daemon=True)
        self._thread.start()

    def matches(self, handles, backend: str) -> bool:
        return self.ids == _ids(handles) and self.backend == backend

    def _make(self) -> None:
        from ray.experimental.collective import create_collective_group

        try:
            with _LOCK:
                for name, (ids, backend, handles) in list(_GROUPS.items()):
                    if ids == self.ids and backend == self.backend:
                        return  # made for an earlier reshard of the same actors: still good
                    if set(ids) & set(self.ids):  # an actor is in at most one group per backend
                        del _GROUPS[name]
                        _destroy(name, handles, self.timeout_s)
                name = f"raydcp-rdt-{uuid.uuid4().hex[:12]}"
                create_collective_group(self.handles, backend=self.backend, name=name)
                _GROUPS[name] = (self.ids, self.backend, self.handles)
        except BaseException as exc:  # reported by wait()
            self.error = exc

    def wait(self, what: str) -> None:
        """Return once the group is up; a CheckpointError if it could not be made within timeout_s."""
        self._thread.join(self.timeout_s)
        if self._thread.is_alive():
            raise CheckpointError(f"{what}: the RDT collective group ({self.backend}) of {len(self.handles)} actors "
                                  f"was not up within {self.timeout_s:g}s; an actor may be busy or stuck; use "
                                  f"transport='object_store' or raise timeout_s")
        if self.error is not None:
            raise CheckpointError(f"{what}: could not make the RDT collective group ({self.backend}) of "
                                  f"{len(self.handles)} actors: {type(self.error).__name__}: {self.error}; use "
                                  f"transport='object_store'") from None


def prepare(handles: list, backend: str, timeout_s: float) -> Pending:
    """Start making the collective group of ``handles`` (in this order) for ``backend``."""
    return Pending(handles, backend, timeout_s)
