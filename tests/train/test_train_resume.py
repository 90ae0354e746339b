"""raydcp.train in real TorchTrainer runs: FSDP2 on CPU workers (gloo), on the session's Ray instance.

The training function is jobs/train_elastic.py's ``train_loop`` (a tiny transformer, a
global batch of 12 split evenly, a checkpoint every 3 steps). Runs (tests/train/conftest.py):

- ``reference``: 6 steps on 2 workers, uninterrupted (num_to_keep=1, scored by loss);
- ``half``: 3 steps on 2 workers, then the same run name restarted on 3 workers: it matches
  the reference within 1e-5 (uneven FSDP2 shards: 2 -> 3);
- ``fault``: a preemption notice at step 2 (emergency checkpoint), then the preempted rank
  dies in the middle of the step-3 save; Ray Train restarts the run on 2 workers, which
  resumes from the emergency checkpoint and ends bitwise equal to the reference.

The resume on 4 workers is the elastic scale-up through an added node, in
tests/train/test_train_scaleup.py (compared with the same reference).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import raydcp
import raydcp.train
from raydcp.storage import CheckpointStorage

pytestmark = [pytest.mark.ray, pytest.mark.timeout(400)]


_TRAIN_LOOP = None  # the example's train_loop, set before fault_loop is pickled (by value)


def fault_loop(config: dict) -> None:
    """train_loop, but on the first attempt the last rank dies halfway through its second save."""
    import ray.train

    import raydcp.engine.survivors  # noqa: F401  (the emergency save writes through it)

    # the modules (raydcp.engine.save is also a function); both saves write with write_rank_files
    engines = [sys.modules["raydcp.engine.save"], sys.modules["raydcp.engine.survivors"]]
    ctx = ray.train.get_context()
    if ctx.get_world_rank() == ctx.get_world_size() - 1 and not os.path.exists(config["flag"]):
        write = engines[0].write_rank_files
        calls = []

        def write_then_die(*args, **kwargs):
            calls.append(1)
            records = write(*args, **kwargs)
            if len(calls) == 2:  # the step-3 save: this rank's data is written, nothing is committed
                Path(config["flag"]).touch()
                os._exit(1)
            return records

        for engine in engines:
            engine.write_rank_files = write_then_die
    _TRAIN_LOOP(config)


def lost_persister_loop(config: dict) -> None:
    """train_loop with async saves, but on the first attempt the last rank's persister actor is
    killed right after its first async save was handed to it (the persist dies mid-way)."""
    import ray
    import ray.train

    import raydcp.api
    from raydcp.runtime.persister import persister_for_this_process

    ctx = ray.train.get_context()
    if ctx.get_world_rank() == ctx.get_world_size() - 1 and not os.path.exists(config["flag"]):
        async_save = raydcp.api.async_save

        def save_then_lose_persister(*args, **kwargs):
            future = async_save(*args, **kwargs)
            Path(config["flag"]).touch()
            ray.kill(persister_for_this_process().actor, no_restart=True)
            return future

        raydcp.api.async_save = save_then_lose_persister
    _TRAIN_LOOP(config)


def _half(runs):
    """``half``: 3 steps on 2 workers, then the same run name restarted on 3 workers."""
    runs("half", {**runs.base, "stop_at": 3}, key="half-first-part")
    return runs("half", workers=3)


def _run_dirs(storage, name):
    return sorted(p.name for p in Path(storage, name).iterdir() if p.is_dir() and p.name.startswith("raydcp-"))


def _records(storage, name):
    return [json.loads(line) for line in Path(storage, name, raydcp.train.RECORDS_NAME).read_text().splitlines()]


def _assert_same_state(ref: dict, got: dict):
    keys = [k for k in ref if k.startswith(("train.model.", "train.optim."))]
    assert keys and keys == [k for k in got if k.startswith(("train.model.", "train.optim."))]
    for k in keys:
        if isinstance(ref[k], torch.Tensor):
            assert torch.equal(ref[k], got[k]), k
        else:
            assert ref[k] == got[k], k


# ---------------------------------------------------------------------------------------------
def test_fresh_run_checkpoints_into_run_storage_and_honours_num_to_keep(train_runs):
    result = train_runs.reference()
    m = result.metrics
    assert (m["step"], m["world_size"], m["resumed"], m["start_step"]) == (6, 2, False, 0)
    assert m["raydcp"]["step"] == 6 and m["raydcp"]["world_size"] == 2 and m["raydcp"]["bytes"] > 0

    # the checkpoint Ray Train hands out is the directory raydcp wrote: no copy elsewhere
    ckpt = result.checkpoint.path
    assert Path(ckpt).parent == Path(train_runs.storage, "reference")
    md = raydcp.read_metadata(ckpt)
    assert md.world_size == 2 and md.values["train.progress.step"] == 6
    assert md.values["train.progress.samples_seen"] == 6 * 12

    # num_to_keep=1 scored by loss: of the checkpoints at steps 3 and 6 only the best is left
    assert _run_dirs(train_runs.storage, "reference") == [Path(ckpt).name]
    assert [Path(c.path).name for c, _ in result.best_checkpoints] == [Path(ckpt).name]

    # the callback checked and recorded both
    recs = [r for r in _records(train_runs.storage, "reference") if r["event"] == "checkpoint"]
    assert [r["step"] for r in recs] == [3, 6]
    for r in recs:
        assert r["committed"] and r["complete"] and not r["problems"]
        assert r["world_size"] == 2 and r["bytes"] == md.total_bytes and r["files"] >= 1
        assert r["seconds"] > 0 and r["throughput_mb_s"] > 0 and r["emergency"] is None
        assert r["mode"] == "sync" and r["stall_seconds"] == r["persist_seconds"] == r["seconds"]


def test_same_run_restarted_on_more_workers_matches_the_uninterrupted_run(train_runs):
    ex, workers = train_runs.example, 3
    ref, result = train_runs.reference(), _half(train_runs)
    m = result.metrics
    assert (m["step"], m["world_size"], m["resumed"], m["start_step"], m["rng"]) == (6, workers, True, 3, "derived")
    assert abs(m["loss"] - ref.metrics["loss"]) <= 1e-5 * abs(ref.metrics["loss"])
    assert m["lr"] == ref.metrics["lr"]
    a, b = ex.load_full(ref.checkpoint.path), ex.load_full(result.checkpoint.path)
    assert raydcp.read_metadata(result.checkpoint.path).world_size == workers
    assert ex.max_rel_diff(a, b, "train.model.") <= 1e-5
    assert ex.max_rel_diff(a, b, "train.optim.state.") <= 1e-5
    assert b["train.progress.samples_seen"] == a["train.progress.samples_seen"] == 72
    assert b["train.scheduler.last_epoch"] == a["train.scheduler.last_epoch"] == 6
    # every rank's RNG was derived from (seed, step, rank) when it resumed at step 3
    assert m["draws"] == [train_runs.derived_draws(0, 3, r, 3) for r in range(workers)]


def test_preemption_then_a_rank_dying_mid_save_resumes_bitwise_from_the_last_good_checkpoint(train_runs, tmp_path):
    from ray import cloudpickle

    global _TRAIN_LOOP
    _TRAIN_LOOP = train_runs.example.train_loop
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ships fault_loop to the workers
    flag = str(tmp_path / "crashed")
    config = {**train_runs.base, "preempt_at": 2, "flag": flag}
    result = train_runs("fault", config, num_to_keep=None, max_failures=1, train_fn=fault_loop)
    assert os.path.exists(flag), "the fault was not injected"
    m = result.metrics
    # attempt 2 restored the emergency checkpoint (step 2), not the half-written step-3 save
    assert (m["step"], m["world_size"], m["resumed"], m["start_step"], m["rng"]) == (6, 2, True, 2, "exact")

    recs = _records(train_runs.storage, "fault")
    assert [(r["event"], r.get("step")) for r in recs] == [
        ("checkpoint", 2), ("exception", None), ("checkpoint", 3), ("checkpoint", 6)]
    emergency = recs[0]["emergency"]
    assert emergency["preempted_ranks"] == [1] and emergency["seconds_left"] > recs[0]["seconds"]
    failure = recs[1]
    # rank 1 died; rank 0 fails too when the save's coordinator was rank 1's (it died with it)
    assert 1 in failure["ranks"] and set(failure["ranks"]) <= {0, 1}
    assert failure["latest"] == recs[0]["checkpoint"] and failure["latest_committed"]
    # the half-written step-3 save is newer than the latest registered checkpoint: the callback leaves
    # it (surviving workers may still be saving it) and the next attempt's restore removes it
    assert not [n for n in failure["removed"] if n.startswith("raydcp-step00000003-")], failure
    # nothing partial is left, and every directory left is one that Ray Train registered
    dirs = _run_dirs(train_runs.storage, "fault")
    assert dirs == sorted(r["checkpoint"] for r in recs if r["event"] == "checkpoint")
    assert all(CheckpointStorage(str(Path(train_runs.storage, "fault", d))).is_committed() for d in dirs)

    # training after the restart is exactly the uninterrupted run: same world size, so bitwise
    ref = train_runs.reference()
    assert m["loss"] == ref.metrics["loss"] and m["lr"] == ref.metrics["lr"]
    assert m["draws"] == ref.metrics["draws"]  # every rank's torch/python/numpy streams continued exactly
    _assert_same_state(train_runs.example.load_full(ref.checkpoint.path),
                       train_runs.example.load_full(result.checkpoint.path))


def test_async_saves_register_only_committed_snapshots_and_resume_bitwise(train_runs):
    """async_save=True: 3 steps (the step-3 save persists while the training function ends; staged
    in batches under a 16 KiB cap per node), then the same run restarted on 2 workers resumes from
    it and checkpoints asynchronously again (no cap)."""
    config = {**train_runs.base, "async_save": True}
    first = train_runs("async", {**config, "stop_at": 3, "max_staging_bytes": 16 << 10}, key="async-first-part",
                       num_to_keep=None)
    # Ray Train waited for the persist when the training function returned, then registered it
    assert first.checkpoint is not None and first.metrics["raydcp"]["mode"] == "async"
    first_md = raydcp.read_metadata(first.checkpoint.path)
    assert first_md.values["train.progress.step"] == 3
    assert len(first_md.files) > 2  # under the cap: files of at most 8 KiB per rank, written in batches
    result = train_runs("async", config, num_to_keep=None)
    m = result.metrics
    assert (m["step"], m["world_size"], m["resumed"], m["start_step"], m["rng"]) == (6, 2, True, 3, "exact")

    ref = train_runs.reference()
    assert m["loss"] == ref.metrics["loss"] and m["lr"] == ref.metrics["lr"]
    _assert_same_state(train_runs.example.load_full(ref.checkpoint.path),
                       train_runs.example.load_full(result.checkpoint.path))

    recs = [r for r in _records(train_runs.storage, "async") if r["event"] == "checkpoint"]
    assert [r["step"] for r in recs] == [3, 6]
    for r in recs:
        assert r["mode"] == "async" and r["committed"] and r["complete"] and not r["problems"]
        assert 0 < r["stall_seconds"] <= r["seconds"] and r["persist_seconds"] > 0
        assert r["persist_seconds"] <= r["seconds"]
    # every directory is a registered, committed checkpoint; each holds the step it was saved at
    dirs = _run_dirs(train_runs.storage, "async")
    assert dirs == sorted(r["checkpoint"] for r in recs)
    for r, d in zip(recs, dirs):
        assert raydcp.read_metadata(str(Path(train_runs.storage, "async", d))).values["train.progress.step"] == r["step"]


def test_a_persist_that_dies_fails_the_run_and_the_restart_never_sees_its_checkpoint(train_runs, tmp_path):
    from ray import cloudpickle

    global _TRAIN_LOOP
    _TRAIN_LOOP = train_runs.example.train_loop
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    flag = str(tmp_path / "persister-killed")
    config = {**train_runs.base, "async_save": True, "flag": flag}
    result = train_runs("async-fault", config, num_to_keep=None, max_failures=1, train_fn=lost_persister_loop)
    assert os.path.exists(flag), "the fault was not injected"
    m = result.metrics
    # the step-3 save never committed, so attempt 2 found no checkpoint and started afresh
    assert (m["step"], m["world_size"], m["resumed"], m["start_step"]) == (6, 2, False, 0)

    recs = _records(train_runs.storage, "async-fault")
    assert [(r["event"], r.get("step")) for r in recs] == [("exception", None), ("checkpoint", 3), ("checkpoint", 6)]
    assert "persister actor died" in " ".join(recs[0]["errors"].values())
    assert recs[0]["latest"] is None
    # whatever attempt 1 left of its step-3 save is gone: only the registered checkpoints remain
    dirs = _run_dirs(train_runs.storage, "async-fault")
    assert dirs == sorted(r["checkpoint"] for r in recs[1:])
    assert all(CheckpointStorage(str(Path(train_runs.storage, "async-fault", d))).is_committed() for d in dirs)
    ref = train_runs.reference()
    assert m["loss"] == ref.metrics["loss"]
    _assert_same_state(train_runs.example.load_full(ref.checkpoint.path),
                       train_runs.example.load_full(result.checkpoint.path))
