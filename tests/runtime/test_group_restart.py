"""A worker group restarted with the same code and Group name (new Ray actors, the old ones killed)
saves and loads again, also after a kill -9 in the middle of an operation; two live actors calling
as one rank of one operation are still refused."""
from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
import ray
import torch

import raydcp
from raydcp.runtime import actors

pytestmark = pytest.mark.ray

WORLD = 2
ROWS = 8 // WORLD


def full(step: int) -> torch.Tensor:
    return torch.arange(16.0).reshape(8, 2) + 100 * step


@ray.remote(num_cpus=0)
class Worker:
    """One rank of a worker group: rows of an (8, 2) tensor, saved and loaded with ``Group(name, rank, 2)``."""

    def __init__(self, name: str, rank: int):
        self.rank = rank
        self.group = raydcp.Group(name, rank, WORLD, timeout_s=120)

    def pid(self) -> int:
        return os.getpid()

    def host_name(self) -> str:
        """The coordinator host's name in this process (it carries a digest of the code it loaded)."""
        return actors.host_name()

    def save(self, path: str, step: int):
        rows = slice(self.rank * ROWS, (self.rank + 1) * ROWS)
        state = {"w": raydcp.Shard(full(step)[rows].clone(), (self.rank * ROWS, 0), (8, 2)), "step": step}
        try:
            return raydcp.save(state, path, group=self.group).world_size
        except raydcp.CheckpointError as exc:
            return exc

    def load(self, path: str):
        state = {"w": raydcp.Shard(torch.zeros(ROWS, 2), (self.rank * ROWS, 0), (8, 2)), "step": None}
        raydcp.load(state, path, group=self.group)
        return state["w"].tensor, state["step"]


def uname(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def start(name: str, ranks=range(WORLD)) -> list:
    workers = [Worker.remote(name, r) for r in ranks]
    ray.get([w.pid.remote() for w in workers], timeout=300)  # started, before anything is timed
    return workers


def save(workers, path: str, step: int) -> list:
    return ray.get([w.save.remote(path, step) for w in workers], timeout=300)


def check_loads(workers, path: str, step: int) -> None:
    got = ray.get([w.load.remote(path) for w in workers], timeout=300)
    assert torch.equal(torch.cat([t for t, _ in got]), full(step)) and [s for _, s in got] == [step] * WORLD


def waiting_in(worker, name: str, op: int):
    """Whether a rank of the group's operation ``op`` waits in ``worker``'s host for the others (ask
    before the worker is busy: its calls run one at a time)."""
    host = ray.get_actor(ray.get(worker.host_name.remote(), timeout=300), namespace=actors.NAMESPACE)

    def check():
        st = ray.get(host.status.remote((name, name, op)))
        return st is not None and bool(st.get("open_rounds"))
    return check


def wait_for(cond, within_s: float = 120.0) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_a_worker_group_restarted_with_the_same_group_name_saves_and_loads_again(ray_session, tmp_path):
    name = uname("ckpt")
    old = start(name)
    assert save(old, str(tmp_path / "a"), 1) == [WORLD] * WORLD
    check_loads(old, str(tmp_path / "a"), 1)
    for w in old:
        ray.kill(w)
    new = start(name)  # the same code and Group name, in new processes
    assert save(new, str(tmp_path / "b"), 2) == [WORLD] * WORLD
    check_loads(new, str(tmp_path / "b"), 2)
    check_loads(new, str(tmp_path / "a"), 1)
    assert save(new, str(tmp_path / "c"), 3) == [WORLD] * WORLD  # and goes on


def test_a_restart_after_a_kill_9_in_the_middle_of_a_save(ray_session, tmp_path):
    name = uname("killed")
    old = start(name)
    assert save(old, str(tmp_path / "a"), 1) == [WORLD] * WORLD
    pid0 = ray.get(old[0].pid.remote())
    waiting = waiting_in(old[0], name, 1)
    in_flight = old[0].save.remote(str(tmp_path / "b"), 2)  # rank 1 does not come: rank 0 waits in it
    wait_for(waiting)
    os.kill(pid0, signal.SIGKILL)
    ray.kill(old[1])
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(in_flight, timeout=300)
    new = start(name)
    # the new ranks are not taken for second callers of the killed rank's operation, nor wait for it
    assert save(new, str(tmp_path / "c"), 3) == [WORLD] * WORLD
    check_loads(new, str(tmp_path / "c"), 3)
    assert raydcp.read_metadata(str(tmp_path / "a")).world_size == WORLD


def test_two_live_actors_calling_as_one_rank_of_one_operation_are_refused(ray_session, tmp_path):
    name = uname("twice")
    first, second = start(name, [0, 0])  # two processes, each calling as rank 0
    in_op = waiting_in(first, name, 0)
    waiting = first.save.remote(str(tmp_path / "a"), 1)
    wait_for(in_op)
    refused = ray.get(second.save.remote(str(tmp_path / "b"), 1), timeout=300)
    assert isinstance(refused, raydcp.CheckpointError), refused
    assert f"rank 0 of group '{name}' (operation 0 of this process) is refused" in str(refused)
    err = ray.get(waiting, timeout=300)  # the operation it waited in failed: never mixed with the other
    assert isinstance(err, raydcp.CheckpointError), err
    assert f"group '{name}' (operation 0): rank 0 arrived from another process" in str(err)
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").rglob("*.meta"))


def test_a_partial_restart_fails_at_once_on_both_sides(ray_session, tmp_path):
    """Only rank 1 is restarted; rank 0's process lives on and saves again: neither side waits for
    the timeout, and both errors say that a Group's ranks restart together."""
    name = uname("partial")
    old = start(name)
    assert save(old, str(tmp_path / "a"), 1) == [WORLD] * WORLD
    ray.kill(old[1])
    new1 = start(name, [1])[0]
    in_op = waiting_in(new1, name, 0)
    waiting = new1.save.remote(str(tmp_path / "b"), 2)
    wait_for(in_op)
    refused = ray.get(old[0].save.remote(str(tmp_path / "b"), 2), timeout=300)
    err = ray.get(waiting, timeout=300)
    for e in (refused, err):
        assert isinstance(e, raydcp.CheckpointError), e
        assert f"group '{name}': rank 0 still runs in a live process of the group's earlier incarnation" in str(e)
        assert "restart together" in str(e)
