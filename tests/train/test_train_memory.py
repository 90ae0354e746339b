"""raydcp.train.save(memory=True): which steps reach the run's storage, and what is recorded of the others.

The persist decision (``persist_every`` counts the run's steps, ``persist=`` decides alone) in one
process; then one run on the session's Ray instance (jobs/train_elastic.py's ``train_loop``, a
checkpoint at every step, ``persist_every=2``, the last step saved with ``persist=True``) that
stops after step 3 and is restarted under the same name for steps 4 and 5: steps 2, 4 and 5 are
persisted, 1 and 3 only reported as held in memory, and the restart resumes from memory.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import raydcp
import raydcp.train
from raydcp.train.memory_saves import should_persist


def test_persist_every_counts_the_runs_steps_and_persist_decides_alone():
    assert [s for s in range(1, 9) if should_persist(s, 3)] == [3, 6]
    assert [s for s in range(4, 9) if should_persist(s, 2)] == [4, 6, 8]  # a restart at step 4 keeps the rhythm
    assert should_persist(7, 2, persist=True) and not should_persist(8, 2, persist=False)
    assert should_persist(None, 1)  # every save: no step needed
    assert should_persist(None, 5, persist=True)
    with pytest.raises(raydcp.CheckpointError, match=r"has no step: pass step=, .*TrainState"):
        should_persist(None, 5)
    for bad in (0, -1, 2.0, True, "2"):
        with pytest.raises(raydcp.CheckpointError, match="persist_every must be an integer >= 1"):
            should_persist(4, bad)
    with pytest.raises(raydcp.CheckpointError, match="persist must be True, False or None"):
        should_persist(4, 2, persist="yes")


def test_save_refuses_a_persist_choice_it_cannot_honour_before_writing_anything(monkeypatch):
    from raydcp.train import checkpoint

    ctx = SimpleNamespace(get_world_rank=lambda: 0, get_world_size=lambda: 1, get_storage=lambda: None)
    monkeypatch.setattr(checkpoint, "_context", lambda api: ctx)  # a worker; nothing past the checks is reached
    with pytest.raises(raydcp.CheckpointError, match=r"persist=False \(keep it in the cluster's memory only\) needs "
                                                     r"memory=True"):
        raydcp.train.save({}, persist=False)
    with pytest.raises(raydcp.CheckpointError, match="persist='yes'"):
        raydcp.train.save({}, persist="yes")
    with pytest.raises(raydcp.CheckpointError, match="has no step"):
        raydcp.train.save({}, memory=True, persist_every=2)


def test_the_callback_records_a_checkpoint_held_in_memory_only(tmp_path):
    from ray.train.v2._internal.execution.storage import StorageContext

    storage = StorageContext(storage_path=str(tmp_path), experiment_dir_name="run")
    cb = raydcp.train.RayDCPCallback()
    ctx = SimpleNamespace(run_config=SimpleNamespace(storage_context=storage))
    ours = {"step": 3, "world_size": 2, "checkpoint": "raydcp-step00000003-aaaaaaaa", "mode": "memory",
            "tier": "memory", "path": "raymem://raydcp-train-run-0/raydcp-step00000003-aaaaaaaa",
            "persisted": False, "stall_seconds": 0.5, "seconds": 0.5, "bytes": 1000}
    cb.after_report(ctx, [{"loss": 1.0, "raydcp": ours}, {"loss": 1.0, "raydcp": dict(ours, seconds=1.0)}], None)
    cb.after_report(ctx, [{"loss": 1.0}], None)  # not raydcp's: nothing recorded
    (rec,) = [json.loads(line) for line in (tmp_path / "run" / raydcp.train.RECORDS_NAME).read_text().splitlines()]
    assert rec == cb.records[0]
    assert (rec["event"], rec["tier"], rec["persisted"], rec["step"], rec["checkpoint"], rec["path"]) == (
        "checkpoint", "memory", False, 3, ours["checkpoint"], ours["path"])
    assert rec["seconds"] == 1.0 and rec["bytes"] == 1000


def _records(storage: str, name: str) -> list[dict]:
    path = Path(storage, name, raydcp.train.RECORDS_NAME)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _steps_in_storage(storage: str, name: str) -> list[int]:
    from raydcp.train.memory_saves import step_of_dir

    return sorted(step_of_dir(p.name) for p in Path(storage, name).iterdir()
                  if p.is_dir() and p.name.startswith("raydcp-step"))


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_memory_run_persists_the_multiples_of_persist_every_across_a_restart_and_the_last_step(train_runs):
    import fsspec

    config = {**train_runs.base, "steps": 5, "ckpt_every": 1, "memory": True, "persist_every": 2}
    first = train_runs("memory", {**config, "stop_at": 3}, key="memory-first", num_to_keep=None)
    # Ray Train's result is its latest registered checkpoint: step 2; step 3 is in memory only
    assert Path(first.checkpoint.path).name.startswith("raydcp-step00000002-")
    assert _steps_in_storage(train_runs.storage, "memory") == [2]

    result = train_runs("memory", config, key="memory-second", num_to_keep=None)
    m = result.metrics
    assert (m["start_step"], m["resumed"], m["step"]) == (3, True, 5)  # step 3 came from the cluster's memory
    assert m["raydcp"]["tier"] == "storage" and m["raydcp"]["persisted"] and m["raydcp"]["step"] == 5
    assert Path(result.checkpoint.path).name.startswith("raydcp-step00000005-")
    assert _steps_in_storage(train_runs.storage, "memory") == [2, 4, 5]  # step 4: counted by step, not by save

    recs = [r for r in _records(train_runs.storage, "memory") if r["event"] == "checkpoint"]
    assert [(r["step"], r["tier"], r["persisted"]) for r in recs] == [
        (1, "memory", False), (2, "storage", True), (3, "memory", False), (4, "storage", True),
        (5, "storage", True)]
    assert all(r["path"].startswith("raymem://") for r in recs if r["tier"] == "memory")
    assert all(r["complete"] for r in recs if r["tier"] == "storage")

    # the step is in every checkpoint, memory ones included (TrainState's progress.step)
    mem_url = m["raydcp"]["memory_path"]
    assert Path(mem_url).name == Path(result.checkpoint.path).name
    assert raydcp.read_metadata(mem_url).values["train.progress.step"] == 5
    assert raydcp.read_metadata(result.checkpoint.path).values["train.progress.step"] == 5
    fs = fsspec.filesystem("raymem")
    fs.rm(fs._strip_protocol(mem_url.rsplit("/", 1)[0]), recursive=True)  # leave the session's memory empty
