"""Ray's fan-out on this machine: what bounds the number of ranks one raydcp coordinator serves.

raydcp's coordinator is one async actor (the coordinator host); every rank's step is one actor
call to it, carrying the rank's plan as one bytes object (a ``raydcp.transport.Wire``) and
getting its reply the same way. This measures, on a fresh local Ray instance:

  calls     N concurrent calls to one async actor, each with a payload of --payload bytes,
            gathered (``ray.get`` of N refs) -- the coordinator's fan-in and fan-out per step
            (issued by the driver: a rank's call costs the caller about the same)
  objects   ``ray.put`` of N small objects and one ``ray.get`` of the N refs -- refs gathered
            by one process
  actors    lightweight actors (``num_cpus=0``) started in batches and each called once,
            until a batch takes longer than --actor-budget-s or --max-actors is reached: how
            many rank processes this machine holds

    python bench/ray_fanout.py               # ~1-2 minutes on 2 cores
    python bench/ray_fanout.py --max-actors 64 --calls 1000,4000
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import argv_line, log, machine, save_json, table  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", default="1000,4000,16000", help="numbers of concurrent calls to one actor")
    ap.add_argument("--payload", type=int, default=12000, help="bytes per call (a 100-tensor local plan: ~12 KB)")
    ap.add_argument("--objects", default="1000,10000", help="numbers of objects put and gathered")
    ap.add_argument("--max-actors", type=int, default=256)
    ap.add_argument("--actor-batch", type=int, default=32)
    ap.add_argument("--actor-budget-s", type=float, default=40.0, help="stop starting actors past this in all")
    args = ap.parse_args()

    import ray

    info = machine()
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR")
    log(f"Ray {ray.__version__}, {info['nproc']} CPUs, {info['mem_gib']} GiB; load average {info['loadavg']}")

    @ray.remote(num_cpus=0)
    class Coordinator:
        async def step(self, rank: int, payload: bytes) -> bytes:
            return payload[:64]

    @ray.remote(num_cpus=0)
    class Rank:
        def ping(self) -> int:
            return os.getpid()

    res: dict = {"calls": [], "objects": [], "actors": []}
    coord = Coordinator.remote()
    ray.get(coord.step.remote(0, b""))
    payload = os.urandom(args.payload)
    for n in map(int, args.calls.split(",")):
        t0 = time.perf_counter()
        refs = [coord.step.remote(r, payload) for r in range(n)]
        t1 = time.perf_counter()
        out = ray.get(refs)
        t2 = time.perf_counter()
        assert len(out) == n
        res["calls"].append({"n": n, "submit_s": t1 - t0, "gather_s": t2 - t1, "total_s": t2 - t0,
                             "us_per_call": 1e6 * (t2 - t0) / n})
        log(f"calls: {n} to one actor: {t2 - t0:.2f} s ({1e6 * (t2 - t0) / n:.0f} us per call; submit {t1 - t0:.2f} s)")
        del refs, out
    for n in map(int, args.objects.split(",")):
        t0 = time.perf_counter()
        refs = [ray.put(payload[:1024]) for _ in range(n)]
        t1 = time.perf_counter()
        out = ray.get(refs)
        t2 = time.perf_counter()
        res["objects"].append({"n": n, "put_s": t1 - t0, "get_s": t2 - t1, "us_per_object": 1e6 * (t2 - t0) / n})
        log(f"objects: {n} put {t1 - t0:.2f} s, gathered {t2 - t1:.2f} s ({1e6 * (t2 - t0) / n:.0f} us per object)")
        del refs, out
    actors: list = []
    t_start = time.perf_counter()
    while len(actors) < args.max_actors:
        b = min(args.actor_batch, args.max_actors - len(actors))
        t0 = time.perf_counter()
        try:
            batch = [Rank.remote() for _ in range(b)]
            ray.get([a.ping.remote() for a in batch], timeout=max(5.0, args.actor_budget_s))
        except Exception as exc:  # the machine holds no more (memory, processes): record where it stopped
            log(f"actors: starting {b} more past {len(actors)} failed: {type(exc).__name__}: {exc}")
            res["actors_stopped"] = f"{type(exc).__name__} past {len(actors)} actors"
            break
        actors += batch
        t1 = time.perf_counter()
        ping0 = time.perf_counter()
        ray.get([a.ping.remote() for a in actors])
        ping = time.perf_counter() - ping0
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        avail = _mem_available_gib()
        res["actors"].append({"n": len(actors), "start_batch_s": t1 - t0, "call_all_s": ping,
                              "mem_available_gib": avail})
        log(f"actors: {len(actors)} started ({b} in {t1 - t0:.2f} s), one call to each {ping:.3f} s; "
            f"driver RSS {rss:.0f} MiB, memory available {avail:.1f} GiB")
        if time.perf_counter() - t_start > args.actor_budget_s:
            res["actors_stopped"] = f"time budget ({args.actor_budget_s:g} s) past {len(actors)} actors"
            break
    ray.shutdown()
    print(f"\n## Ray fan-out ({info['date']}, {info['nproc']} CPUs, {info['mem_gib']} GiB RAM)\n")
    print(f"command: {argv_line()}\n")
    print(table(["concurrent calls to one actor", "seconds", "us per call"],
                [[c["n"], c["total_s"], c["us_per_call"]] for c in res["calls"]]))
    print()
    print(table(["objects put and gathered", "put s", "get s", "us per object"],
                [[o["n"], o["put_s"], o["get_s"], o["us_per_object"]] for o in res["objects"]]))
    print()
    print(table(["actors", "start of the last batch s", "one call to each s", "memory available GiB"],
                [[a["n"], a["start_batch_s"], a["call_all_s"], a["mem_available_gib"]] for a in res["actors"]]))
    print(f"\nactors: {res.get('actors_stopped', 'all started')}")
    log(f"results: {save_json('ray_fanout', {'machine': info, 'args': vars(args), **res})}")


def _mem_available_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return float("nan")


if __name__ == "__main__":
    main()
