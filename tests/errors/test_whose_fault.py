"""Messages say whose fault a failure is: the user's code on a rank, or a reader racing a writer."""
from __future__ import annotations

import pytest
import torch

import raydcp
from raydcp.engine.load import load_with
from raydcp.engine.reads import FileChunkReader
from raydcp.engine.save import save_with
from raydcp.errors import CheckpointDamagedError, CheckpointReplacedError, RankFailedError

from ..engine.helpers import run_ranks


class Scheduler:
    """A Stateful whose state_dict() fails on one rank, as user code does."""

    def __init__(self, fail: bool):
        self.fail = fail
        self.steps = 3

    def state_dict(self):
        if self.fail:
            raise ValueError("scheduler was never stepped")
        return {"steps": self.steps}

    def load_state_dict(self, sd):
        self.steps = sd["steps"]


def _state(rank: int, world: int, fail_rank: int | None) -> dict:
    return {"w": raydcp.Shard(torch.full((2, 3), float(rank)), (2 * rank, 0), (2 * world, 3)),
            "sched": Scheduler(rank == fail_rank)}


def _check_users_fault(errs: list, rank: int) -> None:
    assert all(isinstance(e, RankFailedError) for e in errs), errs
    for e in errs:
        assert e.rank == rank and e.origin == "user" and set(e.failures) == {rank}
        assert type(e.exception) is ValueError and str(e.exception) == "scheduler was never stepped"
        assert type(e.failures[rank]) is ValueError
        msg = str(e)
        assert f"raised by your code on rank {rank}" in msg and "Scheduler.state_dict()" in msg
        assert "test_whose_fault.py" in msg and "please report" not in msg and "unexpected" not in msg
        assert "state_dict" in e.traceback


def test_users_exception_on_one_rank_of_a_save_is_reported_as_the_users_on_every_rank(tmp_path):
    world = 3
    _, errs = run_ranks(world, lambda t: save_with(t, _state(t.rank, world, 1), str(tmp_path / "ck")))
    _check_users_fault(errs, 1)
    assert not (tmp_path / "ck" / "raydcp.meta").exists()


def test_users_exception_on_one_rank_of_a_load_is_reported_as_the_users_on_every_rank(tmp_path):
    world = 2
    _, errs = run_ranks(world, lambda t: save_with(t, _state(t.rank, world, None), str(tmp_path / "ck")))
    assert errs == [None, None]
    _, errs = run_ranks(world, lambda t: load_with(t, _state(t.rank, world, 0), str(tmp_path / "ck")))
    _check_users_fault(errs, 0)


def test_users_exception_without_a_group_is_reported_as_the_users(tmp_path):
    for call in (raydcp.save, lambda sd, path: raydcp.async_save(sd, path).result(timeout=60)):
        with pytest.raises(RankFailedError) as info:
            call({"sched": Scheduler(True)}, tmp_path / "ck")
        assert info.value.origin == "user" and "raised by your code on rank 0" in str(info.value)


def _save(path, value: float, n: int = 4) -> None:
    raydcp.save({f"t{i}": torch.full((64,), value + i) for i in range(n)}, path)


def test_a_load_racing_a_newer_save_says_the_checkpoint_was_replaced_not_damaged(tmp_path, monkeypatch):
    path = tmp_path / "ck"
    _save(path, 1.0)
    old_save = raydcp.read_metadata(path).save_id
    read_all = FileChunkReader._read_all

    def newer_save_commits_first(self, reads, out):  # the load was planned; a writer commits before it reads
        _save(path, 100.0)
        return read_all(self, reads, out)

    monkeypatch.setattr(FileChunkReader, "_read_all", newer_save_commits_first)
    sd = {f"t{i}": torch.zeros(64) for i in range(4)}
    with pytest.raises(CheckpointReplacedError) as info:
        raydcp.load(sd, path)
    err = info.value
    new_save = raydcp.read_metadata(path).save_id
    assert new_save != old_save and (err.read_save, err.committed_save) == (old_save, new_save)
    assert err.retriable and "replaced by a newer save" in str(err) and "load again" in str(err)
    assert "damaged" not in str(err).replace("nothing is damaged", "") and "restore" not in str(err)
    monkeypatch.undo()
    raydcp.load(sd, path)  # as the message says: loading again reads the new checkpoint
    assert torch.equal(sd["t3"], torch.full((64,), 103.0))


def test_a_missing_file_the_committed_checkpoint_still_needs_is_damage(tmp_path):
    path = tmp_path / "ck"
    _save(path, 1.0)
    md = raydcp.read_metadata(path)
    (victim,) = {c.file for c in md.tensors["t0"].chunks}
    (path / victim).unlink()
    with pytest.raises(CheckpointDamagedError) as info:
        raydcp.load({f"t{i}": torch.zeros(64) for i in range(4)}, path)
    assert not isinstance(info.value, CheckpointReplacedError)
    assert info.value.file.endswith(victim) and "is missing" in str(info.value)
