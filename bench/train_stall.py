"""The training stall per checkpoint in a Ray Train job: raydcp against torch DCP.

The job is jobs/train_elastic.py's model and data (a causal transformer under FSDP2,
gloo on CPU workers), widened with ``--dim``/``--layers`` so that a checkpoint has
something to write. Each run is one ``TorchTrainer.fit()`` of ``--steps`` steps on
2 and on 4 workers, checkpointing every ``--every`` steps into the run's storage,
reported to Ray Train (``checkpoint_upload_mode`` NO_UPLOAD for synchronous saves,
ASYNC with an upload function that waits for the commit for asynchronous ones).
The checkpointers, on the same job in the same run:

- **raydcp**: ``raydcp.train.save({"train": TrainState(...)}, metrics)``;
- **raydcp async**: the same with ``async_save=True``;
- **DCP**: ``torch.distributed.checkpoint.save`` of ``get_state_dict(model, optim)``
  (FileSystemWriter defaults: files fsynced) into the same storage, over the
  trainer's gloo process group;
- **DCP async**: ``torch.distributed.checkpoint.async_save`` of the same.

With ``--libs`` also (not by default), the cost of keeping checkpoints in the cluster's memory
(``raymem://``, docs/memory.md) against training without checkpoints:

- **none**: no checkpoint; ``ray.train.report(metrics)`` at the same steps;
- **raydcp memory**: ``raydcp.train.save(..., memory=True)`` (never persisted in the run): every
  rank's files held on its node and, with ``--nodes`` > 1, a replica on the next node (the save
  returns once every copy is held);
- **raydcp memory r0**: the same with ``memory_options={"replicas": 0}`` (the replicas' share);
- **raymem async**: ``raydcp.async_save`` of the same state into ``raymem://`` (replicas as
  above), then ``ray.train.report(metrics)``; the copies are made while training goes on.

``--nodes N`` runs on a ``ray.cluster_utils.Cluster`` of N nodes on this machine (each its own
raylet and object store; the workers spread over them), so replicas cross nodes.

Measured on every rank: the stall (seconds inside the checkpoint call, the slowest
rank's per checkpoint, median over checkpoints), the step time of steps that run
while an asynchronous persist is in flight against steps that do not, and the time
of the whole training function (first step to return; Ray Train then waits for the
last asynchronous upload, so ``fit`` seconds are also given).

Run: .venv/bin/python bench/train_stall.py [--workers 2 4] [--dim 384] [--layers 4] [--steps 16]
     .venv/bin/python bench/train_stall.py --nodes 2 --workers 2 --libs none "raydcp memory" \
         "raydcp memory r0" "raymem async" --steps 40 --every 5       # the memory tier's cost
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from _util import argv_line, log, machine, median, revision, save_json, table

EXAMPLE = str(Path(__file__).resolve().parents[1] / "jobs" / "train_elastic.py")
LIBS = ("raydcp", "raydcp async", "DCP", "DCP async")
MEMORY_LIBS = ("none", "raydcp memory", "raydcp memory r0", "raymem async")


def bench_loop(config: dict) -> None:
    """One Ray Train worker: train, checkpoint every ``every`` steps with ``lib``, write timings."""
    import importlib.util

    import ray.train
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    import raydcp.train

    spec = importlib.util.spec_from_file_location("raydcp_bench_train_example", config["example"])
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    lib, every, steps, gbatch, seed = config["lib"], config["every"], config["steps"], config["global_batch"], 0
    torch.manual_seed(seed)
    model = ex.TinyLM(config["dim"], config["layers"])
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = raydcp.train.TrainState(model, opt, seed=seed)
    data = ex.dataset(seed)
    storage = ctx.get_storage()
    pending = [None]  # the DCP async future in flight
    # DCP's background collectives need a process group of their own: FSDP's run on the default one
    ckpt_group = [dist.new_group(backend="gloo") if lib == "DCP async" else None]

    sizes: list[int] = []  # bytes per memory checkpoint (its metadata's), for the report
    in_flight = [None]     # the raymem async save in flight

    def checkpoint(metrics: dict) -> None:
        if lib == "none":
            ray.train.report(metrics)
            return
        if lib.startswith("raydcp memory"):
            md = raydcp.train.save({"train": state}, metrics, memory=True, persist_every=1 << 30,
                                   memory_options={"replicas": 0} if lib.endswith("r0") else None)
            sizes.append(md.total_bytes)
            return
        if lib == "raymem async":  # the previous one is waited for by async_save itself
            if in_flight[0] is not None:
                sizes.append(in_flight[0].result().total_bytes)
            in_flight[0] = raydcp.async_save({"train": state}, f"{config['mem_root']}/step-{state.step:08d}")
            ray.train.report(metrics)
            return
        if lib.startswith("raydcp"):
            raydcp.train.save({"train": state}, metrics, async_save=lib == "raydcp async")
            return
        import torch.distributed.checkpoint as dcp
        from ray.train import Checkpoint, CheckpointUploadMode
        from torch.distributed.checkpoint.state_dict import get_state_dict

        name = f"dcp-step{state.step:08d}"
        path = storage.build_checkpoint_path_from_name(name)
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        ckpt = Checkpoint(path=path, filesystem=storage.storage_filesystem)
        if lib == "DCP":
            dcp.save(sd, checkpoint_id=path)
            ray.train.report(metrics, checkpoint=ckpt, checkpoint_dir_name=name,
                             checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
            return
        if pending[0] is not None:
            pending[0].result()  # one save in flight at a time, as DCP's documentation asks
        fut = pending[0] = dcp.async_save(sd, checkpoint_id=path, process_group=ckpt_group[0])

        def wait_committed(c, _name):
            fut.result()
            return c

        ray.train.report(metrics, checkpoint=ckpt, checkpoint_dir_name=name,
                         checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
                         delete_local_checkpoint_after_upload=False, checkpoint_upload_fn=wait_committed)

    if lib != "none":
        # what a job does first (a fresh run: nothing to load; starts the coordinator and persister)
        raydcp.train.restore({"train": state}, async_save=lib in ("raydcp async", "raymem async"))
    profile = None
    if config.get("profile") and rank == 0:
        import cProfile

        profile = cProfile.Profile()
    stalls, step_times, ckpt_steps = [], [], []
    t_start = time.perf_counter()
    while state.step < steps:
        t0 = time.perf_counter()
        batch = data[ex.sample_ids(state.batch_range(gbatch), seed)]
        loss = F.cross_entropy(model(batch[:, :-1]).reshape(-1, ex.VOCAB), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        state.advance(gbatch)
        dist.barrier()  # every rank's step ends together: step times are the job's, not one rank's
        step_times.append(time.perf_counter() - t0)
        if state.step % every == 0:
            t1 = time.perf_counter()
            if profile is not None:
                profile.enable()
            checkpoint({"step": state.step, "loss": loss.item()})
            if profile is not None:
                profile.disable()
            dist.barrier()
            stalls.append(time.perf_counter() - t1)
            ckpt_steps.append(state.step)
    train_s = time.perf_counter() - t_start
    if pending[0] is not None:
        pending[0].result()
    if in_flight[0] is not None:
        sizes.append(in_flight[0].result().total_bytes)
    # the slowest rank's numbers
    t = torch.tensor([train_s] + stalls + step_times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if profile is not None:
        profile.dump_stats(config["out"] + ".prof")
    if rank == 0:
        n = len(stalls)
        with open(config["out"], "w") as f:
            json.dump({"train_s": t[0].item(), "stalls": t[1:1 + n].tolist(), "step_times": t[1 + n:].tolist(),
                       "ckpt_steps": ckpt_steps, "world": world, "ckpt_bytes": max(sizes, default=None)}, f)


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def steps_during_persist(step_times: list[float], ckpt_steps: list[int], every: int) -> tuple[list, list]:
    """(steps right after a checkpoint, while its persist runs; the other steps, first step excluded)."""
    after = {s + 1 for s in ckpt_steps} | {s + 2 for s in ckpt_steps}
    during, other = [], []
    for i, t in enumerate(step_times, start=1):
        if i == 1:
            continue  # the first step includes FSDP's lazy initialisation
        (during if i in after else other).append(t)
    return during, other


def start_ray(nodes: int, cpus: int, object_store_mib: int):
    """One local Ray instance, or (``nodes`` > 1) a ``ray.cluster_utils.Cluster`` of that many
    nodes sharing ``cpus`` CPUs; returns the cluster (None for one node)."""
    import ray

    if nodes <= 1:
        ray.init(address="local", num_cpus=cpus, log_to_driver=False, logging_level="ERROR",
                 include_dashboard=False)
        return None
    from ray.cluster_utils import Cluster

    repo = str(Path(__file__).resolve().parents[1])  # the raylets' workers import this checkout
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)
    node = dict(num_cpus=-(-cpus // nodes), object_store_memory=object_store_mib << 20)
    cluster = Cluster(initialize_head=True, head_node_args=dict(include_dashboard=False, **node))
    for _ in range(nodes - 1):
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    return cluster


def overhead_rows(results: list[dict], every: int) -> list[list]:
    """The cost of checkpointing as a share of training time, per run, measured inside the run
    itself (no drift between runs on a shared machine): the median stall per ``every`` median
    steps; the slowdown of the two steps after each checkpoint (an asynchronous save's copies are
    made then) against the other steps; their sum. Beside it, the training function's time
    against the run without checkpoints (``none``) of the same worker count, which moves with
    whatever else the machine runs between the two runs."""
    rows = []
    for r in results:
        if r["lib"] == "none":
            continue
        base = next((x for x in results if x["workers"] == r["workers"] and x["lib"] == "none"), None)
        stall = 100 * r["stall_s"] / (every * r["step_s"])
        during = 100 * (r["step_during_persist_s"] - r["step_s"]) / r["step_s"]
        rows.append([r["workers"], r["lib"], r["step_s"], r["step_during_persist_s"], r["stall_s"], stall, during,
                     stall + during * 2 / every,
                     100 * (r["train_s"] - base["train_s"]) / base["train_s"] if base else None])
    return rows


def replication_rows(results: list[dict], every: int) -> list[list]:
    """What the replicas add to a memory checkpoint: the stall with replicas less the stall
    without, per ``every`` steps, as a share of the step time (both medians of their runs)."""
    rows = []
    for r in results:
        if r["lib"] != "raydcp memory":
            continue
        r0 = next((x for x in results if x["workers"] == r["workers"] and x["lib"] == "raydcp memory r0"), None)
        if r0 is not None:
            extra = r["stall_s"] - r0["stall_s"]
            rows.append([r["workers"], r["stall_s"], r0["stall_s"], extra, 100 * extra / (every * r["step_s"])])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--dim", type=int, default=384, help="model width (the example's default is 16)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=8, help="checkpoint every this many steps")
    ap.add_argument("--global-batch", type=int, default=192,
                    help="sequences per step, split over the workers (the example's default is 12)")
    ap.add_argument("--libs", nargs="+", default=list(LIBS), choices=LIBS + MEMORY_LIBS)
    ap.add_argument("--nodes", type=int, default=1,
                    help="Ray nodes (a ray.cluster_utils.Cluster on this machine when > 1; workers spread)")
    ap.add_argument("--object-store-mib", type=int, default=512, help="object store per node (with --nodes > 1)")
    ap.add_argument("--dir", help="storage directory (default: a temporary one)")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile rank 0's checkpoint calls (after the timings: <dir>/<run>.json.prof)")
    args = ap.parse_args()

    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    import ray
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    root = Path(args.dir or tempfile.mkdtemp(prefix="raydcp-train-stall-"))
    cluster = start_ray(args.nodes, max(args.workers) * 2, args.object_store_mib)
    results: list[dict] = []
    try:
        for world in args.workers:
            order = list(args.libs)
            for k, lib in enumerate(order):
                name = f"w{world}-{lib.replace(' ', '-')}"
                out = root / f"{name}.json"
                log(f"{world} workers, {lib} ({k + 1}/{len(order)})")
                config = {"example": EXAMPLE, "lib": lib, "every": args.every, "steps": args.steps,
                          "global_batch": args.global_batch, "dim": args.dim, "layers": args.layers, "out": str(out),
                          "profile": args.profile, "mem_root": f"raymem://bench-steps-{root.name}-{name}"}
                trainer = TorchTrainer(
                    bench_loop, train_loop_config=config,
                    scaling_config=ScalingConfig(num_workers=world, resources_per_worker={"CPU": 1},
                                                 placement_strategy="SPREAD" if args.nodes > 1 else "PACK"),
                    run_config=RunConfig(name=name, storage_path=str(root),
                                         checkpoint_config=CheckpointConfig(num_to_keep=None)))
                t0 = time.perf_counter()
                result = trainer.fit()
                fit_s = time.perf_counter() - t0
                got = json.loads(out.read_text())
                if got.get("ckpt_bytes") is not None:
                    mb = got["ckpt_bytes"] / 1e6
                else:
                    mb = checkpoint_bytes(Path(result.checkpoint.path)) / 1e6 if result.checkpoint else 0.0
                during, other = steps_during_persist(got["step_times"], got["ckpt_steps"], args.every)
                results.append({"workers": world, "lib": lib, "fit_s": fit_s, "train_s": got["train_s"],
                                "stall_s": median(got["stalls"]), "stalls": got["stalls"],
                                "first_stall_s": got["stalls"][0],
                                "step_s": median(other), "step_during_persist_s": median(during),
                                "checkpoint_mb": mb, "checkpoints": len(got["stalls"])})
                log(f"  stall {results[-1]['stall_s']:.3f} s per checkpoint, training {got['train_s']:.1f} s")
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()

    rows = []
    for r in results:
        base = next((x for x in results if x["workers"] == r["workers"] and x["lib"] == "raydcp"), None)
        rows.append([r["workers"], r["lib"], r["checkpoint_mb"], r["checkpoints"], r["first_stall_s"], r["stall_s"],
                     r["stall_s"] / base["stall_s"] if base else None, r["step_s"], r["step_during_persist_s"],
                     r["train_s"], r["fit_s"]])
    print()
    print(f"model: dim {args.dim}, {args.layers} layers; {args.steps} steps of {args.global_batch} sequences, "
          f"a checkpoint every {args.every}; {args.nodes} Ray node(s)")
    print(table(["workers", "checkpointer", "ckpt MB", "ckpts", "first stall s", "stall s (median)", "stall / raydcp",
                 "step s", "step s during persist", "train fn s", "fit s"], rows))
    print()
    ratio_rows = []
    for world in args.workers:
        by = {r["lib"]: r for r in results if r["workers"] == world}
        for ours, peer in (("raydcp", "DCP"), ("raydcp async", "DCP async"), ("raydcp async", "DCP")):
            if ours in by and peer in by:
                ratio_rows.append([world, f"{peer} / {ours}", by[peer]["stall_s"] / by[ours]["stall_s"],
                                   by[peer]["train_s"] / by[ours]["train_s"]])
    if ratio_rows:
        print(table(["workers", "stall ratio", "x (stall)", "x (train fn time)"], ratio_rows))
    cost = [] if set(args.libs) <= set(LIBS) else overhead_rows(results, args.every)
    if cost:
        print(f"\ncost of checkpointing, % of training time (a checkpoint every {args.every} steps):")
        print(table(["workers", "checkpointer", "step s", "step s during persist", "stall s", "stall %",
                     "steps during persist %", "total %", "train fn vs none %"], cost))
    replication = replication_rows(results, args.every)
    if replication:
        print(f"\nwhat the replicas add to a memory checkpoint (a checkpoint every {args.every} steps):")
        print(table(["workers", "stall s, replicas", "stall s, none", "replicas' stall s", "% of step time"],
                    replication))
    path = save_json("train_stall", {"args": vars(args), "argv": argv_line(), "machine": machine(),
                                     "revision": revision(), "results": results, "ratios": ratio_rows,
                                     "overhead": cost, "replication": replication})
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
