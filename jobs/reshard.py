"""Reshard a raydcp checkpoint on a Ray cluster: N ranks -> M ranks, streaming, idempotent.

    ray job submit --working-dir . -- python jobs/reshard.py SRC DST --world-size M \
        [--layout dim0|dim1|replicated | --consolidate] [--dtype bf16] [--drop-optimizer] \
        [--memory-budget 4GiB] [--num-gpus-per-actor 1]

The actors of a ``raydcp.ShardGroup`` of M load SRC round by round (each round at most
``--memory-budget`` bytes per actor) and write DST; DST's metadata commits once, at the end.
A rerun after a failure resumes after the last finished round; a rerun after success does
nothing. ``--help`` lists every option; ``raydcp reshard`` runs the same engine in one process.
"""
from __future__ import annotations

import os
import sys

# run from a checkout or an uploaded working dir: use the raydcp beside this script
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "raydcp")) and _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from raydcp.runtime.shard_group.reshard_job import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
