"""async_save with a Ray group stages into a shared-memory arena kept between saves (the persister
actor maps it, then its name leaves /dev/shm), or into the object store where /dev/shm has no room
for it."""
from __future__ import annotations

import ray
import torch

import raydcp


@ray.remote(num_cpus=0)
class ArenaRank:
    def __init__(self, name: str, rank: int, world: int, shm_room: bool):
        from raydcp.runtime import persister

        if not shm_room:  # as in a container whose /dev/shm is 64 MiB
            persister._shm_room = lambda nbytes: False
        self.group = raydcp.Group(name, rank, world, timeout_s=60)
        self.rank = rank
        self.w = torch.arange(4096.0).reshape(64, 64)[rank * 32:(rank + 1) * 32].clone()

    def save(self, path: str, step: int) -> float:
        self.w.add_(step)
        fut = raydcp.async_save({"w": raydcp.Shard(self.w, (self.rank * 32, 0), (64, 64)), "step": step}, path,
                                group=self.group)
        self.w.add_(1000)  # after the call returns: must not reach the checkpoint
        fut.result(timeout=120)
        self.w.sub_(1000)
        return fut.stall_s

    def prepare(self) -> tuple[int, bool, bool]:
        """prepare_group with the state this rank will save; then :meth:`arena` (once the persister
        actor has started, as it has after a few training steps)."""
        from raydcp.runtime import persister

        raydcp.prepare_group(self.group, async_save=True,
                             state_dict={"w": raydcp.Shard(self.w, (self.rank * 32, 0), (64, 64)), "step": 0})
        ray.get(persister.persister_for_this_process().actor.ready.remote())
        return self.arena()

    def arena(self) -> tuple[int, bool, bool]:
        """How often this process's staging arena was allocated, whether it holds one now, and
        whether its name is still in /dev/shm (it must not be: a killed process would leave it)."""
        import os

        from raydcp.runtime import persister

        arena = persister.persister_for_this_process().arena
        named = arena.shm_name is not None and os.path.exists(os.path.join("/dev/shm", arena.shm_name))
        return arena.allocations, arena.buffer is not None, named


def _check(path, step_sum: int, step: int) -> None:
    sd = {"w": torch.zeros(64, 64), "step": 0}
    raydcp.load(sd, path)
    assert torch.equal(sd["w"], torch.arange(4096.0).reshape(64, 64) + step_sum) and sd["step"] == step


def test_saves_stage_into_one_shared_arena(ray_session, tmp_path):
    ranks = [ArenaRank.remote("arena-g", r, 2, True) for r in range(2)]
    for step in (1, 2):
        ray.get([r.save.remote(str(tmp_path / f"ck{step}"), step) for r in ranks])
    _check(tmp_path / "ck1", 1, 1)
    _check(tmp_path / "ck2", 3, 2)
    # allocated once and reused; its name gone from /dev/shm once the persister mapped it
    assert ray.get([r.arena.remote() for r in ranks]) == [(1, True, False), (1, True, False)]


def test_without_room_in_dev_shm_the_object_store_stages(ray_session, tmp_path):
    ranks = [ArenaRank.remote("arena-none", r, 2, False) for r in range(2)]
    ray.get([r.save.remote(str(tmp_path / "ck"), 5) for r in ranks])
    _check(tmp_path / "ck", 5, 5)
    assert ray.get([r.arena.remote() for r in ranks]) == [(0, False, False), (0, False, False)]


def test_prepare_group_with_the_state_allocates_the_arena_the_first_save_uses(ray_session, tmp_path):
    ranks = [ArenaRank.remote("arena-prepared", r, 2, True) for r in range(2)]
    # allocated at once (named until the persister has mapped it and a save took the name away)
    assert ray.get([r.prepare.remote() for r in ranks]) == [(1, True, True), (1, True, True)]
    ray.get([r.save.remote(str(tmp_path / "ck"), 3) for r in ranks])
    _check(tmp_path / "ck", 3, 3)
    assert ray.get([r.arena.remote() for r in ranks]) == [(1, True, False), (1, True, False)]
