"""The end-to-end row of bench/planning.py: a save's and a load's coordinator work, through the
coordinator's own functions, at one scale.

What the coordinator runs (``raydcp.runtime.actors.CoordinatorHost`` with the reduce functions of
``raydcp.engine``), in order, each phase timed in CPU seconds of this pinned process:

  receive plans   ``raydcp.transport.decode`` of each rank's ``Wire``: (checkpoint URL, LocalSavePlan),
                  as ``engine.protocol.plan_round`` sends it             (transport, outside the total)
  plan            ``run_reduce("save: plan", ..., reduce_plan(options, destination=(path, None)))``:
                  the save begins at the path (its begin record is written), ``plan_save``, the header
  reply plans     ``encode`` of each rank's reply, as the host sends it (transport, outside the total)
  [the ranks write: each builds its ``StorageRecord`` with ``StorageRecord.written``, the function
   ``engine.save.write_rank_files`` returns it with, and sends it as a Wire; not timed]
  receive records ``decode`` of each rank's (StorageRecord, header)      (transport, outside the total)
  commit          ``engine.protocol.commit_metadata``: the chunk columns from the ranks' records
  metadata write  ``engine.protocol.commit_checkpoint``: encode ``raydcp.meta``, the compare-and-swap
                  on the commit log, the metadata written, the path pruned (``reduce_commit`` is
                  these two calls: commit_metadata, then commit_checkpoint)
  read            ``engine.load.read_metadata``: the file read and decoded
  reply commit    ``encode`` of the Metadata, once for every rank        (transport, outside the total)
  receive loads   ``decode`` of each loading rank's (LocalLoadPlan, None)  (transport, outside the total)
  load plan       ``engine.load._plan_loads``: the tiling check, the requests checked, ``plan_load``
                  (``_reduce_load_plan`` is these two calls: read_metadata, then _plan_loads)
  reply loads     ``encode`` of each loading rank's plan                 (transport, outside the total)

Beside them (outside the totals): "plan again", the plan step of a second save of the same layout
through the ``raydcp.planner.PlanCache`` the first one filled (as the coordinator keeps one per
group: every step of a training run), and "load plan again", the load plan of the same requests
from a checkpoint whose chunks lie in the same places; and, in one more pass with ``tracemalloc`` on (untimed),
the coordinator's peak memory: the most its Python and numpy allocations held at once, beyond
what the ranks' messages took before it started.

The checkpoint is a directory under the system's temporary directory (removed afterwards): the
metadata really is written, fsynced and read back. Every phase runs with the garbage collector
off, as on the coordinator: the host decodes the ranks' values and encodes the replies inside the
reduction (``runtime.coordinator_host._OnWire``), which ``raydcp.transport.run_reduce`` runs with
the collector off, like the reductions themselves.
"""
from __future__ import annotations

import gc
import shutil
import tempfile
import tracemalloc
from typing import Callable

import numpy as np

import raydcp.planner as P
from raydcp.engine.load import _plan_loads, read_metadata
from raydcp.engine.protocol import PLAN_STEP, commit_checkpoint, commit_metadata, reduce_plan
from raydcp.engine.save_records import StorageRecord
from raydcp.engine.save import _file_layouts
from raydcp.errors import CheckpointError
from raydcp.storage import METADATA_NAME, CheckpointStorage
from raydcp.transport import Reusing, decode, encode, run_reduce

PHASES = ("plan", "commit", "md_write", "read", "load_plan")
TRANSPORT = ("receive_plans", "reply_plans", "receive_records", "reply_commit", "receive_loads", "reply_loads")


def _checked(replies: list) -> list:
    for r in replies:
        if isinstance(r, BaseException):
            raise r
    return replies


def rank_record(plan: P.LocalSavePlan, files, rank: int) -> StorageRecord:
    """What rank ``rank`` returns once it wrote ``files`` (its RankWritePlan's): stand-in checksums."""
    n = len(plan.items)
    crcs = ((np.arange(n, dtype=np.int64) * 2654435761 + rank) & 0xFFFFFFFF).tolist()
    return StorageRecord.written(plan, _file_layouts(files), crcs, [()] * n)


def run_end_to_end(ranks: int, load_ranks: int, save_plans: Callable, load_plans: Callable, step: Callable,
                   log: Callable, memory: bool = False) -> dict:
    """One save and one load of ``ranks`` x tensors pieces through the coordinator's functions
    (``memory``: the pass with tracemalloc on, whose result is the peak in ``peak_bytes``)."""
    path = tempfile.mkdtemp(prefix="raydcp-bench-planning-")
    try:
        return _run(path, ranks, load_ranks, save_plans, load_plans, step, log, memory)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _run(path, ranks, load_ranks, save_plans, load_plans, step, log, memory=False) -> dict:
    storage = CheckpointStorage(path)
    gc.disable()
    local = save_plans()  # the ranks' own plans (objects, with their columns), built on the ranks
    wires = [encode((storage.url, lp, None)) for lp in local]  # (destination, plan, writer site: a local disk has none)
    lwires = [encode((lp, None)) for lp in load_plans()]
    # the ranks' objects live in the ranks' processes, not the coordinator's: out of the collector's sight
    gc.freeze()
    gc.enable()
    if memory:
        tracemalloc.start()  # what the ranks built is not traced: only the coordinator's allocations
    try:
        res = _coordinator(path, storage, ranks, load_ranks, local, wires, lwires, step, log, memory)
        if memory:
            res["peak_bytes"] = _PEAK[0]
        return res
    finally:
        gc.unfreeze()
        if memory:
            tracemalloc.stop()


_PEAK = [0]


def _coordinator(path, storage, ranks, load_ranks, local, wires, lwires, step, log, memory=False) -> dict:
    res: dict = {}
    _PEAK[0] = 0

    def timed(name: str, fn, note: str = ""):
        if memory:
            tracemalloc.reset_peak()
        s, g, out = step(fn)
        if memory:
            _PEAK[0] = max(_PEAK[0], tracemalloc.get_traced_memory()[1])
            return out
        res[name], res[name + "_gc"] = s, g
        log(f"    {name:16s} {s:7.3f} s  (gc {g:.3f} s){note}")
        return out

    values = timed("receive_plans", lambda: _without_gc(lambda: [decode(w) for w in wires]))
    del wires
    reduce_fn = Reusing(reduce_plan, P.SavePlanOptions(), destination=(path, None))
    cache = P.PlanCache()  # the group's, as the coordinator keeps it
    replies = timed("plan", lambda: _checked(run_reduce(PLAN_STEP, values, reduce_fn, cache)))
    if not memory:  # the next save of the same layout (its begin record is written too)
        again = timed("plan_again", lambda: _checked(run_reduce(PLAN_STEP, values, reduce_fn, cache)))
        if cache.hits != 1 or [tuple(rp.files.items) for rp, _ in again[:3]] != \
                [tuple(rp.files.items) for rp, _ in replies[:3]]:
            raise CheckpointError("the second plan of one layout was not the cached one")
        del again
    del values
    timed("reply_plans", lambda: _without_gc(lambda: [encode(r) for r in replies]))
    gc.disable()  # the ranks' work: write (not timed), return the records
    rwires = [encode((rank_record(local[r], rp.files, r), header)) for r, (rp, header) in enumerate(replies)]
    del local, replies
    gc.enable()
    records = timed("receive_records", lambda: _without_gc(lambda: [decode(w) for w in rwires]))
    del rwires
    md = timed("commit", lambda: _without_gc(lambda: commit_metadata(records)))
    del records
    timed("md_write", lambda: _without_gc(lambda: commit_checkpoint(storage, md)))
    res["md_bytes"] = storage.fs.size(f"{storage.path}/{METADATA_NAME}")
    timed("reply_commit", lambda: _without_gc(lambda: encode(md)))  # one Wire for every rank (the host encodes it once)
    del md
    md2 = timed("read", lambda: _without_gc(lambda: read_metadata(path)))
    requests = timed("receive_loads", lambda: _without_gc(lambda: [decode(w) for w in lwires]))
    del lwires
    lcache = P.PlanCache()  # the group's, as the coordinator keeps it
    plans = timed("load_plan", lambda: _without_gc(lambda: _plan_loads(md2, requests, lcache)))
    if not memory:  # the next load of the same requests from a checkpoint whose chunks lie in the same places
        timed("load_plan_again", lambda: _without_gc(lambda: _plan_loads(md2, requests, lcache)))
        if lcache.load_hits != 1:
            raise CheckpointError("the second load plan of one layout was not the cached one")
    timed("reply_loads", lambda: _without_gc(lambda: [encode(p) for p in plans]))
    if memory:
        return res
    chunks = len(md2.tensors.columns.nbytes)
    if chunks != ranks * len(md2.tensors):
        raise CheckpointError(f"the committed metadata holds {chunks} chunks, not {ranks * len(md2.tensors)}")
    got = [p for p, *_ in plans]  # (plan, skipped, group skipped, compressed pieces) per rank
    res["read_amplification"] = sum(p.bytes_read for p in got) / max(1, sum(p.bytes_needed for p in got))
    res["pieces"], res["ranks"], res["load_ranks"] = chunks, ranks, load_ranks
    res["total"] = sum(res[p] for p in PHASES)
    res["total_with_transport"] = res["total"] + sum(res[p] for p in TRANSPORT)
    return res


def median_of(runs: list[dict]) -> dict:
    """One point from repeats of :func:`run_end_to_end` at one scale: every timing the median of the
    repeats (each phase's own), the total of the first run and every run's total kept beside it."""
    out = dict(runs[0])
    for name, v in runs[0].items():
        if isinstance(v, float):
            out[name] = float(np.median([r[name] for r in runs]))
    out["total"] = sum(out[p] for p in PHASES)
    out["total_with_transport"] = out["total"] + sum(out[p] for p in TRANSPORT)
    out["repeats"], out["first_total"], out["totals"] = len(runs), runs[0]["total"], [r["total"] for r in runs]
    return out


def _without_gc(fn):
    """``fn()`` with the collector off, as ``raydcp.transport.run_reduce`` runs every reduction."""
    was = gc.isenabled()
    gc.disable()
    try:
        return fn()
    finally:
        if was:
            gc.enable()


def report_e2e(points: list[dict], goal_fn: Callable, table_fn: Callable, target_s: float = 1.0,
               goal_ranks: int | None = None) -> tuple[str, dict]:
    """The end-to-end table, its linearity and its goals (total under ``target_s`` at the largest scale,
    with the transport under 2 s at ``goal_ranks`` saving ranks, the largest scale if None)."""
    names = {"plan": "plan", "commit": "commit", "md_write": "metadata write", "read": "read",
             "load_plan": "load plan"}
    rows = [[f"{p['ranks']} x {p['pieces'] // p['ranks']}", p["pieces"], *(p[n] for n in PHASES), p["total"],
             p.get("first_total", p["total"]), 1e6 * p["total"] / p["pieces"], p["md_bytes"] / p["pieces"],
             *(p[n] for n in TRANSPORT), p["total_with_transport"], 1e6 * p["total_with_transport"] / p["pieces"],
             p["plan_again"], p["load_plan_again"], p["peak_bytes"] / (1 << 20) if "peak_bytes" in p else "-",
             p["peak_bytes"] / p["pieces"] if "peak_bytes" in p else "-"] for p in points]
    repeats = points[-1].get("repeats", 1)
    out = ["### End to end through the coordinator's functions, one CPU (CPU seconds; load for half as many ranks)", "",
           f"Each phase: the median of {repeats} runs of the whole sequence at each scale, in one process (as the "
           "coordinator's host runs one checkpoint after another); \"first run\": the total of the first of them, "
           "whose arrays are all fresh memory.", "",
           table_fn(["ranks x tensors", "pieces", *(names[n] for n in PHASES), "total", "first run", "us/piece",
                     "md bytes/piece", "receive plans", "reply plans", "receive records", "reply commit",
                     "receive loads", "reply loads", "total with the transport", "us/piece with the transport",
                     "plan again (cached)", "load plan again (cached)", "peak MiB", "peak bytes/piece"], rows), ""]
    base = points[0]
    lin = {n: (p[n] / p["pieces"]) / (base[n] / base["pieces"]) for p in points[-1:]
           for n in (*PHASES, "total", "total_with_transport")}
    lin_names = (*PHASES, "total", *TRANSPORT, "total_with_transport", "plan_again", "load_plan_again",
                 *(("peak_bytes",) if all("peak_bytes" in p for p in points) else ()))
    lrows = [[names.get(n, n), *((p[n] / p["pieces"]) / (base[n] / base["pieces"]) for p in points)]
             for n in lin_names]
    out += [f"Linearity: seconds per piece relative to {base['pieces']} pieces (1.0 = linear)", "",
            table_fn(["phase", *(f"{p['pieces']} pieces" for p in points)], lrows), ""]
    full = points[-1]
    worst = max(lin[n] for n in (*PHASES, "total"))
    worst_t = max(lin[n] for n in (*PHASES, "total", "total_with_transport"))
    at = next((p for p in points if p["ranks"] == goal_ranks), full)
    checks = [(f"total under {target_s:g} s on one core at {full['pieces']} pieces (median of {repeats})", full["total"],
               f"< {target_s:g} s", full["total"] < target_s),
              (f"total with the transport under 2 s at {at['pieces']} pieces ({at['ranks']} ranks)",
               at["total_with_transport"], "< 2 s", at["total_with_transport"] < 2.0),
              ("linear with the transport (worst phase, total or total with the transport)", worst_t, "<= 1.3",
               worst_t <= 1.3),
              ("a repeated save's plan costs less than the first", full["plan_again"] / full["plan"], "< 1",
               full["plan_again"] < full["plan"]),
              ("a repeated load's plan costs less than the first", full["load_plan_again"] / full["load_plan"],
               "< 1", full["load_plan_again"] < full["load_plan"]),
              ("linear (per-piece cost at the largest / the smallest scale, worst phase or total)", worst, "<= 1.3",
               worst <= 1.3),
              ("read amplification of the load plan", full["read_amplification"], "<= 1.0",
               full["read_amplification"] <= 1.0)]
    out += [table_fn(["goal", "measured", "target", "status"], [[c[0], c[1], c[2], goal_fn(c[3])] for c in checks]),
            ""]
    return "\n".join(out), {"goals": {c[0]: c[3] for c in checks}, "linearity": lin}
