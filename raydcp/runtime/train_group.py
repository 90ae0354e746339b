"""The raydcp Group of a Ray Train worker group: what ``group=None`` means inside a training function.

Both the public calls (:mod:`raydcp.api`, for ``raydcp.save``/``load`` without ``group=``) and the
Ray Train integration (:mod:`raydcp.train`) use it, so it lives here, below both. One Group is made
per worker group (each attempt of a run gets a new one) and reused by every save and restore of
that worker group: its operations are numbered in call order, which all ranks share since every
call is a collective.
"""
from __future__ import annotations

import uuid

from ..group import Group

__all__ = ["train_context", "new_nonce", "worker_group", "proposed_group_name", "group_named"]

# One Group per worker group (this process's rank in it), per timeout: (run, rank, world, timeout) -> Group
_GROUPS: dict[tuple, Group] = {}


def train_context():
    """The Ray Train context of this worker, or None outside a Ray Train training function."""
    try:
        import ray.train

        return ray.train.get_context()
    except (RuntimeError, ImportError):
        return None


def new_nonce() -> str:
    return uuid.uuid4().hex[:8]


def _group_key(ctx, timeout_s: float) -> tuple:
    return (ctx.get_experiment_name(), ctx.get_world_rank(), ctx.get_world_size(), float(timeout_s))


def _derived_group_name(ctx) -> str | None:
    """The name every rank of this worker group derives alone, or None: the run's name and the
    worker group's placement group, which Ray Train creates anew for every attempt."""
    import ray

    pg = ray.get_runtime_context().get_placement_group_id()
    return f"raydcp-train:{ctx.get_experiment_name()}:{pg}" if pg else None


def proposed_group_name(ctx, timeout_s: float) -> str:
    """Rank 0: the name of this worker group's Group (a new one on first use)."""
    group = _GROUPS.get(_group_key(ctx, timeout_s))
    if group is not None:
        return group.name
    return _derived_group_name(ctx) or f"raydcp-train:{ctx.get_experiment_name()}:{new_nonce()}"


def group_named(ctx, name: str, timeout_s: float) -> Group:
    """This rank's Group of the worker group, named ``name`` (the one rank 0 proposed)."""
    key = _group_key(ctx, timeout_s)
    group = _GROUPS.get(key)
    if group is None or group.name != name:
        group = _GROUPS[key] = Group(name, ctx.get_world_rank(), ctx.get_world_size(), timeout_s=timeout_s)
    return group


def worker_group(timeout_s: float = 600.0) -> Group | None:
    """This worker's raydcp Group in its Ray Train worker group, or None outside a training function.

    What ``raydcp.save``/``load``/``async_save`` use without ``group=`` inside a Ray Train worker:
    the same Group as ``raydcp.train.save``/``restore`` (the same name on every rank, a new one on
    every attempt of the run). Every rank calls it at the same point, as the operation it is for is
    a collective; where no placement group names the worker group, rank 0 broadcasts a name.
    """
    ctx = train_context()
    if ctx is None:
        return None
    group = _GROUPS.get(_group_key(ctx, timeout_s))
    if group is not None:
        return group
    name = _derived_group_name(ctx)
    if name is None:
        from ray.train.collective import broadcast_from_rank_zero

        name = broadcast_from_rank_zero(proposed_group_name(ctx, timeout_s) if ctx.get_world_rank() == 0 else None)
    return group_named(ctx, name, timeout_s)
