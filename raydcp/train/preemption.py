"""Emergency checkpoints when Ray Train announces a preemption.

Ray 2.60's ``ray.train.get_preemption_info()`` returns a ``PreemptionInfo``
(``deadline_ms``: the earliest reclaim time in UNIX milliseconds, or None;
``preempted_node_to_ranks``) once a node of the worker group is being drained,
else None. It is a collective: every worker calls it the same number of times
and all get rank 0's answer, so they all decide to save together.

The emergency save is a *survivors* save (``raydcp.SaveOptions(survivors=True)``): the
preempted workers may be reclaimed before or while it runs, and it commits without them where
the others hold every piece of the state (replicated state: DDP, HSDP's replicate groups).
It makes no Ray Train collective (which would wait for the preempted workers too): every
rank names the checkpoint directory from the preemption event itself. The notice's ranks are
planned around from the start (``SaveOptions.leaving``): where the others hold replicas of what
they hold they write nothing, and the commit waits only for the writers, so their death at any
moment changes nothing; their node gone, they are left out at once even if they never called. With ``memory=True``
it commits to the cluster's memory first (the fastest tier), then to the run's storage.

Ray Train registers a checkpoint only once every worker reported it; where the preempted
workers died first it never does. raydcp's commit is durable by then, and
:func:`raydcp.train.restore` resumes from the newest committed checkpoint of the run,
registered or not (:mod:`raydcp.train.latest`). After a preemption the run restarts
(``FailureConfig.max_preemption_failures``) from there.
"""
from __future__ import annotations

import hashlib
import logging
import time
from typing import Any, Callable

from ..errors import StateNotCoveredError
from .checkpoint import _as_state_dict, _train_states, save

__all__ = ["save_on_preemption"]

logger = logging.getLogger(__name__)

# Preemption events this process already saved for: (deadline_ms, preempted node ids).
_handled: set[tuple] = set()


def save_on_preemption(state_dict: Any, metrics: dict | None = None, *,
                       get_info: Callable[[], Any] | None = None, **save_kwargs) -> bool:
    """Save an emergency checkpoint if a preemption was announced; True if one was saved.

    Call it on every worker at the same point of every step (a collective).
    ``get_info`` replaces ``ray.train.get_preemption_info`` (tests and custom
    signals: any callable returning None or an object with ``deadline_ms`` and
    ``preempted_node_to_ranks``; it must give every rank the same answer). One
    checkpoint is saved per preemption event, and the call returns once Ray Train
    has registered it (``wait_registered``; where preempted workers died first, Ray
    Train's report never completes on the survivors, but the checkpoint has committed
    before it, and the restarted run resumes from it). The reported metrics carry
    ``raydcp.emergency`` = {deadline_ms, preempted_ranks, seconds_left,
    committed_before_deadline_s, lost_ranks} where ``seconds_left`` is the time to the
    deadline when the save started and ``committed_before_deadline_s`` when it committed
    (negative: past it, also logged as a warning); with ``memory=True`` also
    ``memory_committed_before_deadline_s`` (the memory tier commits first) and the
    checkpoint is persisted whatever its step (``persist=True``).
    """
    if get_info is None:
        import ray.train

        get_info = ray.train.get_preemption_info
    info = get_info()
    if info is None:
        return False
    nodes = tuple(sorted(getattr(info, "preempted_node_to_ranks", {}) or {}))
    event = (info.deadline_ms, nodes)
    if event in _handled:
        return False
    _handled.add(event)
    by_node = {str(node): sorted(rs) for node, rs in (getattr(info, "preempted_node_to_ranks", {}) or {}).items()}
    ranks = sorted({r for rs in by_node.values() for r in rs})
    left = None if info.deadline_ms is None else info.deadline_ms / 1000.0 - time.time()
    save_kwargs.setdefault("wait_registered", True)  # registered before anything else can go wrong
    save_kwargs.setdefault("persist", True)  # with memory=True too: in storage before the node goes
    nonce = hashlib.sha256(repr(event).encode()).hexdigest()[:8]  # the same on every rank, no collective
    emergency = {"deadline_ms": info.deadline_ms, "preempted_ranks": ranks, "seconds_left": left, "nonce": nonce,
                 "leaving": by_node}  # planned around: they write nothing the others hold, the commit does not wait
    try:
        save(state_dict, metrics, _emergency=emergency, **save_kwargs)
    except StateNotCoveredError as exc:
        # Only the lost ranks' rows of a TrainState's RNG tables were not covered: they are per rank and
        # no survivor can hold them. Save without the RNG; the resumed run re-derives every rank's.
        states = _rng_only(state_dict, exc.keys)
        if not states:
            raise
        logger.warning("raydcp: the emergency checkpoint leaves the RNG state out: ranks %s were lost and "
                       "held their own rows; the resumed run re-derives every rank's RNG", list(exc.lost_ranks))
        for ts in states:
            ts.save_rng = False
        try:
            save(state_dict, metrics, _emergency={**emergency, "rng": "left out"}, **save_kwargs)
        finally:
            for ts in states:
                ts.save_rng = True
    if info.deadline_ms is not None and time.time() * 1000.0 > info.deadline_ms:
        logger.warning("raydcp: the emergency checkpoint finished %.1fs after the preemption deadline",
                       time.time() - info.deadline_ms / 1000.0)
    return True


def _rng_only(state_dict: Any, keys) -> list:
    """The TrainStates of ``state_dict`` whose RNG tables hold every key of ``keys`` (empty where some
    key is something else: that state cannot be left out)."""
    try:
        found = list(_train_states(_as_state_dict(state_dict)))
    except Exception:
        return []
    owners = []
    for key in keys:
        owner = next((ts for prefix, ts in found if key.startswith(f"{prefix}rng.")), None)
        if owner is None:
            return []
        if owner not in owners:
            owners.append(owner)
    return owners
