"""Pure planning: no Ray, no I/O. See :mod:`raydcp.planner.types` for the protocol."""
from .boxes import byte_runs, intersect, merge_runs, numel
from .load import check_requests, plan_load
from .save import SavePlanOptions, plan_save
from .types import *  # noqa: F401,F403
from .types import __all__ as _types_all

__all__ = ["plan_save", "plan_load", "check_requests", "SavePlanOptions",
           "byte_runs", "intersect", "merge_runs", "numel", *_types_all]
