"""async_save with a Ray group: staged into the object store, persisted by an actor beside each rank."""
from __future__ import annotations

import ray
import torch

import raydcp


@ray.remote(num_cpus=0)
class AsyncRank:
    def __init__(self, name: str, rank: int, world: int):
        self.group = raydcp.Group(name, rank, world, timeout_s=60)
        self.rank, self.world = rank, world
        self.w = torch.arange(12.0).reshape(6, 2)[rank * 3:(rank + 1) * 3].clone()

    def save(self, path: str):
        fut = raydcp.async_save({"w": raydcp.Shard(self.w, (self.rank * 3, 0), (6, 2)), "step": 1}, path,
                                group=self.group)
        self.w.add_(100)  # after the call returns: must not reach the checkpoint
        md = fut.result(timeout=120)
        return md.world_size, fut.stall_s

    def pid_of_persister(self):
        from raydcp.runtime import persister
        return persister._PROCESS_PERSISTER is not None


def test_group_async_save_snapshots_and_commits(ray_session, tmp_path):
    ranks = [AsyncRank.remote("async-g", r, 2) for r in range(2)]
    out = ray.get([r.save.remote(str(tmp_path / "ck")) for r in ranks])
    assert [o[0] for o in out] == [2, 2]
    sd = {"w": torch.zeros(6, 2), "step": 0}
    raydcp.load(sd, tmp_path / "ck")
    assert torch.equal(sd["w"], torch.arange(12.0).reshape(6, 2)) and sd["step"] == 1
    assert all(ray.get([r.pid_of_persister.remote() for r in ranks]))


def test_prepare_starts_this_process_persister_once(ray_session):
    from raydcp.group import Group
    from raydcp.runtime import persister

    Group("prepare-persister", 0, 1).prepare(async_save=True)
    first = persister.persister_for_this_process()
    assert ray_session.get(first.actor.ready.remote(), timeout=120) is True
    Group("prepare-persister", 0, 1).prepare(async_save=True)
    assert persister.persister_for_this_process() is first  # reused, not a second actor
