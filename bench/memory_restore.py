"""Restore from the cluster's memory (``raymem://``) against local disk and torch DCP, same data, one run.

Data: the "large" set of bench/distributed.py (--mib MiB in 64 float32 tensors), dim-0 pieces of 4
ranks, saved once (untimed) by 4 raydcp ranks to ``raymem://bench-restore/ckpt`` and to a local
directory, and by 4 torch DCP ranks (gloo, DTensor Shard(0)) to another local directory.

Timed, each repeat (the order of the three rotates from repeat to repeat):
  raymem     raydcp.load from raymem:// onto 4 ranks (same size) and onto 6 (resharded)
  disk       raydcp.load of the same checkpoint from the local directory, 4 and 6 ranks
  torch DCP  dcp.load from its local directory onto 4 and 6 gloo ranks (DTensors, resharded on load)
  s3         (with --s3) raydcp.load of the same checkpoint saved to S3 served by moto on loopback

One Ray node (``ray.init``): every rank reads its own node's copy of the memory checkpoint. The
disk copies are in the page cache (they were just written) unless --cold, which evicts them
(posix_fadvise DONTNEED) before every disk load: the case of a restart on a fresh process after a
failure, where the page cache may or may not still hold them. Every load is verified against the
saved values; medians of --repeats; ratios are other time / raymem time.

    python bench/memory_restore.py                          # 256 MiB, 3 repeats
    python bench/memory_restore.py --mib 64 --repeats 1     # quick
    python bench/memory_restore.py --cold                   # disk loads from a cold page cache
    python bench/memory_restore.py --s3                     # also from S3 (moto_server, in its own process)
    python bench/memory_restore.py --nodes --mib 64         # across nodes, after a node loss (below)

With --nodes: a ``ray.cluster_utils.Cluster`` of 3 nodes on this machine (each its own raylet and
object store). The 4 savers run on nodes n1 and n2 (2 each) and save with ``replicas=1``; the
loaders (4 or 6) run on the head node and n1. Timed: the memory load with every node alive, then
n2 is removed (with it its savers and the copies it held) and, each repeat, the memory load from
what is left -- n2's files from their replicas, read across nodes by the loaders that do not hold
them -- against the disk and torch DCP loads of the same data. (The loaders' groups run a first,
untimed operation before n2 joins, so that their coordinators run on the nodes that stay.)
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import (LoadRange, argv_line, fsync_tree, log, machine, median, refill_free_memory,  # noqa: E402
                   save_json, table)
from distributed import DcpPool, Rank, dataset, nbytes  # noqa: E402

MIB = 1 << 20
SAVERS, MORE = 4, 6
MEM_URL = "raymem://bench-restore/ckpt"


class RaydcpRanks:
    """6 raydcp rank actors (bench/distributed.py's Rank): the first 4 save, 4 or 6 load."""

    def __init__(self, specs: dict):
        import ray

        self.ray = ray
        actor = ray.remote(num_cpus=0, max_restarts=0)(Rank)
        self.ranks = [actor.remote(r, (SAVERS, MORE), specs) for r in range(MORE)]

    def save(self, kind: str, path: str) -> float:
        actors = self.ranks[:SAVERS]
        self.ray.get([a.prepare.remote(kind, SAVERS, "save") for a in actors])
        t0 = time.perf_counter()
        self.ray.get([a.save.remote(kind, SAVERS, path) for a in actors])
        return time.perf_counter() - t0

    def load(self, kind: str, w: int, path: str) -> float:
        actors = self.ranks[:w]
        self.ray.get([a.prepare.remote(kind, w, "load") for a in actors])
        refill_free_memory()
        t0 = time.perf_counter()
        stats = self.ray.get([a.load.remote(kind, w, path) for a in actors])
        t = time.perf_counter() - t0
        bad = sum(self.ray.get([a.verify.remote(kind, w) for a in actors]))
        if bad:
            raise AssertionError(f"raydcp: {bad} tensors differ after the load of {path} onto {w} ranks")
        read, needed = sum(s["bytes_read"] for s in stats), sum(s["bytes_needed"] for s in stats)
        if read > needed:
            raise AssertionError(f"raydcp read {read} bytes of {path} for {needed} needed")
        return t

    def close(self) -> None:
        for a in self.ranks:
            self.ray.kill(a)


class NodeRanks(RaydcpRanks):
    """On a cluster: 6 loader actors on ``loader_tags``'s nodes (alternating), in groups of their
    own; :meth:`add_savers` places the 4 savers."""

    def __init__(self, specs: dict, loader_tags: list[str], root: str):
        import ray

        self.ray, self.specs = ray, specs
        self.actor = ray.remote(num_cpus=0, max_restarts=0)(Rank)
        self.savers: list = []
        self.ranks = [self.actor.options(resources={loader_tags[r % len(loader_tags)]: 1})
                      .remote(r, (SAVERS, MORE), specs) for r in range(MORE)]
        ray.get([a.use_groups.remote("bench-loaders") for a in self.ranks])
        # a first operation of each loader group (a save to disk, untimed) starts its coordinator now,
        # on the nodes there are so far: never on the node that the run removes later
        for w in (SAVERS, MORE):
            ray.get([a.prepare.remote("warm", w, "save") for a in self.ranks[:w]])
            ray.get([a.save.remote("warm", w, os.path.join(root, f"loaders-{w}")) for a in self.ranks[:w]])

    def add_savers(self, tags: list[str]) -> None:
        """The 4 savers, in blocks over the nodes of ``tags``."""
        self.savers = [self.actor.options(resources={tags[r * len(tags) // SAVERS]: 1})
                       .remote(r, (SAVERS, MORE), self.specs) for r in range(SAVERS)]

    def save(self, kind: str, path: str) -> float:
        self.ray.get([a.prepare.remote(kind, SAVERS, "save") for a in self.savers])
        t0 = time.perf_counter()
        self.ray.get([a.save.remote(kind, SAVERS, path) for a in self.savers])
        return time.perf_counter() - t0

    def close(self) -> None:
        for a in self.savers + self.ranks:
            self.ray.kill(a)


def run_nodes(args, specs: dict, root: str, env: dict, loads: LoadRange) -> tuple[dict, dict, list[str]]:
    """The --nodes run (module doc); returns (times, untimed save seconds, the libraries timed)."""
    import ray
    from ray.cluster_utils import Cluster

    size = nbytes(specs["large"])
    os.environ["PYTHONPATH"] = env["PYTHONPATH"] + os.pathsep + os.environ.get("PYTHONPATH", "")
    node = dict(num_cpus=4, object_store_memory=max(512 * MIB, 3 * size))
    cluster = Cluster(initialize_head=True, head_node_args=dict(include_dashboard=False, resources={"n0": 100}, **node))
    workers = {"n1": cluster.add_node(resources={"n1": 100}, **node)}
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR", runtime_env={"env_vars": env})
    disk, dcp_dir = os.path.join(root, "raydcp"), os.path.join(root, "dcp")
    times: dict[str, list[float]] = {}
    pool = ranks = None
    try:
        log("starting torch DCP's gloo processes and raydcp's actors on 3 nodes")
        pool = DcpPool(specs, (SAVERS, MORE))
        ranks = NodeRanks(specs, ["n0", "n1"], root)
        workers["n2"] = cluster.add_node(resources={"n2": 100}, **node)  # the node to lose, added last
        cluster.wait_for_nodes()
        ranks.add_savers(["n1", "n2"])
        mem_url = "raymem://bench-restore-nodes/ckpt"
        saves = warm_up_and_save(ranks, pool, root, ["raymem://bench-warm-nodes/ckpt"],
                                 {"raymem": mem_url, "disk": disk}, dcp_dir)
        for rep in range(args.repeats):
            for w in (SAVERS, MORE):
                times.setdefault(f"raymem all nodes 4->{w}", []).append(ranks.load("large", w, mem_url))
        log("removing node n2 (2 savers, their files' first copies and the replicas it held)")
        cluster.remove_node(workers.pop("n2"))

        def run(lib: str, w: int) -> float:
            if lib == "raymem replicas":
                return ranks.load("large", w, mem_url)
            if lib == "disk":
                if args.cold:
                    fsync_tree(disk, evict=True)
                return ranks.load("large", w, disk)
            if args.cold:
                fsync_tree(dcp_dir, evict=True)
            t, bad = pool.run("load", "large", dcp_dir, w)
            if bad:
                raise AssertionError(f"torch DCP: {bad} tensors differ after the load onto {w} ranks")
            return t

        libs = ["raymem replicas", "disk", "torch DCP"]
        timed_repeats(libs, args.repeats, run, times, loads)
    finally:
        if ranks is not None:
            ranks.close()
        if pool is not None:
            pool.close()
        ray.shutdown()
        cluster.shutdown()
    return times, saves, ["raymem all nodes", "raymem replicas", "disk", "torch DCP"]


def warm_up_and_save(ranks, pool, root: str, warm_urls: list[str], targets: dict[str, str], dcp_dir: str) -> dict:
    """Untimed: both libraries warmed up (raydcp at each of ``warm_urls``), then the large set saved
    by raydcp to each of ``targets`` ({name: url}) and by DCP to ``dcp_dir``; the seconds of each save."""
    log("warming up and saving (untimed)")
    for url in warm_urls:
        ranks.save("warm", url)
        ranks.load("warm", SAVERS, url)
        ranks.load("warm", MORE, url)
    pool.run("save", "warm", os.path.join(root, "dcp-warm"), SAVERS)
    pool.run("load", "warm", os.path.join(root, "dcp-warm"), MORE)
    saves = {name: ranks.save("large", url) for name, url in targets.items()}
    saves["torch DCP"] = pool.run("save", "large", dcp_dir, SAVERS)[0]
    log("  saves (untimed for the goals): " + ", ".join(f"{k} {v:.2f} s" for k, v in saves.items()))
    return saves


def timed_repeats(libs: list[str], repeats: int, run, times: dict, loads) -> None:
    """Every library's load onto SAVERS and MORE ranks, ``repeats`` times, the order rotating from
    repeat to repeat; ``run(lib, world)`` returns the seconds of one verified load."""
    for rep in range(repeats):
        order = libs[rep % len(libs):] + libs[:rep % len(libs)]
        got = {}
        for lib in order:
            for w in (SAVERS, MORE):
                got[f"{lib} 4->{w}"] = t = run(lib, w)
                times.setdefault(f"{lib} 4->{w}", []).append(t)
        log(f"  repeat {rep + 1}/{repeats}: " + "  ".join(f"{k} {v:.3f}" for k, v in got.items())
            + f"  (s, verified); load average {loads.sample()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="directory for the disk checkpoints (default: a temp dir in /tmp)")
    ap.add_argument("--mib", type=int, default=256, help="size of the state, all ranks together (64 tensors)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="evict the disk checkpoints from the page cache before each load")
    ap.add_argument("--s3", action="store_true", help="also restore from S3 (moto_server on loopback)")
    ap.add_argument("--nodes", action="store_true",
                    help="3 nodes (ray.cluster_utils.Cluster): restore from replicas after a node loss")
    args = ap.parse_args()
    if args.nodes and args.s3:
        ap.error("--nodes and --s3 are separate runs")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    warnings.filterwarnings("ignore")
    info, loads = machine(), LoadRange()
    specs = {k: dataset(k, args.mib, 0) for k in ("large", "warm")}
    size = nbytes(specs["large"])
    root = tempfile.mkdtemp(prefix="raydcp-bench-memory-", dir=args.dir or "/tmp")
    disk, dcp_dir = os.path.join(root, "raydcp"), os.path.join(root, "dcp")
    log(f"machine: {info['nproc']} CPUs, {info['mem_gib']} GiB RAM; load average {info['loadavg']}; "
        f"{size / MIB:.0f} MiB in {len(specs['large'])} tensors; disk under {root}")

    import ray

    repo = str(Path(__file__).resolve().parent.parent)
    bench = str(Path(__file__).resolve().parent)
    env = {"PYTHONPATH": os.pathsep.join([repo, bench])}
    moto = None
    if args.s3:  # the ranks reach it through fsspec's and boto's environment variables
        from pipeline import BUCKET, KEYS, start_moto

        moto, opts = start_moto()
        env.update(FSSPEC_S3_ENDPOINT_URL=opts["client_kwargs"]["endpoint_url"], AWS_ACCESS_KEY_ID=KEYS["key"],
                   AWS_SECRET_ACCESS_KEY=KEYS["secret"], AWS_DEFAULT_REGION="us-east-1")
    s3_url = f"s3://{BUCKET}/restore" if args.s3 else None
    if args.nodes:
        try:
            times, saves, libs = run_nodes(args, specs, root, env, loads)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        report(args, info, loads, specs, times, saves, libs, "raymem replicas", None)
        return
    ray.init(address="local", num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR", object_store_memory=max(1 << 30, 3 * size), runtime_env={"env_vars": env})
    times: dict[str, list[float]] = {}
    pool = ranks = None
    try:
        log("starting torch DCP's gloo processes and raydcp's actors")
        pool = DcpPool(specs, (SAVERS, MORE))
        ranks = RaydcpRanks(specs)
        targets = {"raymem": MEM_URL, "disk": disk, **({"s3": s3_url} if s3_url else {})}
        saves = warm_up_and_save(ranks, pool, root, [os.path.join(root, "warm"), "raymem://bench-warm/ckpt"],
                                 targets, dcp_dir)

        def run(lib: str, w: int) -> float:
            if lib == "raymem":
                return ranks.load("large", w, MEM_URL)
            if lib == "disk":
                if args.cold:
                    fsync_tree(disk, evict=True)
                return ranks.load("large", w, disk)
            if lib == "s3":
                return ranks.load("large", w, s3_url)
            if args.cold:
                fsync_tree(dcp_dir, evict=True)
            t, bad = pool.run("load", "large", dcp_dir, w)
            if bad:
                raise AssertionError(f"torch DCP: {bad} tensors differ after the load onto {w} ranks")
            return t

        libs = ["raymem", "disk", "torch DCP"] + (["s3"] if s3_url else [])
        timed_repeats(libs, args.repeats, run, times, loads)
    finally:
        if ranks is not None:
            ranks.close()
        if pool is not None:
            pool.close()
        ray.shutdown()
        if moto is not None:
            moto.terminate()
        shutil.rmtree(root, ignore_errors=True)

    report(args, info, loads, specs, times, saves, libs, "raymem", s3_url)


def report(args, info: dict, loads: LoadRange, specs: dict, times: dict, saves: dict, libs: list[str], base: str,
           s3_url: str | None) -> None:
    """Print the table (medians, ratios to ``base``), the goals, and save the results' JSON."""
    size = nbytes(specs["large"])
    med = {k: median(v) for k, v in times.items()}
    rows = []
    for w in (SAVERS, MORE):
        mem = med[f"{base} 4->{w}"]
        for lib in libs:
            t = med[f"{lib} 4->{w}"]
            rows.append([f"4->{w} {lib}", t, size / t / 1e9, t / mem])
    text = table(["restore", "median s", "GB/s", f"time / {base} time"], rows)
    goal = {f"4->{w} DCP / {base} >= 2": med[f"torch DCP 4->{w}"] / med[f"{base} 4->{w}"] >= 2
            for w in (SAVERS, MORE)}
    if s3_url:
        goal.update({f"4->{w} s3 / raymem >= 10": med[f"s3 4->{w}"] / med[f"raymem 4->{w}"] >= 10
                     for w in (SAVERS, MORE)})
    info["loadavg_during"] = str(loads)
    print(f"\n## memory_restore  ({info['date']}, {info['nproc']} CPUs, {info['mem_gib']} GiB RAM; 1-minute load "
          f"average during the run {loads})\n")
    print(f"command: {argv_line()}\n")
    where = ("3 Ray nodes, saved by 4 ranks on 2 of them with 1 replica, restored after one of those was removed"
             if args.nodes else "one Ray node")
    print(f"{size / MIB:.0f} MiB in {len(specs['large'])} float32 tensors saved by 4 ranks (dim-0 pieces); {where}; "
          f"disk page cache {'cold' if args.cold else 'warm'}; medians of {args.repeats}; every load verified.\n")
    print(text)
    print("\ngoals: " + ", ".join(f"{k}: {'met' if ok else 'MISSED'}" for k, ok in goal.items()))
    out = save_json("memory_restore", {"machine": info, "args": vars(args), "bytes": size, "times": times,
                                       "median": med, "saves": saves, "goals": goal})
    log(f"results: {out}")


if __name__ == "__main__":
    main()
