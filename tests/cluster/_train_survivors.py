"""A Ray Train run for the survivors tests on several nodes (importable by Ray workers).

DDP-style: every worker holds the whole model and optimizer (replicas), averages the gradients of
its share of the global batch with the others (gloo), and reads its samples through a
``raydcp.data.DataCursor``. At ``preempt_at`` the workers wait for Ray Train's preemption notice
(the test drains a node) and save an emergency checkpoint with ``raydcp.train.save_on_preemption``;
the test's control directory says what to hold where:

- ``when="before"``: the preempted ranks do not start the save (their node goes first; with Ray
  Train's relaxed collectives they may also be left behind in ``get_preemption_info``);
- ``when="during"``: every rank stops in the save, where it writes (a preempted rank writes nothing
  there), until the file ``removed`` exists: the test removes the preempted node meanwhile.

With ``sharded=True`` each worker also holds its own rows of a table nobody else holds (a
``raydcp.Shard``, as FSDP's pieces): the preempted workers' rows are then on no survivor.

Rank 0 notes every step (loss, the samples read) in ``<control>/<attempt>.log``; every rank notes
its node in ``<control>/<attempt>.node<rank>``, what it restored in ``<control>/<attempt>.restored<rank>``
(step and table rows, with ``sharded``), and the error its emergency save raised, if any, in
``<control>/error<rank>``.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import ray
import ray.train
import torch
import torch.distributed as dist
import torch.nn.functional as F

import raydcp
import raydcp.data
import raydcp.train

NUM_SAMPLES, GLOBAL_BATCH, FEATURES = 48, 8, 4
TABLE_ROWS = 8  # the sharded table: (TABLE_ROWS, 2), rows split evenly among the workers


def table(step: int) -> torch.Tensor:
    """The whole sharded table after ``step`` steps (each step adds 1 to every element)."""
    return torch.arange(TABLE_ROWS * 2, dtype=torch.float32).reshape(TABLE_ROWS, 2) + step


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(NUM_SAMPLES, FEATURES, generator=g)
    w = torch.randn(FEATURES, 1, generator=g)
    return x, x @ w + 0.1 * torch.randn(NUM_SAMPLES, 1, generator=g)


def fresh_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return {"model": model, "optim": opt, "data": raydcp.data.DataCursor(NUM_SAMPLES, GLOBAL_BATCH, seed=3),
            "step": 0}


def train_step(state: dict, rank: int, world: int, x: torch.Tensor, y: torch.Tensor) -> tuple[float, list[int]]:
    """One step of the global batch (this rank's share of it); the global loss and the batch's samples."""
    model, opt, cursor = state["model"], state["optim"], state["data"]
    samples = cursor.order()[cursor.consumed:cursor.consumed + GLOBAL_BATCH].tolist()
    idx = cursor.batch_indices(rank, world)
    loss = F.mse_loss(model(x[idx]), y[idx])
    opt.zero_grad()
    loss.backward()
    total = loss.detach().clone()
    if world > 1:
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        dist.all_reduce(total)
    opt.step()
    cursor.step()
    state["step"] += 1
    return total.item() / world, samples


def reference(steps: int) -> tuple[list[dict], dict]:
    """The uninterrupted run in one process: each step's loss and samples, and the final parameters."""
    state, (x, y) = fresh_state(), data()
    log = []
    for _ in range(steps):
        loss, samples = train_step(state, 0, 1, x, y)
        log.append({"step": state["step"], "loss": loss, "samples": samples})
    return log, {k: v.detach().clone() for k, v in state["model"].state_dict().items()}


def _wait_for(path: Path) -> None:
    while not path.exists():
        time.sleep(0.05)


def train_fn(config: dict) -> None:
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    control, attempt = Path(config["control"]), config["attempt"]
    (control / f"{attempt}.node{rank}").write_text(ray.get_runtime_context().get_node_id())
    state, (x, y) = fresh_state(), data()
    if config.get("sharded"):  # this worker's rows only
        n = TABLE_ROWS // world
        state["table"] = raydcp.Shard(table(0)[n * rank:n * (rank + 1)].clone(), (n * rank, 0), (TABLE_ROWS, 2))
    raydcp.train.restore(state)
    restored = {"step": state["step"], "table": state["table"].tensor.tolist() if "table" in state else None}
    (control / f"{attempt}.restored{rank}").write_text(json.dumps(restored))
    while state["step"] < config["steps"]:
        loss, samples = train_step(state, rank, world, x, y)
        if "table" in state:
            state["table"].tensor.add_(1)
        metrics = {"loss": loss, "step": state["step"]}
        if rank == 0:
            with open(control / f"{attempt}.log", "a") as f:
                f.write(json.dumps({"step": state["step"], "loss": loss, "samples": samples}) + "\n")
        if state["step"] in config.get("save_at", ()):
            raydcp.train.save(state, metrics)
        if state["step"] == config.get("preempt_at"):
            _emergency(state, metrics, rank, control, config["when"])
            return  # the survivors end here: Ray Train restarts the run without the preempted node


def _emergency(state: dict, metrics: dict, rank: int, control: Path, when: str) -> None:
    if rank == 0:
        (control / "at-notice").touch()
    info = None
    while info is None:  # a collective: every rank calls it as often, until the notice comes
        info = ray.train.get_preemption_info()
        if info is None:
            time.sleep(0.05)
    preempted = rank in info.preempted_ranks
    if preempted and when == "before":
        threading.Event().wait()  # its node goes before it starts the save
    if when == "during":
        import raydcp.engine.survivors as engine

        write = engine.write_rank_files

        def held(*args, **kwargs):
            (control / f"writing{rank}").touch()
            _wait_for(control / "removed")
            return write(*args, **kwargs)

        engine.write_rank_files = held
    try:
        raydcp.train.save_on_preemption(state, metrics, get_info=lambda: info)
    except raydcp.CheckpointError as exc:  # noted for the test; the survivors end here all the same
        (control / f"error{rank}").write_text(json.dumps({
            "type": type(exc).__name__, "message": str(exc), "keys": list(getattr(exc, "keys", ())),
            "lost_ranks": list(getattr(exc, "lost_ranks", ()))}))
