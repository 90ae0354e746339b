"""``group=None`` where several processes take part: a Ray Train worker uses its worker group's
Group; a torch.distributed job of several ranks is told at once what to pass. And docs/train.md's
example runs as written."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import raydcp

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(600)]


def _trainer(fn, config, workers, name, storage):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    return TorchTrainer(fn, train_loop_config=config,
                        scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 0.5}),
                        run_config=RunConfig(name=name, storage_path=storage))


def _rows(rank: int, world: int, n: int) -> range:
    per = -(-n // world)
    return range(min(rank * per, n), min((rank + 1) * per, n))


def save_without_group(config):
    import ray.train

    import raydcp

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    full = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)
    rows = _rows(rank, world, 6)
    state = {"w": raydcp.Shard(full[rows.start:rows.stop].clone(), (rows.start, 0), (6, 4)), "step": 7}
    md = raydcp.save(state, config["path"])                 # no group=: the worker group's own
    md2 = raydcp.save(state, config["path"] + "-again")     # the same Group, its next operation
    Path(config["out"], f"save-{rank}.json").write_text(json.dumps(
        {"world_size": md.world_size, "pieces": len(md.tensors["w"].chunks), "again": md2.world_size}))


def load_without_group(config):
    import ray.train

    import raydcp

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    rows = _rows(rank, world, 6)
    state = {"w": raydcp.Shard(torch.zeros(len(rows), 4), (rows.start, 0), (6, 4)), "step": 0}
    raydcp.load(state, config["path"])
    Path(config["out"], f"load-{rank}.json").write_text(json.dumps(
        {"rows": [rows.start, rows.stop], "w": state["w"].tensor.tolist(), "step": state["step"]}))


@pytest.mark.ray
def test_save_without_group_in_a_ray_train_worker_resumes_on_three(ray_session, tmp_path):
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    path, out = str(tmp_path / "ck"), tmp_path / "out"
    out.mkdir()
    config = {"path": path, "out": str(out)}
    _trainer(save_without_group, config, 2, "implicit-save", str(tmp_path / "runs")).fit()
    saved = [json.loads((out / f"save-{r}.json").read_text()) for r in range(2)]
    assert saved == [{"world_size": 2, "pieces": 2, "again": 2}] * 2  # one collective save of 2 ranks

    _trainer(load_without_group, config, 3, "implicit-load", str(tmp_path / "runs")).fit()
    full = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)
    for r in range(3):
        got = json.loads((out / f"load-{r}.json").read_text())
        start, stop = got["rows"]
        assert torch.equal(torch.tensor(got["w"]), full[start:stop]) and got["step"] == 7
    md = raydcp.read_metadata(path)
    assert md.world_size == 2 and torch.equal(_load_whole(path), full)


def _load_whole(path):
    sd = {"w": torch.zeros(6, 4), "step": 0}
    raydcp.load(sd, path)
    return sd["w"]


_DIST_SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
    import raydcp

    def run(rank, path, init):
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
        try:
            raydcp.save({"w": torch.ones(4)}, path)
            said = f"rank {rank}: saved"
        except raydcp.CheckpointError as exc:
            said = f"rank {rank}: {exc}"
        os.write(1, (said + "\\n").encode())  # one write: the two ranks share the pipe, lines must not interleave
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.start_processes(run, args=(sys.argv[1], "file://" + sys.argv[2]), nprocs=2, start_method="spawn")
""")


def test_torch_distributed_without_group_fails_at_once(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(_DIST_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "ck"), str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert len(lines) == 2, proc.stdout
    for rank, line in enumerate(lines):
        assert line.startswith(f"rank {rank}: torch.distributed is initialized (rank {rank} of 2)")
        assert "raydcp.Group(NAME, dist.get_rank(), dist.get_world_size())" in line
    assert not (tmp_path / "ck").exists()  # nothing was written


def _docs_train_example() -> str:
    text = (ROOT / "docs" / "train.md").read_text()
    return re.search(r"```python\n(.*?)```", text, flags=re.DOTALL).group(1)


@pytest.mark.ray
def test_docs_train_example_runs_as_written(ray_session, capsys):
    code = _docs_train_example()
    namespace = {"__name__": "raydcp_docs_train_example"}  # not importable: Ray pickles train_fn by value
    exec(compile(code, "docs/train.md", "exec"), namespace)
    result = namespace["result"]
    assert result.error is None
    assert result.metrics["raydcp"]["step"] == 4 and result.metrics["raydcp"]["world_size"] == 2
    printed = capsys.readouterr().out
    assert re.search(r"^4 .*/my-run/raydcp-step00000004-[0-9a-f]{8}$", printed, flags=re.MULTILINE), printed
    md = raydcp.read_metadata(result.checkpoint.path)
    keys = set(md.keys())
    assert {"train.model.0.weight", "train.model.2.bias", "train.optim.state.0.weight.exp_avg",
            "train.optim.state.2.bias.exp_avg_sq", "train.progress.step"} <= keys
    assert md.values["train.progress.step"] == 4
