"""Elastic training with raydcp checkpoints on Ray Train: train, checkpoint, scale up, resume, continue.

A small transformer language model is trained under FSDP2 (``fully_shard``, gloo
on CPU) by a ``TorchTrainer`` with ``ScalingConfig(num_workers=(2, 4))`` on a
local two-node-capable Ray cluster:

1. the head node has room for 2 workers: training starts on 2 and checkpoints
   every ``--ckpt-every`` steps with ``raydcp.train.save`` (straight into the
   run's storage; Ray Train registers each checkpoint, ``num_to_keep=2``);
2. at step ``--pause-at`` the workers wait (standing in for a long run) and the
   driver adds a second node;
3. Ray Train sees the larger cluster and restarts the run on 4 workers, which
   call ``raydcp.train.restore``: the 2-rank checkpoint is resharded to 4 ranks
   (model, optimizer, LR schedule, step, the data position of a ``raydcp.data.DataCursor``; RNG
   re-derived): the resumed run reads exactly the samples the uninterrupted one would have;
4. training continues to ``--steps``. With ``--verify`` an uninterrupted run
   on 2 workers is trained too and the final parameters, loss and learning rate
   are compared (world-size independent up to float rounding: the global batch
   is the same and split evenly).

With ``--memory`` every checkpoint is kept in the cluster's memory (``raymem://``, a replica of
each rank's files on the other node) and persisted to storage at the steps that are multiples of
``--persist-every`` and at the last step: the
scale-up resumes from memory, then at ``--kill-at`` the added node is removed and Ray Train
restarts the run on the 2 surviving workers, which resume from the memory replicas.

Run: .venv/bin/python jobs/train_elastic.py [--steps 8] [--pause-at 4] [--verify] [--async-save] [--memory] [--json]

The training function (:func:`train_loop`) is also what tests/train runs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import threading
import time

import numpy as np
import ray
import ray.train
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import raydcp
import raydcp.data
import raydcp.train
from raydcp.codec import dtype_from_name

VOCAB, SEQ, DIM, HEADS = 16, 8, 16, 2
NUM_SAMPLES = 96


# ---------------------------------------------------------------- model and data
class Block(nn.Module):
    def __init__(self, dim: int = DIM):
        super().__init__()
        self.dim = dim
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # no qkv bias: the key bias gets no gradient (softmax ignores it), and Adam would amplify
        # its rounding noise into updates that differ between world sizes
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, self.dim // HEADS).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, self.dim))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    """A causal transformer; by default two blocks of width 16, about 5k parameters."""

    def __init__(self, dim: int = DIM, layers: int = 2):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.zeros(SEQ, dim))
        self.blocks = nn.ModuleList([Block(dim) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, idx):
        x = self.tok(idx) + self.pos
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def dataset(seed: int) -> torch.Tensor:
    """NUM_SAMPLES token sequences; sample i is the same on every rank and in every run."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(VOCAB, (NUM_SAMPLES, 1), generator=g)
    stride = torch.randint(1, 4, (NUM_SAMPLES, 1), generator=g)
    return (start + stride * torch.arange(SEQ + 1)) % VOCAB


def sample_ids(positions: range, seed: int) -> torch.Tensor:
    """Global sample positions -> sample indices: a fresh permutation per epoch."""
    out = []
    for p in positions:
        epoch, i = divmod(p, NUM_SAMPLES)
        perm = torch.randperm(NUM_SAMPLES, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        out.append(int(perm[i]))
    return torch.tensor(out, dtype=torch.long)


def consume_rng() -> None:
    """Stands in for dropout / augmentation: draws from every generator, leaves the loss alone."""
    torch.rand(3)
    random.random()
    np.random.rand()


def draw_rng() -> list[float]:
    return [torch.rand(1).item(), random.random(), float(np.random.rand())]


# ---------------------------------------------------------------- the training function
def train_loop(config: dict) -> None:
    """One Ray Train worker. Config: seed, steps, ckpt_every, global_batch, lr; optional
    stop_at (end this run early, after the checkpoint at that step), pause_at/max_workers/events
    (elastic demo), preempt_at (a simulated preemption notice at that step), async_save
    (checkpoint with raydcp.train.save(async_save=True)), max_staging_bytes (its staging cap per
    node), dim/layers (model size); notes (an Events actor's name: rank 0 notes each step's loss and
    samples there)."""
    from torch.distributed.fsdp import fully_shard

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    seed, steps, every, gbatch = config["seed"], config["steps"], config["ckpt_every"], config["global_batch"]

    torch.manual_seed(seed)  # the same initial weights on every rank
    model = TinyLM(config.get("dim", DIM), config.get("layers", 2))
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=config.get("lr", 1e-2), eps=1e-6, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4) * 0.9 ** max(0, s - 4))
    state = raydcp.train.TrainState(model, opt, sched, seed=seed)
    # the data position, global: resharded with the world size, the next samples are the same ones
    cursor = raydcp.data.DataCursor(NUM_SAMPLES, gbatch, seed=seed)
    saved = {"train": state, "data": cursor}

    memory = config.get("memory", False)
    in_memory = None
    if memory:  # what the cluster's memory holds before the restore (the demo reports where it resumed from)
        from raydcp.train.memory_saves import latest_in_memory, memory_root

        in_memory = latest_in_memory(memory_root(ctx))
    resumed = raydcp.train.restore(saved, async_save=config.get("async_save", False))
    if not resumed:
        state.reseed()
    start = state.step
    events = ray.get_actor(config["events"]) if config.get("events") else None
    if events is not None and rank == 0:
        source = "memory" if resumed and in_memory is not None and in_memory[1] == start else \
            ("storage" if resumed else None)
        ray.get(events.append.remote({"world_size": world, "resumed": resumed, "start_step": start,
                                      "source": source}))

    data = dataset(seed)
    notes = ray.get_actor(config["notes"]) if config.get("notes") and rank == 0 else None
    get_info = None
    if config.get("preempt_at") is not None:  # a simulated notice, as ray.train.get_preemption_info gives it
        from ray.train import PreemptionInfo

        deadline = [int(time.time() * 1000) + 60_000]
        dist.broadcast_object_list(deadline, src=0)  # every rank the same notice, as Ray Train gives it

        def get_info():
            if state.step != config["preempt_at"]:
                return None
            return PreemptionInfo(deadline_ms=deadline[0], preempted_node_to_ranks={"simulated-node": [world - 1]})

    while state.step < min(steps, config.get("stop_at") or steps):
        batch = data[cursor.batch_indices(rank, world)]
        samples = cursor.order()[cursor.consumed:cursor.consumed + gbatch].tolist()  # the step's, all ranks
        loss = F.cross_entropy(model(batch[:, :-1]).reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        consume_rng()
        state.advance(gbatch)
        cursor.step()

        total = loss.detach().clone()
        dist.all_reduce(total)
        metrics = {"loss": total.item() / world, "lr": sched.get_last_lr()[0], "step": state.step,
                   "world_size": world, "resumed": resumed, "start_step": start, "rng": state.rng_restored,
                   "samples": samples}
        if notes is not None:
            ray.get(notes.append.remote({"step": state.step, "loss": metrics["loss"], "samples": samples}))
        if state.step == steps:
            draws = [None] * world
            dist.all_gather_object(draws, draw_rng())
            metrics["draws"] = draws
        pausing = (events is not None and state.step == config.get("pause_at")
                   and world < config.get("max_workers", world))
        killing = (events is not None and state.step == config.get("kill_at")
                   and world == config.get("max_workers", world))
        if state.step % every == 0 or state.step == steps:
            # before pausing, make sure Ray Train has registered the checkpoint the resize resumes from
            # (a memory checkpoint that is not persisted is held by the cluster once saved)
            raydcp.train.save(saved, metrics, wait_registered=pausing,
                              async_save=config.get("async_save", False),
                              max_staging_bytes=config.get("max_staging_bytes"), memory=memory,
                              persist_every=config.get("persist_every", 1),
                              persist=True if state.step == steps else None)  # the last one is kept
        elif raydcp.train.save_on_preemption(saved, metrics, get_info=get_info):
            pass  # the run goes on until the node is actually taken away

        if pausing or killing:
            if rank == 0:
                ray.get(events.set.remote("paused" if pausing else "kill"))
            # Wait for the cluster to grow: Ray Train then stops this worker group and restarts the
            # run on more workers. The timeout only keeps a run without a scale-up from hanging.
            try:
                ray.get(events.wait.remote("never"), timeout=config.get("pause_timeout_s", 300))
            except ray.exceptions.GetTimeoutError:
                pass


# ---------------------------------------------------------------- driver helpers
@ray.remote(num_cpus=0)
class Events:
    """Named events and a log, shared by the driver and the workers."""

    def __init__(self):
        import asyncio

        self._events: dict = {}
        self._new = asyncio.Event
        self.log: list = []

    def _get(self, name):
        if name not in self._events:
            self._events[name] = self._new()
        return self._events[name]

    async def set(self, name):
        self._get(name).set()

    async def wait(self, name):
        await self._get(name).wait()

    async def append(self, item):
        self.log.append(item)

    async def items(self):
        return list(self.log)


def load_full(path: str) -> dict:
    """Every tensor and value of a checkpoint, whole, in this process (no group)."""
    md = raydcp.read_metadata(path)
    sd: dict = {k: torch.empty(tuple(t.shape), dtype=dtype_from_name(t.dtype)) for k, t in md.tensors.items()}
    sd.update({k: None for k in md.values})
    raydcp.load(sd, path)
    return sd


def max_rel_diff(a: dict, b: dict, prefix: str = "train.model.") -> float:
    """max over tensors of max|a-b| / max|a|, for keys under ``prefix``."""
    worst = 0.0
    for k, t in a.items():
        if k.startswith(prefix):
            scale = t.abs().max().item() or 1.0
            worst = max(worst, (t - b[k]).abs().max().item() / scale)
    return worst


def make_trainer(config: dict, *, name: str, storage: str, num_workers, cpus_per_worker: float = 1.0,
                 num_to_keep: int | None = 2, score: str | None = None, max_failures: int = 0,
                 train_fn=train_loop, monitor_interval_s: float = 1.0):
    """A TorchTrainer running ``train_fn`` with raydcp checkpoints kept by Ray Train's CheckpointConfig."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    return TorchTrainer(
        train_fn,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=num_workers, resources_per_worker={"CPU": cpus_per_worker},
                                     elastic_resize_monitor_interval_s=monitor_interval_s),
        run_config=RunConfig(
            name=name, storage_path=storage,
            checkpoint_config=CheckpointConfig(num_to_keep=num_to_keep, checkpoint_score_attribute=score,
                                               checkpoint_score_order="min"),
            failure_config=FailureConfig(max_failures=max_failures),
            callbacks=[raydcp.train.RayDCPCallback()],
        ),
    )


def _refresh_cluster_view() -> None:
    """Have Ray's AutoscalingCoordinator look at the cluster now.

    Ray Train's elastic policy sizes the worker group from the resources the
    AutoscalingCoordinator (ray.data) reserves for it, and that actor refreshes its
    view of the nodes every 20 s. Asking it to recompute now only shortens the demo;
    if this internal API is gone, the resize simply happens at its next refresh.
    """
    try:
        coordinator = ray.get_actor("AutoscalingCoordinator", namespace="AutoscalingCoordinator")
        ray.get(coordinator.get_reserved_resources.remote("raydcp-elastic-demo", recompute=True), timeout=30)
    except Exception:
        pass


def read_records(storage: str, name: str) -> list[dict]:
    path = os.path.join(storage, name, raydcp.train.RECORDS_NAME)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--pause-at", type=int, default=4, help="step at which the 2 workers wait for the new node")
    ap.add_argument("--ckpt-every", type=int, default=2)
    ap.add_argument("--verify", action="store_true", help="also train without interruption and compare")
    ap.add_argument("--dir", help="storage path (default: a temporary directory)")
    ap.add_argument("--json", action="store_true", help="print a JSON summary only")
    ap.add_argument("--async-save", action="store_true",
                    help="checkpoint asynchronously (raydcp.train.save(async_save=True))")
    ap.add_argument("--memory", action="store_true",
                    help="checkpoint into the cluster's memory (raydcp.train.save(memory=True)), persist the "
                         "steps that are multiples of --persist-every and the last; after the scale-up, kill the "
                         "added node at --kill-at and resume on the survivors from the memory replicas")
    ap.add_argument("--persist-every", type=int, default=4)
    ap.add_argument("--kill-at", type=int, default=None, help="with --memory: step at which the added node is "
                    "removed (default: --steps - --ckpt-every)")
    args = ap.parse_args(argv)
    kill_at = (args.kill_at if args.kill_at is not None else args.steps - args.ckpt_every) if args.memory else None
    say = (lambda *a: None) if args.json else print
    storage = args.dir or tempfile.mkdtemp(prefix="raydcp-elastic-")
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    summary: dict = {"storage": storage}
    try:
        events = Events.options(name="raydcp-elastic-events").remote()
        notes = Events.options(name="raydcp-elastic-notes").remote()
        config = {"seed": 0, "steps": args.steps, "ckpt_every": args.ckpt_every, "global_batch": 12,
                  "pause_at": args.pause_at, "max_workers": 4, "events": "raydcp-elastic-events",
                  "async_save": args.async_save, "memory": args.memory, "persist_every": args.persist_every,
                  "kill_at": kill_at, "notes": "raydcp-elastic-notes"}
        trainer = make_trainer(config, name="elastic", storage=storage, num_workers=(2, 4),
                               max_failures=1 if args.memory else 0)
        out: dict = {}
        def fit():
            try:
                out["result"] = trainer.fit()
            except Exception as exc:  # reported by the main thread
                out["error"] = exc

        thread = threading.Thread(target=fit, daemon=True)
        t0 = time.perf_counter()
        thread.start()
        say(f"training on 2 workers; storage {storage}")
        paused = events.wait.remote("paused")
        while not ray.wait([paused], timeout=1.0)[0]:  # the event, unless the run ended without it
            if not thread.is_alive():
                raise RuntimeError("the run ended before pausing at step %d: %r" % (args.pause_at, out))
        t_paused = time.perf_counter() - t0
        say(f"step {args.pause_at} checkpointed on 2 workers; adding a node with 2 CPUs")
        added = cluster.add_node(num_cpus=2)
        _refresh_cluster_view()
        t_added = time.perf_counter() - t0
        if kill_at is not None:
            kill = events.wait.remote("kill")
            while not ray.wait([kill], timeout=1.0)[0]:
                if not thread.is_alive():
                    raise RuntimeError("the run ended before reaching step %d on 4 workers: %r" % (kill_at, out))
            say(f"step {kill_at} checkpointed in memory on 4 workers; removing the added node")
            cluster.remove_node(added)
            summary["node_removed_at_step"] = kill_at
        thread.join(timeout=600)
        if "result" not in out:
            raise RuntimeError(f"the elastic run did not finish: {out.get('error')!r}")
        result = out["result"]
        summary.update(
            seconds={"paused": round(t_paused, 1), "node_added": round(t_added, 1),
                     "finished": round(time.perf_counter() - t0, 1)},
            attempts=ray.get(events.items.remote()),
            final={k: result.metrics[k] for k in ("step", "loss", "lr", "world_size", "start_step", "rng", "draws")},
            checkpoint=result.checkpoint.path,
            records=read_records(storage, "elastic"),
        )
        for a in summary["attempts"]:
            how = f"resumed at step {a['start_step']} from {a.get('source')}" if a["resumed"] else "fresh start"
            say(f"  attempt on {a['world_size']} workers: {how}")
        say(f"finished on {result.metrics['world_size']} workers at step {result.metrics['step']}: "
            f"loss {result.metrics['loss']:.5f}, lr {result.metrics['lr']:.5f}")
        sizes = [a["world_size"] for a in summary["attempts"]]
        summary["steps"] = {n["step"]: n for n in ray.get(notes.items.remote())}  # the last attempt's wins
        if kill_at is None:
            ok = sizes[-1:] == [4]
        else:  # 2 -> 4 (scale-up) -> 2 (node lost), both resumes from memory
            ok = sizes == [2, 4, 2] and [a["source"] for a in summary["attempts"][1:]] == ["memory", "memory"]
        if args.verify:
            ref_notes = Events.options(name="raydcp-elastic-ref-notes").remote()
            ref_cfg = {k: v for k, v in config.items()
                       if k not in ("pause_at", "events", "memory", "kill_at")}
            ref_cfg["notes"] = "raydcp-elastic-ref-notes"
            ref = make_trainer(ref_cfg, name="reference", storage=storage, num_workers=2).fit()
            diff = max_rel_diff(load_full(ref.checkpoint.path), load_full(result.checkpoint.path))
            ref_steps = {n["step"]: n for n in ray.get(ref_notes.items.remote())}
            run_steps = summary["steps"]
            summary["verify"] = {
                "reference_loss": ref.metrics["loss"], "reference_lr": ref.metrics["lr"],
                "param_max_rel_diff": diff,
                "loss_rel_diff": abs(ref.metrics["loss"] - result.metrics["loss"]) / abs(ref.metrics["loss"]),
                "lr_equal": math.isclose(ref.metrics["lr"], result.metrics["lr"], rel_tol=1e-12),
                # every step read the samples the uninterrupted run read (none skipped, none repeated)
                "samples_equal": sorted(ref_steps) == sorted(run_steps) and all(
                    sorted(ref_steps[s]["samples"]) == sorted(run_steps[s]["samples"]) for s in ref_steps),
                "step_loss_max_rel_diff": max(abs(ref_steps[s]["loss"] - run_steps[s]["loss"]) / abs(ref_steps[s]["loss"])
                                              for s in ref_steps if s in run_steps),
            }
            say(f"uninterrupted 2-worker run: loss {ref.metrics['loss']:.5f}; parameters differ by at most "
                f"{diff:.2e} (relative)")
            say(f"every step read the same samples as the uninterrupted run: {summary['verify']['samples_equal']}")
            ok = ok and diff <= 1e-5 and summary["verify"]["loss_rel_diff"] <= 1e-5 and summary["verify"]["lr_equal"] \
                and summary["verify"]["samples_equal"]
        summary["ok"] = ok
    finally:
        ray.shutdown()
        cluster.shutdown()
    if args.json:
        print(json.dumps(summary, default=str))
    else:
        say("OK" if summary.get("ok") else "FAILED")
    return 0 if summary.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
