"""A survivors save (``SaveOptions(survivors=True)``) commits without ranks whose actor dies before or
during it, where the others hold every piece (replicated state); with state only a lost rank held
it commits nothing and names the keys and ranks; a rank that raises still fails every rank."""
from __future__ import annotations

import threading
import uuid

import pytest
import ray
import torch

import raydcp
from raydcp.engine.survivors import lost_ranks

pytestmark = pytest.mark.ray

WORLD = 4
KEYS = [f"layer{i}" for i in range(8)]  # replicas of several tensors: the plan spreads their writers


def replicated(step: int) -> dict:
    return {**{k: torch.full((4, 4), float(i + 100 * step)) for i, k in enumerate(KEYS)}, "step": step}


@ray.remote(num_cpus=0, max_concurrency=2)
class Worker:
    """One rank; each test's group has a name of its own (the survivors serve every test, a new
    actor is the rank that dies)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.holding = threading.Event()

    def save(self, name: str, path: str, step: int, *, survivors: bool = True, sharded: bool = False,
             bad: bool = False, hold: bool = False, leaving: dict | None = None):
        if sharded:
            state = {"w": raydcp.Shard(torch.full((2, 4), float(self.rank + 100 * step)), (2 * self.rank, 0),
                                       (2 * WORLD, 4)), "step": step}
        else:
            state = replicated(step)
        if bad:
            state["bad"] = object()
        if hold:  # this rank stops (until it is killed) once it has its plan, before it writes
            import raydcp.engine.survivors as engine

            def stop(*args, **kwargs):
                self.holding.set()
                threading.Event().wait()

            engine.write_rank_files = stop
        group = raydcp.Group(name, self.rank, WORLD, timeout_s=60)
        try:
            return raydcp.save(state, path, group=group,
                               options=raydcp.SaveOptions(survivors=survivors, leaving=leaving))
        except raydcp.CheckpointError as exc:
            return exc

    def wait_holding(self, timeout_s: float) -> bool:
        return self.holding.wait(timeout_s)

    def ready(self) -> bool:
        return True


@pytest.fixture(scope="module")
def survivors(ray_session):
    workers = [Worker.remote(r) for r in range(WORLD - 1)]
    yield workers
    for w in workers:
        ray.kill(w)


@pytest.fixture
def group(survivors):
    """(the group's name, its workers: the module's survivors and a new rank 3)"""
    victim = Worker.remote(WORLD - 1)
    ray.get([w.ready.remote() for w in (*survivors, victim)])  # started: the saves' waits are not for a start
    return f"survivors-{uuid.uuid4().hex[:8]}", [*survivors, victim]


def saves(group, path, step, **kw) -> list:
    name, workers = group
    return [w.save.remote(name, path, step, **kw) for w in workers]


def save_holding(group, path, step, kill=True, **kw) -> list:
    """Ranks 0-2 save, rank 3 stops once it has its plan (and is killed there)."""
    name, workers = group
    refs = [w.save.remote(name, path, step, **kw) for w in workers[:3]]
    workers[3].save.remote(name, path, step, hold=True, **kw)
    assert ray.get(workers[3].wait_holding.remote(60))
    if kill:
        ray.kill(workers[3])
    return refs


def test_replicated_state_commits_without_a_rank_killed_during_the_save(group, tmp_path):
    path = str(tmp_path / "ckpt")
    out = ray.get(save_holding(group, path, 2), timeout=120)
    for md in out:
        assert isinstance(md, raydcp.Metadata), md
    assert lost_ranks(out[0]) == [3] and out[0].world_size == WORLD
    md = raydcp.read_metadata(path)
    assert md.save_id == out[0].save_id and lost_ranks(md) == [3]
    state = {k: torch.zeros(4, 4) for k in KEYS} | {"step": None}
    raydcp.load(state, path)
    assert state["step"] == 2
    for k, v in replicated(2).items():
        if k != "step":
            assert torch.equal(state[k], v), k


def test_a_rank_announced_to_go_writes_nothing_and_the_commit_does_not_wait_for_it(group, tmp_path):
    path = str(tmp_path / "ckpt")
    leaving = {"node-b": [3]}  # a preemption notice's ranks: rank 3 stops after its plan, alive
    out = ray.get(save_holding(group, path, 2, leaving=leaving, kill=False), timeout=120)
    for md in out:
        assert isinstance(md, raydcp.Metadata), md
    assert lost_ranks(out[0]) == [3]  # committed without it, while it lives
    ray.kill(group[1][3])
    state = {k: torch.zeros(4, 4) for k in KEYS} | {"step": None}
    raydcp.load(state, path)
    assert state["step"] == 2 and all(torch.equal(state[k], replicated(2)[k]) for k in KEYS)


def test_a_rank_dead_before_the_save_is_left_out_at_once(group, tmp_path):
    path = str(tmp_path / "ckpt")
    assert all(isinstance(m, raydcp.Metadata) for m in ray.get(saves(group, path, 1, survivors=False)))
    ray.kill(group[1][3])  # its process is known to the group from the save above
    out = ray.get(saves((group[0], group[1][:3]), path, 2), timeout=120)
    assert all(isinstance(m, raydcp.Metadata) for m in out), out
    assert lost_ranks(raydcp.read_metadata(path)) == [3]
    state = {k: torch.zeros(4, 4) for k in KEYS} | {"step": None}
    raydcp.load(state, path)
    assert state["step"] == 2 and torch.equal(state["layer7"], replicated(2)["layer7"])


def test_state_held_only_by_the_lost_rank_commits_nothing_and_is_named(group, tmp_path):
    path = str(tmp_path / "ckpt")
    assert all(isinstance(m, raydcp.Metadata) for m in ray.get(saves(group, path, 1, sharded=True, survivors=False)))
    ray.kill(group[1][3])
    out = ray.get(saves((group[0], group[1][:3]), path, 2, sharded=True), timeout=120)
    for err in out:
        assert isinstance(err, raydcp.StateNotCoveredError), err
        assert err.keys == ("w",) and err.lost_ranks == (3,)
        assert "rank 3" in str(err) and "w:" in str(err) and "24 of its 32 elements" in str(err)
    md = raydcp.read_metadata(path)  # the previous checkpoint is still the one committed
    assert md.values["step"] == 1 and lost_ranks(md) == []


def test_a_writer_lost_after_the_plan_whose_keys_no_survivor_holds_is_named(group, tmp_path):
    path = str(tmp_path / "ckpt")
    for err in ray.get(save_holding(group, path, 2, sharded=True), timeout=120):
        assert isinstance(err, raydcp.StateNotCoveredError), err
        assert err.keys == ("w",) and err.lost_ranks == (3,)
    assert not (tmp_path / "ckpt").exists() or not raydcp.storage.CheckpointStorage(path).is_committed()


def test_a_rank_that_raises_still_fails_every_rank(group, tmp_path):
    path = str(tmp_path / "ckpt")
    name, workers = group
    out = ray.get([w.save.remote(name, path, 1, bad=r == 2) for r, w in enumerate(workers)], timeout=120)
    for err in out:
        assert isinstance(err, raydcp.CheckpointError) and not isinstance(err, raydcp.RanksLostError), err
        assert "bad" in str(err)
    with pytest.raises(raydcp.CheckpointNotFoundError):
        raydcp.read_metadata(path)
