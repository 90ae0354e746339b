"""Planning at scale, in one process: raydcp's coordinator work against torch DCP's, same layout.

Layout (full scale): 1024 saving ranks x 1000 tensors, every tensor row-sharded over all ranks
(1,024,000 pieces); then 512 ranks load the same tensors row-sharded (each loading piece overlaps
two saved pieces). Tensor t has global shape (ranks * (1 + t % 4), 128 * (1 + t % 3)).

raydcp, timed step by step (the coordinator's whole job for one save and one load):
  plan_save      raydcp.planner.plan_save(local_plans): validate, dedup, balance, pack files
  build md       the Metadata the plan implies: raydcp.planner.chunk_tables(plan, local plans, the
                 ranks' checksums as arrays) -> one ChunkTable (columns) per tensor
  encode         raydcp.metadata_format.encode_metadata(md)          -> bytes per piece
  decode         raydcp.metadata_format.decode_metadata(bytes)
  load plan      sources from the metadata + check_requests + raydcp.planner.plan_load (512 ranks)
torch DCP, on equivalent SavePlans (WriteItems with ChunkStorageMetadata):
  plan_save      DefaultSavePlanner().create_global_plan(plans): dedup + create_default_global_save_plan
                 + validation (also create_default_global_save_plan alone)
  encode/decode  pickle.dumps / pickle.loads of its Metadata with storage_data (what .metadata holds)
  load plan      create_read_items_for_chunk_list per tensor: DCP plans loads on every rank, so the
                 per-rank time is measured on a sample of ranks and multiplied by the ranks for the
                 total (the CPU spent, in parallel across ranks, not on one coordinator)

Local plans are built before the clock starts: a rank builds its own plan (each LocalSavePlan /
LocalLoadPlan carries its items as arrays, ItemColumns, computed on its rank) and sends it as a
raydcp.transport.Wire (its columns, no per-piece objects). The coordinator receives the plans as
the runtime's coordinator host does, with raydcp.transport.decode: plans whose items are built
from the columns only on first use, which the planners' array paths never do. That receive step
is timed too, outside the total ("receive"). Like the coordinator's actor, the process turns
numpy's huge-page advice off first and keeps the memory a plan frees for the next one
(raydcp.runtime.coordinator.planning_pages). The end-to-end sequence runs --e2e-repeats times at
each scale, one checkpoint after another as the coordinator's host runs them: each phase is the
median of the runs, and the first run's total (all of its arrays fresh memory) is shown beside it.

The process is pinned to one CPU (--cpus to change) and times are its CPU seconds: what a step
costs on one idle core (wall time on a shared machine adds whatever else ran there). Linearity: the same steps at 1/4, 1/2 and
full scale, scaling the number of ranks (pieces per tensor grow with it). A step predicted to take
more than --budget-s is timed on a subset of the tensors and scaled up (marked "est."): every
tensor has the same number of pieces, so the work is the same per tensor.

End to end (the second table, bench/_planning_e2e.py): one save and one load through the
coordinator's own functions, as the coordinator runs them for a real save -- plan
(engine.protocol.reduce_plan), commit (commit_metadata: the chunk columns from the storage records
the ranks return), metadata write (commit_checkpoint: encode, commit log, write, prune; into a
temporary directory), read (engine.load.read_metadata) and load plan (engine.load._plan_loads) --
with the transport's decoding of what the ranks send and encoding of the replies beside them.

    python bench/planning.py               # full scale, ~3-5 minutes
    python bench/planning.py --scale 0.125 # quick
    python bench/planning.py --end-to-end-only --no-dcp  # the end-to-end table only
    # many ranks, few tensors each (~5 min):
    python bench/planning.py --ranks 10240 --tensors 100 --load-ranks 8192 --end-to-end-only --no-dcp --rank-points 1024,4096,10240,16384
"""
from __future__ import annotations

import argparse
import gc
import os
import pickle
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _planning_e2e import median_of, report_e2e, run_end_to_end  # noqa: E402
from _util import GC, RESULTS, argv_line, goal, loadavg, log, machine, save_json, table  # noqa: E402

import raydcp.planner as P  # noqa: E402
from raydcp.codec import itemsize  # noqa: E402
from raydcp.engine.load import _stored_sources  # noqa: E402  (what the load coordinator runs)
from raydcp.metadata import Metadata, TensorMeta  # noqa: E402
from raydcp.metadata_format import decode_metadata, encode_metadata  # noqa: E402
from raydcp.runtime.coordinator import planning_pages  # noqa: E402  (what the coordinator's actor runs at start)
from raydcp.transport import decode, encode  # noqa: E402  (how local plans travel to the coordinator)

DTYPES = ("float32", "bfloat16")




WALL: dict[int, float] = {}
SYS: dict[int, float] = {}


def step(fn):
    """Run ``fn`` once: (CPU seconds, CPU seconds of it in the garbage collector, result).

    CPU time of this single-threaded, pinned process is what the step costs on one idle core;
    wall time on a shared machine adds whatever else ran on that core (kept in WALL, last step).
    """
    g0 = GC.cpu
    s0 = resource.getrusage(resource.RUSAGE_SELF).ru_stime
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    WALL[0] = time.perf_counter() - t0
    SYS[0] = resource.getrusage(resource.RUSAGE_SELF).ru_stime - s0
    return time.process_time() - c0, GC.cpu - g0, out


# ----------------------------------------------------------------------------- layout

def key(t: int) -> str:
    return f"model.layers.{t // 10}.w{t % 10}.weight"


def shape(t: int, ranks: int) -> tuple[int, int]:
    return ranks * (1 + t % 4), 128 * (1 + t % 3)


def dtype(t: int) -> str:
    return DTYPES[t % 5 == 4]


def rows(t: int, world: int, ranks: int, r: int) -> tuple[int, int]:
    """Row range [start, end) of tensor t held by rank r of a ``world``-rank row sharding."""
    n = shape(t, ranks)[0]
    per = n // world
    return r * per, (r + 1) * per


def raydcp_local_plans(ranks: int, tensors: int) -> list[P.LocalSavePlan]:
    plans = []
    for r in range(ranks):
        specs, items = {}, []
        for t in range(tensors):
            k = key(t)
            g = shape(t, ranks)
            specs[k] = P.TensorSpec(dtype(t), (g[0], g[1]))
            a, b = rows(t, ranks, ranks, r)
            items.append(P.WriteItem(k, (a, 0), (b - a, g[1]), (b - a) * g[1] * itemsize(dtype(t))))
        plans.append(P.LocalSavePlan(r, specs, tuple(items), {}))
    return plans


def raydcp_load_plans(load_ranks: int, ranks: int, tensors: int) -> list[P.LocalLoadPlan]:
    plans = []
    for r in range(load_ranks):
        specs, items = {}, []
        for t in range(tensors):
            k = key(t)
            g = shape(t, ranks)
            specs[k] = P.TensorSpec(dtype(t), (g[0], g[1]))
            a, b = rows(t, load_ranks, ranks, r)
            items.append(P.ReadItem(k, (a, 0), (b - a, g[1])))
        plans.append(P.LocalLoadPlan(r, specs, tuple(items), ()))
    return plans


def sent(plans: list) -> list:
    """The plans as each rank sends them to the coordinator (raydcp.transport.Wire)."""
    return [encode(p) for p in plans]


def received(wires: list) -> list:
    """The plans as the coordinator receives them (what its host runs on each rank's value)."""
    return [decode(w) for w in wires]


def rank_checksums(gp: P.GlobalSavePlan) -> list:
    """Stand-ins for the CRC32C each rank returns for its slots (in the order of its files)."""
    import numpy as np

    out = []
    for rp in gp.ranks:
        n = len(rp.files.items) if isinstance(rp.files, P.FileTable) else sum(len(s) for _, s in rp.files)
        out.append((np.arange(n, dtype=np.int64) * 2654435761 + rp.rank) & 0xFFFFFFFF)
    return out


def metadata_from_plan(gp: P.GlobalSavePlan, local_plans, checksums) -> Metadata:
    """The metadata a commit of ``gp`` records, as columns (raydcp.planner.chunk_tables)."""
    tables = P.chunk_tables(gp, local_plans, checksums)
    tensors = {k: TensorMeta(s.dtype, s.shape, tables[k]) for k, s in gp.tensors.items()}
    return Metadata(save_id=gp.save_id, world_size=gp.world_size, created_at=time.time(),
                    tensors=tensors, values=dict(gp.values))


def raydcp_load_plan(md: Metadata, load_plans):
    sources = _stored_sources(md)
    available = {k: P.TensorSpec(t.dtype, t.shape) for k, t in md.tensors.items()}
    P.check_requests(available, md.values, load_plans)
    itemsizes = {k: itemsize(t.dtype) for k, t in md.tensors.items()}
    return P.plan_load(sources, load_plans, md.values, itemsizes)


def run_raydcp(ranks: int, load_ranks: int, tensors: int, budget_s: float) -> dict:
    pieces = ranks * tensors
    gc.disable()
    wires = sent(raydcp_local_plans(ranks, tensors))
    gc.enable()
    res: dict = {"ranks": ranks, "load_ranks": load_ranks, "tensors": tensors, "pieces": pieces}
    s, g, lps = step(lambda: received(wires))
    res["receive_save"], res["receive_save_gc"] = s, g
    log(f"    raydcp receive the local save plans (not in the total) {s:7.3f} s  (gc {g:.3f} s)")
    s, g, gp = step(lambda: P.plan_save(lps, P.SavePlanOptions(save_id="bench")))
    res["plan_save"], res["plan_save_gc"], res["plan_save_wall"], res["plan_save_sys"] = s, g, WALL[0], SYS[0]
    log(f"    raydcp plan_save   {s:7.3f} s  (gc {g:.3f} s)")
    crcs = rank_checksums(gp)
    s, g, md = step(lambda: metadata_from_plan(gp, lps, crcs))
    res["build_md"], res["build_md_gc"], res["build_md_sys"] = s, g, SYS[0]
    log(f"    raydcp build md    {s:7.3f} s  (gc {g:.3f} s)")
    del gp, lps, wires
    s, g, blob = step(lambda: encode_metadata(md))
    res["encode"], res["encode_gc"], res["md_bytes"], res["encode_sys"] = s, g, len(blob), SYS[0]
    log(f"    raydcp encode      {s:7.3f} s  (gc {g:.3f} s)  {len(blob) / pieces:.1f} bytes/piece")
    s, g, md2 = step(lambda: decode_metadata(blob))
    res["decode"], res["decode_gc"], res["decode_sys"] = s, g, SYS[0]
    log(f"    raydcp decode      {s:7.3f} s  (gc {g:.3f} s)")
    assert sum(len(t.chunks) for t in md2.tensors.values()) == pieces
    del md2
    # the load plan: time it on a few tensors first; run it whole only if that fits the budget
    probe_t = min(tensors, 12)
    sub = _sub_metadata(md, probe_t)
    lp_sub = received(sent(raydcp_load_plans(load_ranks, ranks, probe_t)))
    s_probe, _, _ = step(lambda: raydcp_load_plan(sub, lp_sub))
    predicted = s_probe * tensors / probe_t
    n_t = tensors if predicted <= budget_s else max(probe_t, int(tensors * budget_s / predicted) // 12 * 12)
    if n_t < tensors:
        md = _sub_metadata(md, n_t)
    gc.disable()
    lwires = sent(raydcp_load_plans(load_ranks, ranks, n_t))
    gc.enable()
    s, g, llps = step(lambda: received(lwires))
    del lwires
    res["receive_load"], res["receive_load_gc"] = s * tensors / n_t, g * tensors / n_t
    log(f"    raydcp receive the local load plans (not in the total) {res['receive_load']:7.3f} s  (gc {g:.3f} s)")
    s, g, plans = step(lambda: raydcp_load_plan(md, llps))
    scale_up = tensors / n_t
    res["load_plan"], res["load_plan_gc"], res["load_plan_est"] = s * scale_up, g * scale_up, n_t < tensors
    res["load_plan_sys"] = SYS[0] * scale_up
    res["load_plan_tensors"] = n_t
    reads = sum(len(p.reads) for p in plans)
    res["read_amplification"] = sum(p.bytes_read for p in plans) / max(1, sum(p.bytes_needed for p in plans))
    log(f"    raydcp load plan   {res['load_plan']:7.3f} s  (gc {res['load_plan_gc']:.3f} s)"
        + (f"  est. from {n_t} of {tensors} tensors ({s:.2f} s measured)" if n_t < tensors else "")
        + f"  {reads} chunk reads, read/needed {res['read_amplification']:.3f}")
    res["total"] = res["plan_save"] + res["build_md"] + res["encode"] + res["decode"] + res["load_plan"]
    return res


def profile_raydcp(ranks: int, load_ranks: int, tensors: int, load_tensors: int, top: int = 25) -> None:
    """One more pass of raydcp's steps under cProfile (the load plan on ``load_tensors`` tensors)."""
    import cProfile
    import pstats

    gc.disable()
    lps = received(sent(raydcp_local_plans(ranks, tensors)))
    llps = received(sent(raydcp_load_plans(load_ranks, ranks, load_tensors)))
    gc.enable()
    md: list[Metadata] = []
    for name, fn in (("plan_save + build md + encode + decode", lambda: md.append(_save_steps(lps))),
                     (f"load plan ({load_tensors} of {tensors} tensors)", lambda: raydcp_load_plan(sub, llps))):
        if md:
            sub = _sub_metadata(md[0], load_tensors)
        prof = cProfile.Profile()
        g0 = GC.total
        prof.enable()
        fn()
        prof.disable()
        path = RESULTS / f"planning-{name.split()[0]}.prof"
        RESULTS.mkdir(parents=True, exist_ok=True)
        prof.dump_stats(path)
        print(f"\n--- cProfile of raydcp {name} at {ranks} ranks ({GC.total - g0:.2f} s in the garbage collector); {path}")
        pstats.Stats(prof).strip_dirs().sort_stats("tottime").print_stats(top)


def _save_steps(lps) -> Metadata:
    gp = P.plan_save(lps, P.SavePlanOptions(save_id="bench"))
    md = metadata_from_plan(gp, lps, rank_checksums(gp))
    return decode_metadata(encode_metadata(md))


def _sub_metadata(md: Metadata, n: int) -> Metadata:
    """The metadata of tensors 0..n-1 only."""
    keys = [key(t) for t in range(n)]
    return Metadata(md.save_id, md.world_size, md.created_at, {k: md.tensors[k] for k in keys}, md.values)


# ----------------------------------------------------------------------------- torch DCP

def dcp_plans(ranks: int, tensors: int):
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    plans = []
    for r in range(ranks):
        items = []
        for t in range(tensors):
            k = key(t)
            g = shape(t, ranks)
            a, b = rows(t, ranks, ranks, r)
            offsets, sizes = torch.Size((a, 0)), torch.Size((b - a, g[1]))
            items.append(WriteItem(
                index=MetadataIndex(k, offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                            properties=TensorProperties(dtype=dt[dtype(t)]), size=torch.Size(g))))
        plans.append(SavePlan(items))
    return plans


def run_dcp(ranks: int, load_ranks: int, tensors: int, sample_ranks: int) -> dict:
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_global_save_plan
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    pieces = ranks * tensors
    res: dict = {"ranks": ranks, "tensors": tensors, "pieces": pieces}
    gc.disable()
    plans = dcp_plans(ranks, tensors)
    gc.enable()
    s, g, _ = step(lambda: create_default_global_save_plan(plans))
    res["global_plan_only"] = s
    planner = DefaultSavePlanner(flatten_state_dict=False)  # our plans carry no flattening mappings
    s, g, (gplans, md) = step(lambda: planner.create_global_plan(plans))
    res["plan_save"], res["plan_save_gc"] = s, g
    log(f"    DCP create_global_plan {s:7.3f} s  (gc {g:.3f} s); create_default_global_save_plan alone "
        f"{res['global_plan_only']:.3f} s")
    # what FileSystemWriter.finish records: one _StorageInfo per piece, then pickles the Metadata

    def storage_data():
        storage = {}
        for r, p in enumerate(gplans):
            pos = 0
            for it in p.items:
                n = it.tensor_storage_size()
                storage[it.index] = _StorageInfo(f"__{r}_0.distcp", pos, n)
                pos += n
        return storage

    s, g, md.storage_data = step(storage_data)
    res["storage_md"] = s
    del plans, gplans
    s, g, blob = step(lambda: pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL))
    res["encode"], res["md_bytes"] = s, len(blob)
    s, g, md2 = step(lambda: pickle.loads(blob))
    res["decode"] = s
    log(f"    DCP pickle.dumps   {res['encode']:7.3f} s, loads {s:.3f} s, {len(blob) / pieces:.1f} bytes/piece")
    del md2
    # load planning: every DCP rank plans its own reads against the whole metadata
    sample = sorted({int(i * load_ranks / sample_ranks) for i in range(sample_ranks)})

    def plan_ranks():
        for r in sample:
            for t in range(tensors):
                k = key(t)
                g_ = shape(t, ranks)
                a, b = rows(t, load_ranks, ranks, r)
                chunk = ChunkStorageMetadata(offsets=torch.Size((a, 0)), sizes=torch.Size((b - a, g_[1])))
                create_read_items_for_chunk_list(k, md.state_dict_metadata[k], [chunk])

    s, g, _ = step(plan_ranks)
    res["load_plan_per_rank"] = s / len(sample)
    res["load_plan"] = res["load_plan_per_rank"] * load_ranks
    log(f"    DCP load plan      {res['load_plan_per_rank']:7.3f} s per rank (sample of {len(sample)}), "
        f"{res['load_plan']:.2f} s over {load_ranks} ranks")
    res["total"] = res["plan_save"] + res["storage_md"] + res["encode"] + res["decode"] + res["load_plan"]
    return res


# ----------------------------------------------------------------------------- report

def report(points: list[dict], dcp: dict | None) -> tuple[str, dict]:
    full = points[-1]
    peer = next((p for p in points if dcp and p["ranks"] == dcp["ranks"]), full)
    rows = []
    for p in points:
        est = " est." if p["load_plan_est"] else ""
        rows.append([f"{p['ranks']} x {p['tensors']}", p["pieces"], p["plan_save"], p["build_md"], p["encode"],
                     p["decode"], f"{p['load_plan']:.2f}{est}", p["total"], p["md_bytes"] / p["pieces"],
                     1e6 * p["total"] / p["pieces"], p["receive_save"], p["receive_load"]])
    out = ["### raydcp coordinator, one CPU (CPU seconds; load plan for half as many ranks)", "",
           table(["ranks x tensors", "pieces", "plan_save", "build md", "encode", "decode", "load plan", "total",
                  "md bytes/piece", "us/piece", "receive save plans (not in total)",
                  "receive load plans (not in total)"], rows), ""]
    gcrow = [[f"{p['ranks']} x {p['tensors']}", p["plan_save_gc"], p["build_md_gc"], p["encode_gc"], p["decode_gc"],
              p["load_plan_gc"], p["receive_save_gc"], p["receive_load_gc"]] for p in points]
    out += ["Of which in the garbage collector (s):", "",
            table(["ranks x tensors", "plan_save", "build md", "encode", "decode", "load plan", "receive save plans",
                   "receive load plans"], gcrow), ""]
    steps = ("plan_save", "build_md", "encode", "decode", "load_plan")
    sysrow = [[f"{p['ranks']} x {p['tensors']}", *(p[n + "_sys"] for n in steps), sum(p[n + "_sys"] for n in steps)]
              for p in points]
    out += ["Of which in the kernel (system CPU time: mostly page faults on fresh memory) (s):", "",
            table(["ranks x tensors", "plan_save", "build md", "encode", "decode", "load plan", "total"], sysrow), ""]
    # linearity: cost per piece at each scale relative to the smallest
    base = points[0]
    lin = {}
    lrows = []
    for name in ("plan_save", "build_md", "encode", "decode", "load_plan", "total", "receive_save", "receive_load"):
        per = [p[name] / p["pieces"] for p in points]
        lin[name] = per[-1] / per[0]
        lrows.append([name, *(x / per[0] for x in per)])
    for name in ("plan_save", "decode", "load_plan"):  # the collector's share grows with the live objects
        per = [(p[name] - p[name + "_gc"]) / p["pieces"] for p in points]
        lrows.append([f"{name}, outside the gc", *(x / per[0] for x in per)])
    steps = ("plan_save", "build_md", "encode", "decode", "load_plan")
    per = [(p["total"] - sum(p[n + "_sys"] for n in steps)) / p["pieces"] for p in points]
    lrows.append(["total, user CPU only (no kernel time)", *(x / per[0] for x in per)])
    per = [(p["total"] - sum(p[n + "_sys"] + p[n + "_gc"] for n in steps)) / p["pieces"] for p in points]
    lrows.append(["total, user CPU outside the gc", *(x / per[0] for x in per)])
    out += [f"Linearity: seconds per piece relative to {base['ranks']} ranks (1.0 = linear; work that grows with"
            f" the square of the ranks reads {points[-1]['ranks'] / base['ranks']:.1f} in the last column)", "",
            table(["step", *(f"{p['ranks']} ranks" for p in points)], lrows), ""]
    ratios = {}
    if dcp:
        drows = [
            ["save plan + metadata (DCP: create_global_plan + storage_data)", dcp["plan_save"] + dcp["storage_md"],
             peer["plan_save"] + peer["build_md"],
             (dcp["plan_save"] + dcp["storage_md"]) / (peer["plan_save"] + peer["build_md"])],
            ["metadata encode", dcp["encode"], peer["encode"], dcp["encode"] / peer["encode"]],
            ["metadata decode", dcp["decode"], peer["decode"], dcp["decode"] / peer["decode"]],
            [f"load plan (DCP: {peer['load_ranks']} ranks x {dcp['load_plan_per_rank']:.3f} s)", dcp["load_plan"],
             peer["load_plan"], dcp["load_plan"] / peer["load_plan"]],
            ["total", dcp["total"], peer["total"], dcp["total"] / peer["total"]],
            ["metadata bytes/piece", dcp["md_bytes"] / dcp["pieces"], peer["md_bytes"] / peer["pieces"],
             dcp["md_bytes"] / peer["md_bytes"]],
        ]
        ratios = {r[0]: r[3] for r in drows}
        out += [f"### torch DCP against raydcp at {peer['ranks']} x {peer['tensors']} ({peer['pieces']} pieces)", "",
                table(["step", "DCP CPU s", "raydcp CPU s", "DCP / raydcp"], drows), ""]
    worst_lin = max(lin[n] for n in ("plan_save", "build_md", "encode", "decode", "load_plan", "total"))
    checks = [
        ("total under 2 s on one core", full["total"], "< 2 s", full["total"] < 2.0),
        ("metadata under 100 bytes per piece", full["md_bytes"] / full["pieces"], "< 100", full["md_bytes"] / full["pieces"] < 100),
        ("linear (per-piece cost at full / at 1/4 scale, worst step or total)", worst_lin, "<= 1.3", worst_lin <= 1.3),
    ]
    out += [table(["goal", "measured", "target", "status"], [[c[0], c[1], c[2], goal(c[3])] for c in checks]), ""]
    return "\n".join(out), {"goals": {c[0]: c[3] for c in checks}, "linearity": lin, "dcp_ratios": ratios}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the 1024 saving / 512 loading ranks")
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--load-ranks", type=int, default=512)
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--budget-s", type=float, default=20.0,
                    help="a load plan predicted to take longer is timed on a subset of tensors and scaled up")
    ap.add_argument("--dcp-sample-ranks", type=int, default=8)
    ap.add_argument("--dcp-at", type=float, default=0.25, choices=[0.25, 0.5, 1.0],
                    help="which of the three scales torch DCP runs at (its metadata pickling alone takes minutes "
                         "at full scale on 2 cores); the comparison is with raydcp at the same scale")
    ap.add_argument("--no-dcp", action="store_true")
    ap.add_argument("--cpus", default="0", help="CPUs to pin to, comma separated ('' for no pinning)")
    ap.add_argument("--profile", action="store_true",
                    help="afterwards, cProfile one more pass of raydcp's steps at full scale (not in the timings)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--e2e-repeats", type=int, default=3,
                    help="runs of the end-to-end sequence at each scale (each phase: the median)")
    ap.add_argument("--rank-points", default="",
                    help="comma-separated saving rank counts for the end-to-end table in place of 1/4, 1/2 and full "
                         "scale (e.g. 1024,4096,10240,16384); each loads on ranks x --load-ranks / --ranks ranks")
    ap.add_argument("--no-memory", action="store_true",
                    help="skip the end-to-end pass with tracemalloc on (the coordinator's peak memory)")
    ap.add_argument("--end-to-end-only", action="store_true",
                    help="only the end-to-end table (plan + commit + metadata write + read + load plan)")
    args = ap.parse_args()
    if args.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    pages = planning_pages()  # as the coordinator's actor does at start
    info = machine()
    log(f"numpy's huge-page advice {'off' if pages else 'on (no switch in this numpy)'}, as in the coordinator's actor")
    log(f"machine: {info['nproc']} CPUs, {info['mem_gib']} GiB RAM; pinned to CPUs {sorted(os.sched_getaffinity(0))}; "
        f"times are CPU seconds of this process; load average {info['loadavg']}")
    # warm up (first calls import and initialise: pyarrow's IPC and zstd, torch's DCP modules)
    _lps = received(sent(raydcp_local_plans(4, 12)))
    raydcp_load_plan(_save_steps(_lps), received(sent(raydcp_load_plans(2, 4, 12))))
    full_r = max(4, round(args.ranks * args.scale))
    full_l = max(2, round(args.load_ranks * args.scale))
    scales = [(max(2, full_r // f), max(1, full_l // f)) for f in (4, 2, 1)]
    points = []
    for r, l in ([] if args.end_to_end_only else scales):
        log(f"raydcp: {r} ranks x {args.tensors} tensors = {r * args.tensors} pieces; load on {l} ranks")
        points.append(run_raydcp(r, l, args.tensors, args.budget_s))
        gc.collect()
    e2e = []
    e2e_scales = scales
    if args.rank_points:
        e2e_scales = [(r, max(1, round(r * args.load_ranks / args.ranks))) for r in map(int, args.rank_points.split(","))]
    run_end_to_end(4, 2, lambda: raydcp_local_plans(4, 12), lambda: raydcp_load_plans(2, 4, 12), step, lambda m: None)
    for r, l in e2e_scales:
        runs = []
        for i in range(args.e2e_repeats):
            log(f"end to end: {r} ranks x {args.tensors} tensors = {r * args.tensors} pieces; load on {l} ranks "
                f"(run {i + 1} of {args.e2e_repeats})")
            runs.append(run_end_to_end(r, l, lambda: raydcp_local_plans(r, args.tensors),
                                       lambda: raydcp_load_plans(l, r, args.tensors), step, log))
            gc.collect()
        point = median_of(runs)
        if not args.no_memory:
            log("    the same with tracemalloc on (untimed): the coordinator's peak memory")
            point["peak_bytes"] = run_end_to_end(r, l, lambda: raydcp_local_plans(r, args.tensors),
                                                 lambda: raydcp_load_plans(l, r, args.tensors), step, log,
                                                 memory=True)["peak_bytes"]
            log(f"    peak {point['peak_bytes'] / (1 << 20):.0f} MiB, {point['peak_bytes'] / point['pieces']:.0f} bytes/piece")
            gc.collect()
        e2e.append(point)
    e2e_text, e2e_summary = report_e2e(e2e, goal, table, goal_ranks=args.ranks)
    dcp = None
    if not args.no_dcp and points:
        peer = points[{0.25: 0, 0.5: 1, 1.0: 2}[args.dcp_at]]
        log(f"torch DCP: {peer['ranks']} ranks x {args.tensors} tensors; load on {peer['load_ranks']} ranks")
        dcp = run_dcp(peer["ranks"], peer["load_ranks"], args.tensors, args.dcp_sample_ranks)
    text, summary = report(points, dcp) if points else ("", {})
    print(f"\n## planning  ({info['date']}, {info['nproc']} CPUs, {info['mem_gib']} GiB RAM, pinned to one CPU, CPU seconds;"
          f" load average {info['loadavg']} at the start, {loadavg()} at the end)\n")
    print(f"command: {argv_line()}  (raydcp at {info['revision']})\n")
    print(text)
    print(e2e_text)
    if args.profile:
        gc.collect()
        profile_raydcp(full_r, full_l, args.tensors, min(args.tensors, 24))
    out = save_json("planning", {"machine": info, "args": vars(args), "raydcp": points, "dcp": dcp, "summary": summary,
                                 "end_to_end": e2e, "end_to_end_summary": e2e_summary})
    log(f"results: {out}")
    if not args.no_plot and points:
        plot(points, RESULTS / "planning.png")
        log(f"plot: {RESULTS / 'planning.png'}")


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    x = [p["pieces"] for p in points]
    for name in ("plan_save", "build_md", "encode", "decode", "load_plan", "total"):
        ax.plot(x, [p[name] for p in points], marker="o", label=name)
    ax.axhline(2.0, color="grey", ls="--", label="goal: 2 s total")
    ax.plot(x, [points[0]["total"] * n / x[0] for n in x], color="black", ls=":", label="linear from the first total")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("pieces (ranks x tensors)")
    ax.set_ylabel("CPU seconds, one CPU")
    ax.set_title("raydcp planning cost")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


if __name__ == "__main__":
    main()
