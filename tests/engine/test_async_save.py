"""async_save: snapshot at the call, ordered saves, errors at result(), crash-safety, bounded staging.

Every test runs in both staging modes (RAYDCP_STAGING=shm and private, see raydcp.engine.staging).
"""
from __future__ import annotations

import os
import signal

import pytest
import torch

import raydcp
from raydcp import CheckpointError
from raydcp.engine import background as async_mod
from raydcp.engine import persist, procmem

MODES = ["shm", pytest.param("private", marks=pytest.mark.skipif(
    not procmem.SUPPORTED or procmem.probe() is not None, reason="no process_vm_readv from a child here"))]


@pytest.fixture(autouse=True, params=MODES)
def staging(request, monkeypatch):
    monkeypatch.setenv("RAYDCP_STAGING", request.param)
    yield request.param
    async_mod._last is None or async_mod._last.wait()


def test_the_arena_is_where_the_mode_says(tmp_path, staging):
    raydcp.async_save(state(1.0), tmp_path / "a").result(timeout=120)
    assert persist.local_persister().arena.shared == (staging == "shm")


def state(value: float, n: int = 1000):
    return {"w": torch.full((n, 10), value), "b": torch.arange(7.0) * value, "step": int(value)}


def loaded(path, n: int = 1000):
    sd = {"w": torch.zeros(n, 10), "b": torch.zeros(7), "step": -1}
    raydcp.load(sd, path)
    return sd


def test_snapshot_semantics_mutation_after_return_does_not_leak_in(tmp_path):
    sd = state(1.0)
    fut = raydcp.async_save(sd, tmp_path / "a")
    sd["w"].add_(5)
    sd["b"].mul_(0)
    md = fut.result(timeout=120)
    assert fut.done() and md.values == {"step": 1}
    got = loaded(tmp_path / "a")
    assert torch.equal(got["w"], torch.full((1000, 10), 1.0)) and torch.equal(got["b"], torch.arange(7.0))


def test_saves_stay_ordered_and_staging_memory_is_reused(tmp_path):
    futs = [raydcp.async_save(state(float(i)), tmp_path / "same") for i in range(4)]
    allocations = persist.local_persister().arena.allocations
    assert [f.result(timeout=120).values["step"] for f in futs] == [0, 1, 2, 3]
    assert loaded(tmp_path / "same")["step"] == 3
    raydcp.async_save(state(9.0), tmp_path / "again").result(timeout=120)
    assert persist.local_persister().arena.allocations == allocations  # same sizes: the arena was reused


def test_errors_surface_at_result(tmp_path):
    fut = raydcp.async_save({"bad": {1, 2}}, tmp_path / "x")
    with pytest.raises(CheckpointError, match="bad: cannot checkpoint"):
        fut.result(timeout=60)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    fut = raydcp.async_save(state(1.0), blocker / "ck")
    with pytest.raises(CheckpointError):
        fut.result(timeout=120)


def test_crash_of_the_persisting_process_keeps_the_previous_checkpoint(tmp_path):
    raydcp.async_save(state(1.0), tmp_path / "ck").result(timeout=120)
    big = {"w": torch.full((4000, 4000), 2.0), "b": torch.zeros(7), "step": 2}  # 64 MB: still writing when killed
    fut = raydcp.async_save(big, tmp_path / "ck")
    os.kill(persist.local_persister().helper.pid, signal.SIGKILL)
    with pytest.raises(CheckpointError, match="died .* committed whole .* or not at all, leaving the previous checkpoint at that path intact"):
        fut.result(timeout=120)
    got = loaded(tmp_path / "ck")
    assert got["step"] == 1 and torch.equal(got["w"], torch.full((1000, 10), 1.0))
    raydcp.async_save(state(3.0), tmp_path / "ck").result(timeout=120)  # a new helper takes over
    assert loaded(tmp_path / "ck")["step"] == 3


def test_staging_cap_stages_in_pieces(tmp_path):
    sd = {f"t{i}": torch.full((256,), float(i)) for i in range(40)}  # 40 KiB in 1 KiB pieces
    fut = raydcp.async_save(sd, tmp_path / "cap", max_staging_bytes=8 << 10)
    md = fut.result(timeout=120)
    assert persist.local_persister().arena.buffer.numel() <= 8 << 10  # the staging memory stayed under the cap
    assert len(md.files) >= 5  # written in several pieces, each under the cap
    got = {f"t{i}": torch.zeros(256) for i in range(40)}
    raydcp.load(got, tmp_path / "cap")
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    with pytest.raises(CheckpointError, match="at least 1 KiB"):
        raydcp.async_save(sd, tmp_path / "cap2", max_staging_bytes=10).result()


def test_the_persisting_process_runs_at_a_lower_cpu_priority(tmp_path):
    raydcp.async_save({"w": torch.ones(8)}, tmp_path / "nice").result(timeout=60)
    pid = persist.local_persister().helper.pid
    # 10 more than the trainer's, up to the kernel's lowest priority (19) when the trainer is niced already
    assert os.getpriority(os.PRIO_PROCESS, pid) >= min(os.getpriority(os.PRIO_PROCESS, 0) + 10, 19)
