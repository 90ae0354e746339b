"""Reshard throughput and peak memory against checkpoint size; raydcp against torch's format_utils route.

Data, per size S: float32 matrices of 16 MiB (4096 x 1024), S in total, saved twice -- by 4 ranks
(dim-0 pieces) as a raydcp checkpoint, and by torch DCP (dcp.save in one process) as the peer's
source. Every run happens in a fresh process, so its peak RSS (getrusage) is its own; the page
cache is warm for every run alike. Every output file is fsynced (torch's dcp_to_torch_save does
not fsync: the run fsyncs its file before the clock stops, for equal durability).

  raydcp 4->8          `raydcp reshard` engine: 4 ranks -> 8 (dim0), ranks as threads, --memory-budget B
  raydcp 4->8 1GiB     the same with the default budget (1 GiB: few rounds, memory not the constraint)
  raydcp consolidate   the same, every tensor whole (-M 1 --consolidate): what dcp_to_torch_save produces
  raydcp job 4->8      jobs/reshard.py's engine: 8 actors of a ShardGroup on a local Ray instance
                       (4 CPUs), budget B per actor; throughput over the rounds (actor startup excluded),
                       peak RSS of the busiest actor
  torch dcp->pt        torch.distributed.checkpoint.format_utils.dcp_to_torch_save (whole state in memory)
  torch pt->dcp        format_utils.torch_save_to_dcp (whole state in memory)

"peak MiB" is the process's peak RSS (VmHWM; for the job, the busiest actor's); "held MiB" subtracts
the RSS of the same process once its imports are done (torch, raydcp, the reading code), i.e. what
the run itself held. For an actor it also subtracts the object-store pages it touched (shared
memory of the node, bounded by the object store's size: "shared MiB"). "driver MiB": the job's
driver. Output checked bit-exact against the source for every run.

    python bench/reshard.py                         # sizes 64, 256, 1024 MiB; ~8 min on 2 cores
    python bench/reshard.py --sizes 64,256 --no-ray # quick
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _util import argv_line, log, machine, save_json, table  # noqa: E402

MIB = 1 << 20
TENSOR_ROWS, TENSOR_COLS = 4096, 1024  # 16 MiB of float32


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    """This process's peak RSS: VmHWM, which starts afresh at exec (getrusage's ru_maxrss does not:
    Linux carries the parent's high-water mark into a forked and exec'd child)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def make_state(size_mib: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(size_mib)
    n = max(1, size_mib // 16)
    return {f"layers.{i}.weight": torch.randn(TENSOR_ROWS, TENSOR_COLS, generator=g) for i in range(n)}


# ------------------------------------------------------------------------- child processes

def child(kind: str, src: str, dst: str, budget: int, extra: str) -> dict:
    """One measured run (in its own process); returns its figures."""
    warnings.filterwarnings("ignore")
    import torch  # noqa: F401

    import raydcp  # noqa: F401
    from raydcp.reshard import ReshardOptions, reshard

    if kind == "job":
        import ray

        from raydcp.reshard import reshard_with
        from raydcp.runtime.shard_group.reshard_job import RayExecutor, _memory
    if kind in ("reshard", "reshard-1g", "consolidate", "job"):
        raydcp.read_metadata(src)  # the first use imports what reading needs: not part of the run
    elif kind in ("dcp_to_pt", "pt_to_dcp"):
        import torch.distributed.checkpoint.format_utils  # noqa: F401
    base = _rss_now()
    out: dict = {}
    t0 = time.perf_counter()
    if kind == "reshard":
        r = reshard(src, dst, ReshardOptions(world_size=8, memory_budget=budget))
        out["rounds"] = r.rounds
    elif kind == "reshard-1g":
        r = reshard(src, dst, ReshardOptions(world_size=8, memory_budget=1 << 30))
        out["rounds"] = r.rounds
    elif kind == "consolidate":
        r = reshard(src, dst, ReshardOptions(world_size=1, consolidate=True, memory_budget=max(budget, 16 * MIB)))
        out["rounds"] = r.rounds
    elif kind == "job":
        ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
                 object_store_memory=max(4 * budget, 256 * MIB),
                 runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}})
        base = _rss_now()
        t0 = time.perf_counter()
        executors = []

        def make():
            ex = RayExecutor(8, num_cpus_per_actor=0.5)
            executors.append(ex)
            ex.started = ray.get([a.apply.remote(_memory) for a in ex.group.actors])  # after imports
            return ex

        r = reshard_with(make, RayExecutor.per_process, src, dst, ReshardOptions(world_size=8, memory_budget=budget))
        ex = executors[0]
        # an actor's own memory: its peak, less the object-store pages it touched (shared by the node),
        # less what it held once started (the Ray worker with torch and raydcp imported)
        held = [p - sh - st for p, sh, (st, _) in zip(ex.peak_rss, ex.shared_rss, ex.started)]
        out.update(rounds=r.rounds, round_seconds=r.round_seconds, actor_peaks=ex.peak_rss, actor_held=held,
                   actor_shared=ex.shared_rss)
        ray.shutdown()
    elif kind == "dcp_to_pt":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(src, dst)
        fd = os.open(dst, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    elif kind == "pt_to_dcp":
        from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

        torch_save_to_dcp(src, dst)  # FileSystemWriter fsyncs its files (sync_files=True)
    elif kind == "baseline":
        if extra == "ray":
            import ray  # noqa: F401
    else:
        raise SystemExit(f"unknown kind {kind}")
    out.update(seconds=time.perf_counter() - t0, peak=_peak(), base=base)
    return out


def run_child(kind: str, src: str = "", dst: str = "", budget: int = 0, extra: str = "") -> dict:
    cmd = [sys.executable, __file__, "--child", kind, src, dst, str(budget), extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------- checks

def check_raydcp(path: str, ref: dict) -> None:
    import torch

    import raydcp

    out = {k: torch.empty_like(v) for k, v in ref.items()}
    raydcp.load(out, path)
    assert all(torch.equal(out[k], ref[k]) for k in ref), path


def check_torch_save(path: str, ref: dict) -> None:
    import torch

    got = torch.load(path, weights_only=True)
    assert all(torch.equal(got[k], ref[k]) for k in ref), path


def check_dcp(path: str, ref: dict) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    out = {k: torch.empty_like(v) for k, v in ref.items()}
    dcp.load(out, checkpoint_id=path)
    assert all(torch.equal(out[k], ref[k]) for k in ref), path


# ----------------------------------------------------------------------------------- main

def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, src, dst, budget, extra = sys.argv[2:7]
        print(json.dumps(child(kind, src, dst, int(budget), extra)))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64,256,1024", help="checkpoint sizes in MiB (comma-separated)")
    p.add_argument("--budget-mib", type=int, default=64, help="--memory-budget of the raydcp runs (MiB)")
    p.add_argument("--no-ray", action="store_true", help="skip the Ray job runs")
    p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    import torch.distributed.checkpoint as dcp

    from raydcp.engine import save_with
    from raydcp.reshard.plan import piece_box
    from raydcp.state import Shard
    from raydcp.transport import ThreadTransport

    sizes = [int(s) for s in args.sizes.split(",")]
    budget = args.budget_mib * MIB
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-reshard-"))
    root.mkdir(parents=True, exist_ok=True)
    log(f"scratch {root}; budget {args.budget_mib} MiB; sizes {sizes} MiB")
    base_plain = run_child("baseline")
    rows, results = [], []
    for size in sizes:
        ref = make_state(size)
        nbytes = sum(t.numel() * t.element_size() for t in ref.values())
        src = str(root / f"src-{size}")
        dcp_src = str(root / f"dcp-{size}")
        # the raydcp source, saved by 4 ranks holding dim-0 pieces
        import threading

        transports = ThreadTransport.group(4, timeout_s=600)

        def save_rank(t):
            piece = {}
            for k, v in ref.items():
                off, sz = piece_box(tuple(v.shape), "dim0", t.rank, 4)
                piece[k] = Shard(v.narrow(0, off[0], sz[0]), off, tuple(v.shape))
            save_with(t, piece, src)

        threads = [threading.Thread(target=save_rank, args=(t,)) for t in transports]
        [t.start() for t in threads]
        [t.join() for t in threads]
        dcp.save(ref, checkpoint_id=dcp_src)
        runs = [("raydcp 4->8", "reshard", src, str(root / f"r-{size}"), check_raydcp),
                ("raydcp 4->8 1GiB", "reshard-1g", src, str(root / f"g-{size}"), check_raydcp),
                ("raydcp consolidate", "consolidate", src, str(root / f"c-{size}"), check_raydcp),
                ("torch dcp->pt", "dcp_to_pt", dcp_src, str(root / f"t-{size}.pt"), check_torch_save),
                ("torch pt->dcp", "pt_to_dcp", str(root / f"t-{size}.pt"), str(root / f"d-{size}"), check_dcp)]
        if not args.no_ray:
            runs.insert(2, ("raydcp job 4->8", "job", src, str(root / f"j-{size}"), check_raydcp))
        for name, kind, s, d, check in runs:
            log(f"{size} MiB: {name}")
            r = run_child(kind, s, d, budget)
            check(d, ref)
            secs = r.get("round_seconds") or r["seconds"]
            peak = max(r.get("actor_peaks") or [r["peak"]])
            held = max(r["actor_held"]) if kind == "job" else r["peak"] - r["base"]
            rec = {"size_mib": size, "run": name, "seconds": r["seconds"], "work_seconds": secs,
                   "gb_s": nbytes / secs / 1e9, "peak_mib": peak / MIB, "held_mib": held / MIB,
                   "driver_peak_mib": r["peak"] / MIB if kind == "job" else None, "rounds": r.get("rounds"),
                   "actor_shared_mib": max(r["actor_shared"]) / MIB if kind == "job" else None}
            results.append(rec)
            rows.append([size, name, rec["rounds"], rec["seconds"], secs, rec["gb_s"], rec["peak_mib"], rec["held_mib"],
                         rec["actor_shared_mib"], rec["driver_peak_mib"]])
        for name in ("r", "g", "c", "j", "d"):
            shutil.rmtree(root / f"{name}-{size}", ignore_errors=True)
        Path(root / f"t-{size}.pt").unlink(missing_ok=True)
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(dcp_src, ignore_errors=True)
        del ref
    print()
    print(table(["MiB", "run", "rounds", "s total", "s work", "GB/s", "peak MiB", "held MiB", "shared MiB",
                 "driver MiB"], rows))
    print(f"\nRSS after imports: {base_plain['base'] / MIB:.0f} MiB; budget {args.budget_mib} MiB per process "
          "(per actor for the job)")
    path = save_json("reshard", {"machine": machine(), "command": argv_line(), "budget_mib": args.budget_mib,
                                 "baseline_mib": base_plain["base"] / MIB, "results": results})
    log(f"wrote {path}")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
