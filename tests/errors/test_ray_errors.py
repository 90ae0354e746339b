"""Typed errors across Ray actors: a rank's own exception reaches every rank with its type and origin."""
from __future__ import annotations

import pytest
import ray
import torch

import raydcp
from raydcp.errors import RankFailedError, StateMismatchError

pytestmark = pytest.mark.ray


class Broken:
    def state_dict(self):
        raise KeyError("ema_decay")

    def load_state_dict(self, sd):
        pass


@ray.remote(num_cpus=0)
class Rank:
    def __init__(self, name: str, rank: int, world: int):
        self.group = raydcp.Group(name, rank, world, timeout_s=60)
        self.rank, self.world = rank, world

    def save(self, path: str, broken_rank: int | None, shape=(4,)):
        state = {"w": raydcp.Shard(torch.ones(shape), (shape[0] * self.rank,), (shape[0] * self.world,))}
        if self.rank == broken_rank:
            state["ema"] = Broken()
        try:
            raydcp.save(state, path, group=self.group)
        except raydcp.CheckpointError as exc:
            return exc  # travels back to the driver through Ray's pickling
        return None


def test_users_exception_on_a_ray_rank_reaches_every_rank_as_the_users(ray_session, tmp_path):
    ranks = [Rank.remote("errors-user", r, 3) for r in range(3)]
    errs = ray.get([r.save.remote(str(tmp_path / "ck"), 2) for r in ranks])
    for e in errs:
        assert isinstance(e, RankFailedError) and e.rank == 2 and e.origin == "user"
        assert type(e.exception) is KeyError and e.exception.args == ("ema_decay",)
        assert set(e.failures) == {2} and type(e.failures[2]) is KeyError
        assert "raised by your code on rank 2" in str(e) and "please report" not in str(e)
        assert "test_ray_errors.py" in e.traceback and "raise KeyError(\"ema_decay\")" in e.traceback


def test_ranks_disagreeing_on_a_shape_fail_with_a_state_mismatch_on_every_rank(ray_session, tmp_path):
    ranks = [Rank.remote("errors-mismatch", r, 2) for r in range(2)]
    # each rank says a different global shape for "w"
    errs = ray.get([ranks[r].save.remote(str(tmp_path / "ck"), None, (4 + r,)) for r in range(2)])
    for e in errs:
        assert isinstance(e, StateMismatchError) and "w" in e.shapes
        assert set(e.shapes["w"]) == {(8,), (10,)}
