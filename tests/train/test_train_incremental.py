"""raydcp.train.save(incremental=True) in real Ray Train runs: each checkpoint writes only what
changed, Ray Train's num_to_keep never removes what a kept checkpoint references, and a new run of
the same name resumes on another worker count from a delta checkpoint, resharded."""
from __future__ import annotations

import os

import pytest
import torch

import raydcp

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

ROWS, COLS = 96, 32


def frozen() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


def loop(config: dict) -> None:
    import ray.train

    import raydcp
    import raydcp.train as rt

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    lo, hi = rank * ROWS // world, (rank + 1) * ROWS // world
    state = {"frozen": raydcp.Shard(frozen()[lo:hi].clone(), (lo, 0), (ROWS, COLS)),
             "adapter": torch.zeros(4, 4), "step": 0}
    resumed = rt.restore(state)
    assert torch.equal(state["frozen"].tensor, frozen()[lo:hi])  # the frozen part, read through references
    assert torch.equal(state["adapter"], torch.full((4, 4), float(state["step"])))
    for step in range(state["step"] + 1, config["steps"] + 1):
        state["adapter"] += 1
        state["step"] = step
        rt.save(state, {"step": step, "resumed": resumed, "world": world}, step=step, incremental=True)


def fit(storage: str, workers: int, steps: int):
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    return TorchTrainer(loop, train_loop_config={"steps": steps},
                        scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 0.5}),
                        run_config=RunConfig(name="incremental", storage_path=storage,
                                             checkpoint_config=CheckpointConfig(num_to_keep=2))).fit()


def test_incremental_saves_resume_on_another_worker_count(ray_session, tmp_path):
    first = fit(str(tmp_path), 2, 3)
    assert first.error is None and first.metrics["raydcp"]["written_bytes"] == 64  # the adapter only
    assert first.metrics["raydcp"]["referenced_bytes"] == ROWS * COLS * 4
    second = fit(str(tmp_path), 3, 5)
    assert second.error is None and second.metrics["resumed"] and second.metrics["world"] == 3
    md = raydcp.read_metadata(second.checkpoint.path)
    assert md.world_size == 3 and all(f.startswith("../raydcp-data/") for f in md.files)
    out = {"frozen": torch.zeros(ROWS, COLS), "adapter": torch.zeros(4, 4), "step": 0}
    raydcp.load(out, second.checkpoint.path)
    assert torch.equal(out["frozen"], frozen()) and torch.equal(out["adapter"], torch.full((4, 4), 5.0))
    run = tmp_path / "incremental"
    kept = sorted(n for n in os.listdir(run) if n.startswith("raydcp-step"))
    assert len(kept) == 2  # num_to_keep: Ray Train removed the older checkpoints...
    data = run / "raydcp-data"
    committed = sorted(n for n in os.listdir(data) if (data / n / "raydcp.meta").exists())
    # ...and raydcp the data only they need, once it sees them go: the next save sweeps (Ray Train removes
    # a checkpoint some time after it registers a newer one, so the last saves' sweeps may still see it)
    assert set(kept) <= set(committed), (committed, kept)
    from raydcp.train.incremental import sweep

    sweep(str(run), kept[-1], None)  # what the run's next save does first
    committed = sorted(n for n in os.listdir(data) if (data / n / "raydcp.meta").exists())
    assert committed == kept, (committed, kept)
    # the 2-worker checkpoints' data went whole: the 3-worker ones wrote the frozen rows again (other
    # boxes), so nothing references them any more
    assert sorted(os.listdir(data)) == kept
    for name in kept:
        raydcp.load(out, str(run / name))
