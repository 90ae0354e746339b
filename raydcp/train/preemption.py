"""Emergency checkpoints when Ray Train announces a preemption.

Ray 2.60's ``ray.train.get_preemption_info()`` returns a ``PreemptionInfo``
(``deadline_ms``: the earliest reclaim time in UNIX milliseconds, or None;
``preempted_node_to_ranks``) once a node of the worker group is being drained,
else None. It is a collective: every worker calls it the same number of times
and all get rank 0's answer, so they all decide to save together.

After a preemption the run restarts (``FailureConfig.max_preemption_failures``)
and :func:`raydcp.train.restore` picks the emergency checkpoint up like any other.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from .checkpoint import save

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
    has registered it (``wait_registered``). The reported metrics carry
    ``raydcp.emergency`` = {deadline_ms, preempted_ranks, seconds_left} where
    ``seconds_left`` is the time to the deadline when the save started;
    a save that ends past the deadline is logged as a warning. With ``memory=True``
    the emergency checkpoint is persisted whatever its step (``persist=True``).
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
    ranks = sorted({r for rs in (getattr(info, "preempted_node_to_ranks", {}) or {}).values() for r in rs})
    left = None if info.deadline_ms is None else info.deadline_ms / 1000.0 - time.time()
    save_kwargs.setdefault("wait_registered", True)  # registered before anything else can go wrong
    save_kwargs.setdefault("persist", True)  # with memory=True too: in storage before the node goes
    save(state_dict, metrics, _emergency={"deadline_ms": info.deadline_ms, "preempted_ranks": ranks,
                                          "seconds_left": left}, **save_kwargs)
    if info.deadline_ms is not None and time.time() * 1000.0 > info.deadline_ms:
        logger.warning("raydcp: the emergency checkpoint finished %.1fs after the preemption deadline",
                       time.time() - info.deadline_ms / 1000.0)
    return True
