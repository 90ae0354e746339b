"""``raydcp diff A B [--rtol R --atol A] [--json]``: which keys and values differ between two checkpoints.

Without tolerances tensors must be bit-identical (NaNs with the same bits compare equal); with
``--rtol``/``--atol`` they are compared like ``torch.isclose(b, a, rtol, atol, equal_nan=True)``:
``|b - a| <= atol + rtol * |a|``. Each differing tensor reports its largest absolute difference.
Tensors are read a bounded group at a time from each side, with numpy (no torch), every piece's
checksum checked. Exit status 0 when A and B hold the same keys and values, 1 otherwise.
"""
from __future__ import annotations

import argparse
import math
from typing import Any

from ..errors import CheckpointError
from ._common import EXIT_FOUND, EXIT_OK, add_storage_options, print_json, progress_bar, safe, stdout, storage_options
from ._registry import Command, register

__all__ = ["COMMAND", "same_value"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", help="first checkpoint (local path or fsspec URL)")
    parser.add_argument("b", help="second checkpoint")
    parser.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0: bit-exact)")
    parser.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: bit-exact)")
    parser.add_argument("--memory-budget", metavar="SIZE", default="512MiB",
                        help="bytes of tensors loaded at a time from each checkpoint (default 512MiB)")
    parser.add_argument("--json", action="store_true", help="print the differences as JSON")
    parser.add_argument("--no-progress", action="store_true", help="do not draw a progress bar")
    add_storage_options(parser)


def same_value(a: Any, b: Any) -> bool:
    """Plain values equal, with NaN equal to NaN and types compared exactly."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return a == b


def _diff(args: argparse.Namespace, progress=None) -> dict[str, Any]:
    from ..convert.sizes import parse_size
    from ._arrays import ArraySource, compare_arrays

    if not (args.rtol >= 0 and args.atol >= 0):
        raise CheckpointError(f"--rtol and --atol must be >= 0, got {args.rtol} and {args.atol}")
    opts = storage_options(args)
    budget = parse_size(args.memory_budget)
    src_a = ArraySource(args.a, opts, budget_bytes=budget)
    src_b = ArraySource(args.b, opts, budget_bytes=budget)
    ma, mb = src_a.metadata, src_b.metadata
    keys_a, keys_b = set(ma.tensors) | set(ma.values), set(mb.tensors) | set(mb.values)
    different: dict[str, dict[str, Any]] = {}
    comparable = []
    for key in sorted(keys_a & keys_b):
        ta, tb = ma.tensors.get(key), mb.tensors.get(key)
        if ta is None and tb is None:
            if not same_value(ma.values[key], mb.values[key]):
                different[key] = {"reason": f"value {ma.values[key]!r:.60} vs {mb.values[key]!r:.60}"}
        elif ta is None or tb is None:
            different[key] = {"reason": "a tensor in one checkpoint, a plain value in the other"}
        elif (ta.dtype, ta.shape) != (tb.dtype, tb.shape):
            different[key] = {"reason": f"{ta.dtype}{list(ta.shape)} vs {tb.dtype}{list(tb.shape)}"}
        else:
            comparable.append(key)
    for (key, a), (_, b) in zip(src_a.iter_arrays(comparable, progress=progress), src_b.iter_arrays(comparable)):
        equal, max_diff = compare_arrays(a, b, ma.tensors[key].dtype, args.rtol, args.atol)
        if not equal:
            different[key] = {"reason": "values differ", "max_abs_diff": max_diff}
    same = len(keys_a & keys_b) - len(different)
    return {
        "a": args.a, "b": args.b, "rtol": args.rtol, "atol": args.atol,
        "identical": not different and keys_a == keys_b,
        "only_in_a": sorted(keys_a - keys_b), "only_in_b": sorted(keys_b - keys_a),
        "different": dict(sorted(different.items())), "same": same,
    }


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    escape = safe
    with progress_bar("diff", enabled=not (args.no_progress or args.json or args.quiet)) as progress:
        result = _diff(args, progress)
    status = EXIT_OK if result["identical"] else EXIT_FOUND
    if args.json:
        print_json({**result, "different": {k: {**v, "max_abs_diff": _json_float(v.get("max_abs_diff"))}
                                            for k, v in result["different"].items()}})
        return status
    out = stdout()
    if result["identical"]:
        out.print(escape(f"identical: {args.a} and {args.b} hold the same {result['same']} keys and values"))
        return status
    for side, label in (("only_in_a", args.a), ("only_in_b", args.b)):
        if result[side]:
            out.print(escape(f"only in {label} ({len(result[side])}): {', '.join(result[side])}"))
    if result["different"]:
        table = Table(title=f"Different ({len(result['different'])})", title_justify="left")
        table.add_column("key", overflow="fold")
        table.add_column("difference", overflow="fold")
        table.add_column("max abs diff", justify="right")
        for key, d in result["different"].items():
            m = d.get("max_abs_diff")
            table.add_row(escape(key), escape(d["reason"]), "" if m is None else f"{m:.6g}")
        out.print(table)
    out.print(escape(f"{len(result['only_in_a'])} only in A, {len(result['only_in_b'])} only in B, "
                     f"{len(result['different'])} different, {result['same']} the same"))
    return status


def _json_float(v: float | None) -> float | str | None:
    return v if v is None or math.isfinite(v) else repr(v)


COMMAND = register(Command(
    "diff", "compare two checkpoints key by key", configure, run,
    description=__doc__.split("\n\n", 1)[1] if __doc__ else "",
))
