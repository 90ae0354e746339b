"""Notice -> committed: how long an emergency checkpoint of the survivors takes, against the deadline.

4 ranks (Ray actors, one local Ray instance) hold a DDP-style replicated state (``--mib`` MiB of
float32 tensors, the model and its optimizer's two moments, every rank the whole). A preemption
notice reaches them (the driver's clock: the notice's time is taken before the calls go out) and
they save with ``raydcp.SaveOptions(survivors=True, leaving={node: [3]})``, as
``raydcp.train.save_on_preemption`` does (the notice names rank 3, so the plan gives it nothing to
write and the commit does not wait for it):

- ``all alive``: the preempted rank takes part to the end;
- ``lost before``: rank 3's actor is dead at the notice (reclaimed first; the group knows its process
  from the warm-up save, so the survivors do not wait for it);
- ``lost during``: rank 3 stops once the save has planned and is killed there (reclaimed mid-save);
- ``writer lost``: the same without the notice's ranks (``leaving`` not given): rank 3 had files to
  write, so the survivors plan again without it and write its share.

Two tiers: ``raymem://`` (the cluster's memory, the fastest the run has) and a local directory
(storage: files flushed and fsynced). Timed: the notice to the last survivor's return (the commit
is durable when the first returns). Each case ``--repeat`` times (median), a fresh group each time.
The figure is compared with a 30 s notice, the short end of what spot capacity gives.

Run: .venv/bin/python bench/preemption.py [--mib 128] [--repeat 3]
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ray  # noqa: E402
import torch  # noqa: E402

import raydcp  # noqa: E402
from bench._util import argv_line, log, machine, median, save_json, table  # noqa: E402

WORLD = 4
NOTICE_S = 30.0
CASES = ("all alive", "lost before", "lost during", "writer lost")
LEAVING = {"preempted-node": [WORLD - 1]}  # the notice's ranks, by node


@ray.remote(num_cpus=0, max_concurrency=2)
class Rank:
    def __init__(self, rank: int, mib: int):
        self.rank = rank
        n = 16
        numel = (mib << 20) // 4 // n // 3  # model, exp_avg, exp_avg_sq
        g = torch.Generator().manual_seed(0)  # the same on every rank: replicas
        self.state = {f"{part}.layer{i}": torch.randn(numel, generator=g)
                      for part in ("model", "optim.exp_avg", "optim.exp_avg_sq") for i in range(n)}
        self.state["step"] = 100
        self.holding = threading.Event()

    def save(self, name: str, path: str, survivors: bool = True, hold: bool = False, notice: bool = True):
        """Save; returns the wall-clock time at which this rank's save returned (or the error)."""
        if hold:
            import raydcp.engine.survivors as engine

            def stop(*args, **kwargs):
                self.holding.set()
                threading.Event().wait()

            engine.write_rank_files = stop
        try:
            md = raydcp.save(self.state, path, group=raydcp.Group(name, self.rank, WORLD, timeout_s=120),
                             options=raydcp.SaveOptions(survivors=survivors,
                                                        leaving=LEAVING if survivors and notice else None))
        except raydcp.CheckpointError as exc:
            return exc
        return time.time(), list(md.extra.get("lost_ranks") or [])

    def wait_holding(self) -> bool:
        return self.holding.wait(120)


def one(survivors: list, mib: int, url: str, case: str) -> float:
    """Seconds from the notice to the last survivor's return, for one emergency save of ``case``."""
    name = f"bench-preempt-{uuid.uuid4().hex[:8]}"
    victim = Rank.remote(WORLD - 1, mib)
    ranks = [*survivors, victim]
    warm = ray.get([r.save.remote(name, url + "-warm", False) for r in ranks])  # binds every rank to the group
    assert all(not isinstance(w, Exception) for w in warm), warm
    if case == "lost before":
        ray.kill(victim)
    t_notice = time.time()
    notice = case != "writer lost"
    refs = [r.save.remote(name, url, notice=notice) for r in survivors]
    if case == "all alive":
        refs.append(victim.save.remote(name, url))
    elif case in ("lost during", "writer lost"):
        victim.save.remote(name, url, hold=True, notice=notice)
        ray.get(victim.wait_holding.remote())
        ray.kill(victim)
    out = ray.get(refs)
    bad = [o for o in out if isinstance(o, Exception)]
    if bad:
        raise bad[0]
    lost = out[0][1]
    # all alive: rank 3, given nothing to write, is committed without where it comes after the writers
    assert lost == [WORLD - 1] or (case == "all alive" and lost == []), (case, lost)
    if case == "all alive":
        ray.kill(victim)
    return max(t for t, _ in out) - t_notice


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=128, help="the state's size (each rank holds all of it)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    root = str(Path(__file__).resolve().parent.parent)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR,
             object_store_memory=max(512, 4 * args.mib) << 20, runtime_env={"env_vars": {"PYTHONPATH": root}})
    rows, results = [], {}
    try:
        survivors = [Rank.remote(r, args.mib) for r in range(WORLD - 1)]
        with tempfile.TemporaryDirectory(prefix="raydcp-preempt-") as tmp:
            tiers = {"memory (raymem://)": f"raymem://bench-preempt-{uuid.uuid4().hex[:6]}/ckpt",
                     "storage (local disk)": f"{tmp}/ckpt"}
            for tier, url in tiers.items():
                one(survivors, args.mib, url + "-first", "all alive")  # untimed: starts the holders, the host
                for case in CASES:
                    times = []
                    for i in range(args.repeat):
                        times.append(one(survivors, args.mib, f"{url}-{case.replace(' ', '-')}-{i}", case))
                        log(f"{tier}, {case}: {times[-1]:.2f} s")
                    s = median(times)
                    results[f"{tier}, {case}"] = {"seconds": times, "median": s}
                    rows.append([tier, case, s, min(times), max(times), NOTICE_S - s, 100 * s / NOTICE_S])
    finally:
        ray.shutdown()
    headers = ["tier", "case", "notice -> committed s (median)", "min s", "max s",
               f"left of a {NOTICE_S:.0f} s notice", "% of it"]
    print(f"\n{args.mib} MiB replicated on {WORLD} ranks (model + two optimizer moments), median of {args.repeat}")
    print(table(headers, rows))
    save_json("preemption", {"argv": argv_line(), "machine": machine(), "mib": args.mib, "world": WORLD,
                             "notice_s": NOTICE_S, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
