"""Streaming reshard of a committed checkpoint: N -> M ranks, new layout, dtype, fewer keys.

The engine shared by ``raydcp reshard`` (ranks as threads of one process) and
``jobs/reshard.py`` (ranks as the actors of a ``raydcp.ShardGroup``; the job's executor is
:mod:`raydcp.runtime.shard_group.reshard_job`, in the runtime since it runs on Ray):
:mod:`.plan` cuts the work into rounds that fit a memory budget, :mod:`.rank` is what every
rank does in a round, :mod:`.driver` checks the destination, runs the rounds and commits once
(resuming a failed run, doing nothing when the destination already holds the result).
"""
from __future__ import annotations

from ..lazy import lazy_attribute

__all__ = ["ReshardOptions", "ReshardPlan", "ReshardResult", "RoundExecutor", "ThreadExecutor", "RoundTask",
           "plan_reshard", "reshard", "reshard_with", "run_round", "LAYOUTS", "EXTRA_KEY"]

# loaded on first use, so that `raydcp --help` (which builds reshard's options from .args) imports no torch
_LAZY = {"EXTRA_KEY": ".driver", "ReshardResult": ".driver", "RoundExecutor": ".driver", "ThreadExecutor": ".driver",
         "reshard": ".driver", "reshard_with": ".driver", "LAYOUTS": ".args", "ReshardOptions": ".plan",
         "ReshardPlan": ".plan", "plan_reshard": ".plan", "RoundTask": ".rank", "run_round": ".rank"}


def __getattr__(name: str):
    return lazy_attribute(__name__, _LAZY, name)
