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

    raydcp.prepare_group(Group("prepare-persister", 0, 1), async_save=True)
    first = persister.persister_for_this_process()
    assert ray_session.get(first.actor.ready.remote(), timeout=120) is True
    import os
    assert ray_session.get(first.actor.nice.remote()) >= os.nice(0) + 10  # yields the CPU to training
    raydcp.prepare_group(Group("prepare-persister", 0, 1), async_save=True)
    assert persister.persister_for_this_process() is first  # reused, not a second actor


@ray.remote(num_cpus=0)
class CappedRank:
    """A rank of 12 tensors of 4 KiB each (3 of them replicated), saved under an 8 KiB staging cap."""

    def __init__(self, name: str, rank: int, world: int):
        self.group = raydcp.Group(name, rank, world, timeout_s=60)
        self.rank = rank
        self.state = {f"p{k}": raydcp.Shard(torch.full((512, 2), float(10 * k + rank)), (512 * rank, 0), (512 * world, 2))
                      for k in range(9)}
        self.state.update({f"r{k}": torch.full((1024,), float(k)) for k in range(3)})

    def save(self, path: str, cap: int):
        fut = raydcp.async_save(self.state, path, group=self.group, max_staging_bytes=cap)
        for t in self.state.values():  # after the call returns: must not reach the checkpoint
            (t.tensor if isinstance(t, raydcp.Shard) else t).add_(1000)
        try:
            return fut.result(timeout=120).world_size
        except raydcp.CheckpointError as exc:
            return exc


def test_group_async_save_under_a_staging_cap_writes_in_batches_and_snapshots(ray_session, tmp_path):
    ranks = [CappedRank.remote("async-capped", r, 2) for r in range(2)]
    assert ray.get([r.save.remote(str(tmp_path / "ck"), 8 << 10) for r in ranks]) == [2, 2]
    md = raydcp.read_metadata(tmp_path / "ck")
    sizes = [f.stat().st_size for f in (tmp_path / "ck" / "data").rglob("*.bin")]
    # 21 pieces of 4 KiB (18 shards, 3 replicas written once): files of at most 2 pieces
    assert len(sizes) >= 11 and max(sizes) <= 8 << 10
    sd = {k: torch.zeros(tuple(t.shape)) for k, t in md.tensors.items()}
    raydcp.load(sd, tmp_path / "ck")
    for k in range(9):
        assert torch.equal(sd[f"p{k}"], torch.cat([torch.full((512, 2), float(10 * k + r)) for r in range(2)]))
    for k in range(3):
        assert torch.equal(sd[f"r{k}"], torch.full((1024,), float(k)))


def test_group_async_save_with_a_bad_cap_fails_at_result(ray_session, tmp_path):
    ranks = [CappedRank.remote("async-badcap", r, 2) for r in range(2)]
    out = ray.get([r.save.remote(str(tmp_path / "bad"), 10) for r in ranks])
    assert all(isinstance(e, raydcp.CheckpointError) and "at least 1 KiB" in str(e) for e in out)
    assert not (tmp_path / "bad").exists()
