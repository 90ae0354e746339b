"""SaveOptions through the Ray paths: a Ray group's async_save (the persister actor beside each
rank plans, compresses and writes with them), ShardGroup.save (every actor's save) and a
ShardGroup's N -> M load of a compressed checkpoint."""
from __future__ import annotations

import pytest
import ray
import torch

import raydcp
from raydcp.options import SaveOptions

pytestmark = pytest.mark.ray

KIB = 1 << 10


def weights(rank: int, world: int) -> dict:
    """Four 16 KiB row blocks per rank of four (64 * world, 64) float32 tensors."""
    return {f"w{k}": raydcp.Shard(torch.full((64, 64), float(10 * k + rank)), (64 * rank, 0), (64 * world, 64))
            for k in range(4)}


@ray.remote(num_cpus=0)
class Rank:
    def __init__(self, name: str, rank: int, world: int):
        self.group = raydcp.Group(name, rank, world, timeout_s=60)
        self.state = weights(rank, world)

    def async_save(self, path: str, options):
        return raydcp.async_save(self.state, path, group=self.group, options=options).result(timeout=120).files


def test_a_ray_groups_async_save_writes_with_the_save_options(ray_session, tmp_path):
    ranks = [Rank.remote("save-options-g", r, 2) for r in range(2)]
    options = SaveOptions(max_file_bytes=20 * KIB, compression="zstd")
    files = ray.get([r.async_save.remote(str(tmp_path / "ck"), options) for r in ranks])
    assert len(files[0]) == 8  # every 16 KiB piece in a file of its own (one file per piece without the cap: 2)
    assert raydcp.read_metadata(tmp_path / "ck").compressions == {"zstd": 8}
    out = {f"w{k}": torch.zeros(128, 64) for k in range(4)}
    raydcp.load(out, tmp_path / "ck")
    for k in range(4):
        assert torch.equal(out[f"w{k}"][:64], torch.full((64, 64), 10.0 * k))
        assert torch.equal(out[f"w{k}"][64:], torch.full((64, 64), 10.0 * k + 1))


def test_shard_group_save_writes_with_the_save_options(ray_session, tmp_path):
    full = {f"w{k}": torch.full((128, 64), float(k)) for k in range(4)}
    raydcp.save(full, tmp_path / "src")
    g = raydcp.ShardGroup(2, num_gpus_per_actor=0.05, timeout_s=60)
    try:
        g.load(str(tmp_path / "src"))
        assert len(g.save(str(tmp_path / "plain")).files) == 2
        md = g.save(str(tmp_path / "capped"), options=SaveOptions(max_file_bytes=20 * KIB, compression="lz4"))
        assert len(md.files) == 8 and md.compressions == {"lz4": 8}
        with pytest.raises(raydcp.CheckpointError, match="options must be a raydcp.SaveOptions"):
            g.save(str(tmp_path / "bad"), options={"max_file_bytes": 1})
        with pytest.raises(raydcp.CheckpointError, match=r"does not take SaveOptions\(survivors=True\)"):
            g.save(str(tmp_path / "bad"), options=SaveOptions(survivors=True))  # refused, not ignored
    finally:
        g.shutdown()
    three = raydcp.ShardGroup(3, num_gpus_per_actor=0.05, timeout_s=60)  # 2 -> 3 through the compressed pieces
    try:
        held = three.load(str(tmp_path / "capped")).full_state_dict()
        assert all(torch.equal(held[k], v) for k, v in full.items())
    finally:
        three.shutdown()
    out = {k: torch.zeros_like(v) for k, v in full.items()}
    raydcp.load(out, tmp_path / "capped")
    assert all(torch.equal(out[k], v) for k, v in full.items())
