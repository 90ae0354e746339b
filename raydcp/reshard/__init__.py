"""Streaming reshard of a committed checkpoint: N -> M ranks, new layout, dtype, fewer keys.

The engine shared by ``raydcp reshard`` (ranks as threads of one process) and
``jobs/reshard.py`` (ranks as the actors of a ``raydcp.ShardGroup``, see
``raydcp.runtime.reshard_job``): :mod:`.plan` cuts the work into rounds that fit a memory
budget, :mod:`.rank` is what every rank does in a round, :mod:`.driver` checks the
destination, runs the rounds and commits once (resuming a failed run, doing nothing when
the destination already holds the result).
"""
from .driver import EXTRA_KEY, ReshardResult, RoundExecutor, ThreadExecutor, reshard, reshard_with
from .plan import LAYOUTS, ReshardOptions, ReshardPlan, plan_reshard
from .rank import RoundTask, run_round

__all__ = ["ReshardOptions", "ReshardPlan", "ReshardResult", "RoundExecutor", "ThreadExecutor", "RoundTask",
           "plan_reshard", "reshard", "reshard_with", "run_round", "LAYOUTS", "EXTRA_KEY"]
