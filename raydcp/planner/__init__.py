"""Pure planning: no Ray, no I/O. See :mod:`raydcp.planner.types` for the protocol."""
from .boxes import byte_runs, intersect, merge_runs, numel
from .load import check_requests, plan_load, stored_sources
from .reuse import PlanCache
from .save import SavePlanOptions, plan_save
from .commit_tables import chunk_tables
from .tiling import piece_problems, require_tiling, tiling_problems, untiled
from .transfer import plan_transfer
from .types import *  # noqa: F401,F403
from .types import __all__ as _types_all

__all__ = ["plan_save", "plan_load", "check_requests", "stored_sources", "chunk_tables", "SavePlanOptions", "plan_transfer", "PlanCache",
           "tiling_problems", "require_tiling", "untiled", "piece_problems",
           "byte_runs", "intersect", "merge_runs", "numel", *_types_all]
