"""raydcp.train pieces that need no Ray Train run: TrainState and its RNG tables, the data position,
storage mapping and the callback's completeness check. One process, no Ray."""
from __future__ import annotations

import json
import random

import numpy as np
import pyarrow.fs as pafs
import pytest
import torch
import torch.nn as nn

import raydcp
import raydcp.train
from raydcp.train import TrainState, check_checkpoint, derive_seed
from raydcp.train import train_state as state_mod
from raydcp.train._context import fsspec_location


def _state(seed=7):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return TrainState(model, opt, sched, seed=seed)


def _train(state, steps):
    for _ in range(steps):
        x = torch.randn(5, 4)
        loss = state.model(x).pow(2).mean()
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        state.scheduler.step()
        state.advance(5)


def _draws():
    return [torch.rand(2).tolist(), random.random(), random.gauss(0, 1), float(np.random.rand()), float(np.random.randn())]


def test_save_and_restore_in_one_process_restores_everything_exactly(tmp_path):
    state = _state()
    state.reseed()
    _train(state, 3)
    random.gauss(0, 1)  # leave a cached gaussian in Python's generator, and one in NumPy's
    np.random.randn()
    raydcp.save({"train": state}, tmp_path / "c")
    want_draws = _draws()
    want = {k: v.clone() for k, v in state.model.state_dict().items()}
    lr = state.scheduler.get_last_lr()

    other = _state()
    _train(other, 1)  # a different state to overwrite
    md = raydcp.read_metadata(tmp_path / "c")
    other.prepare_restore(md, "train.")
    raydcp.load({"train": other}, tmp_path / "c")
    assert other.rng_restored == "exact"
    assert _draws() == want_draws
    assert (other.step, other.samples_seen, other.seed) == (3, 15, 7)
    assert other.scheduler.get_last_lr() == lr
    for k, v in other.model.state_dict().items():
        assert torch.equal(v, want[k]), k
    # the optimizer continues identically
    torch.manual_seed(1)
    _train(state, 1)
    torch.manual_seed(1)
    _train(other, 1)
    for a, b in zip(state.model.parameters(), other.model.parameters()):
        assert torch.equal(a, b)


def test_rng_is_rederived_from_seed_step_and_rank_when_the_world_size_changes(tmp_path, monkeypatch):
    state = _state()
    _train(state, 2)
    raydcp.save({"train": state}, tmp_path / "c")  # one rank

    monkeypatch.setattr(state_mod, "rank_and_world", lambda: (2, 3))  # restore as rank 2 of 3
    other = _state()
    other.prepare_restore(raydcp.read_metadata(tmp_path / "c"), "train.")
    raydcp.load({"train": other}, tmp_path / "c")  # strict: the saved RNG rows are accounted for
    assert other.rng_restored == "derived" and other.step == 2
    got = _draws()
    s = derive_seed(7, 2, 2)
    torch.manual_seed(s)
    random.seed(s)
    np.random.seed(s % 2**32)
    assert got == _draws()
    assert len({derive_seed(7, 2, r) for r in range(64)}) == 64  # ranks get distinct streams


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_batch_range_splits_each_global_batch_in_rank_order(monkeypatch, world):
    state = _state()
    state.samples_seen = 24
    parts = []
    for rank in range(world):
        monkeypatch.setattr(state_mod, "rank_and_world", lambda rank=rank: (rank, world))
        parts.append(state.batch_range(12))
    assert [i for p in parts for i in p] == list(range(24, 36))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_storage_mapping_from_pyarrow_to_fsspec(tmp_path):
    import fsspec

    assert fsspec_location(pafs.LocalFileSystem(), f"{tmp_path}/run/ckpt") == (f"{tmp_path}/run/ckpt", None)
    # an fsspec filesystem wrapped for Ray Train: raydcp writes where pyarrow looks
    pyfs = pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem("memory")))
    url, options = fsspec_location(pyfs, "/raydcp-test-bucket/run/ckpt")
    assert url.startswith("memory://")
    raydcp.save({"x": torch.ones(2)}, url, storage_options=options)
    assert pyfs.get_file_info(f"/raydcp-test-bucket/run/ckpt/{raydcp.storage.METADATA_NAME}").size > 0
    s3 = pafs.S3FileSystem(anonymous=True, region="us-east-1")
    assert fsspec_location(s3, "bucket/run/ckpt", {"anon": True}) == ("s3://bucket/run/ckpt", {"anon": True})


def test_completeness_check_names_missing_and_truncated_data(tmp_path):
    path = tmp_path / "c"
    raydcp.save({"a": torch.arange(100.0), "b": torch.ones(3, 3), "step": 4}, path)
    md, problems = check_checkpoint(str(path), world_size=1)
    assert md is not None and problems == []
    assert check_checkpoint(str(path), world_size=2)[1] == ["saved by 1 ranks, reported by 2"]
    data = sorted(p for p in path.rglob("*.bin"))
    assert data
    data[0].write_bytes(data[0].read_bytes()[:10])
    _, problems = check_checkpoint(str(path))
    assert problems and "bytes, the metadata needs" in problems[0]
    data[0].unlink()
    assert "missing" in check_checkpoint(str(path))[1][0]
    (path / raydcp.storage.METADATA_NAME).unlink()
    assert check_checkpoint(str(path)) == (None, [f"{path} is not committed (no metadata)"])


def test_save_and_restore_need_a_ray_train_worker():
    with pytest.raises(raydcp.CheckpointError, match="inside a Ray Train training function"):
        raydcp.train.save({"x": torch.ones(1)})
    with pytest.raises(raydcp.CheckpointError, match="inside a Ray Train training function"):
        raydcp.train.restore({"x": torch.ones(1)})


def test_save_on_preemption_saves_once_per_announced_event(monkeypatch):
    from ray.train import PreemptionInfo

    from raydcp.train import preemption

    calls = []
    monkeypatch.setattr(preemption, "save", lambda sd, metrics, **kw: calls.append((metrics, kw)))
    monkeypatch.setattr(preemption, "_handled", set())
    info = PreemptionInfo(deadline_ms=4_102_444_800_000, preempted_node_to_ranks={"n1": [3, 2]})
    assert not raydcp.train.save_on_preemption({}, {"loss": 1.0}, get_info=lambda: None)
    assert raydcp.train.save_on_preemption({}, {"loss": 1.0}, get_info=lambda: info)
    assert not raydcp.train.save_on_preemption({}, {"loss": 0.9}, get_info=lambda: info)  # already saved for it
    later = PreemptionInfo(deadline_ms=None, preempted_node_to_ranks={"n2": [0]})
    assert raydcp.train.save_on_preemption({}, None, get_info=lambda: later)
    (m1, kw1), (_, kw2) = calls
    assert m1 == {"loss": 1.0} and kw1["wait_registered"] is True and kw1["persist"] is True
    assert raydcp.train.save_on_preemption({}, None, get_info=lambda: PreemptionInfo(
        deadline_ms=1, preempted_node_to_ranks={"n3": [1]}), memory=True, persist=False)  # the caller decides
    assert calls.pop()[1]["persist"] is False
    assert kw1["_emergency"]["preempted_ranks"] == [2, 3] and kw1["_emergency"]["seconds_left"] > 0
    assert kw1["_emergency"]["leaving"] == {"n1": [2, 3]}  # planned around by the save (SaveOptions.leaving)
    nonce = kw2["_emergency"].pop("nonce")  # names the directory on every rank alike, one per event
    assert len(nonce) == 8 and int(nonce, 16) >= 0 and nonce != kw1["_emergency"]["nonce"]
    assert kw2["_emergency"] == {"deadline_ms": None, "preempted_ranks": [0], "seconds_left": None,
                                 "leaving": {"n2": [0]}}


def test_an_emergency_save_leaves_out_only_rng_rows_the_lost_ranks_held(monkeypatch):
    """The lost ranks' RNG rows are per rank: the emergency save goes again without the RNG (the
    resumed run re-derives it); any other key not covered fails it."""
    from ray.train import PreemptionInfo

    from raydcp.errors import StateNotCoveredError
    from raydcp.train import preemption

    state = raydcp.train.TrainState(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), 0.1))
    calls = []

    def save(sd, metrics, **kw):
        calls.append((state.save_rng, kw["_emergency"].get("rng")))
        if len(calls) == 1:
            raise StateNotCoveredError("not covered", keys=keys, lost_ranks=[3])

    monkeypatch.setattr(preemption, "save", save)
    monkeypatch.setattr(preemption, "_handled", set())
    info = PreemptionInfo(deadline_ms=None, preempted_node_to_ranks={"n": [3]})
    keys = ["train.rng.torch", "train.rng.python"]
    assert raydcp.train.save_on_preemption({"train": state}, get_info=lambda: info)
    assert calls == [(True, None), (False, "left out")] and state.save_rng  # put back after the save
    calls.clear()
    keys = ["train.rng.torch", "train.model.weight"]  # not only RNG rows: the error stands
    with pytest.raises(StateNotCoveredError):
        raydcp.train.save_on_preemption({"train": state}, get_info=lambda: PreemptionInfo(
            deadline_ms=1, preempted_node_to_ranks={"n": [3]}))
    assert calls == [(True, None)]


def _run_storage(tmp_path):
    from ray.train.v2._internal.execution.storage import StorageContext

    return StorageContext(storage_path=str(tmp_path), experiment_dir_name="run")


def test_after_exception_removes_what_ray_train_did_not_register(tmp_path):
    """...and that is not newer than the latest registered one (the survivors of a preemption may
    still be saving that one; the next attempt's restore resumes from it, or removes it if it never
    committed)."""
    from types import SimpleNamespace

    storage = _run_storage(tmp_path)
    run = tmp_path / "run"
    for name in ("raydcp-step00000001-ffffffff", "raydcp-step00000002-aaaaaaaa", "raydcp-step00000004-bbbbbbbb"):
        raydcp.save({"x": torch.ones(2)}, run / name)  # committed
    (run / "raydcp-step00000006-cccccccc" / "data").mkdir(parents=True)  # a save cut short, or not ended
    (run / "raydcp-step00000006-cccccccc" / "data" / "r0.bin").write_bytes(b"partial")
    (run / "raydcp-step00000000-99999999" / "data").mkdir(parents=True)  # an old save cut short
    (run / "checkpoint_2026-01-01_00-00-00.000000").mkdir()  # not raydcp's: left alone
    snapshot = {"checkpoint_results": [{"checkpoint_dir_name": "raydcp-step00000002-aaaaaaaa", "metrics": {}}],
                "latest_checkpoint_result": {"checkpoint_dir_name": "raydcp-step00000002-aaaaaaaa", "metrics": {}}}
    (run / "checkpoint_manager_snapshot.json").write_text(json.dumps(snapshot))

    cb = raydcp.train.RayDCPCallback()
    ctx = SimpleNamespace(run_config=SimpleNamespace(storage_context=storage))
    cb.after_exception(ctx, {1: RuntimeError("rank 1 died\nmore")})
    rec = cb.records[-1]
    assert rec["removed"] == ["raydcp-step00000000-99999999", "raydcp-step00000001-ffffffff"]
    assert (rec["ranks"], rec["errors"], rec["latest"], rec["latest_committed"]) == (
        [1], {"1": "rank 1 died"}, "raydcp-step00000002-aaaaaaaa", True)
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == [
        "checkpoint_2026-01-01_00-00-00.000000", "raydcp-step00000002-aaaaaaaa", "raydcp-step00000004-bbbbbbbb",
        "raydcp-step00000006-cccccccc"]
    assert raydcp.train.checkpoint.remove_uncommitted(storage) == ["raydcp-step00000006-cccccccc"]  # restore's
    lines = (run / raydcp.train.RECORDS_NAME).read_text().splitlines()
    assert len(lines) == 1 and '"event": "exception"' in lines[0]

    # Ray Train's list unreadable: nothing is known to be garbage (a save that never committed may
    # still be running); the next attempt's restore removes what never committed
    (run / "raydcp-step00000008-dddddddd").mkdir()
    raydcp.save({"x": torch.ones(2)}, run / "raydcp-step00000010-eeeeeeee")
    (run / "checkpoint_manager_snapshot.json").write_text("{not json")
    cb.after_exception(ctx, {0: RuntimeError("again")})
    assert cb.records[-1]["removed"] == []
    assert raydcp.train.checkpoint.remove_uncommitted(storage) == ["raydcp-step00000008-dddddddd"]
