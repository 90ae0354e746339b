"""FSDP2 + AdamW as Module/Optimizer leaves, N=2 ranks -> M=3 ranks: real torch.distributed (gloo)
in Ray actors."""
from __future__ import annotations

import pytest
import torch

from tests.state._fsdp_ranks import FsdpRank, free_port

pytestmark = pytest.mark.ray

# Each rank's save and load back with its Group, as a training loop writes them.
GROUP_SAVE = """
group = raydcp.Group("fsdp-save", rank, world_size, timeout_s=600)
raydcp.save(state_dict, path, group=group)
raydcp.load(state_dict, path, group=group)
"""


def _world(ray, n: int, seed: int):
    actors = [ray.remote(num_cpus=0.1)(FsdpRank).remote() for _ in range(n)]
    port = free_port()
    ray.get([a.setup.remote(r, n, port, seed) for r, a in enumerate(actors)], timeout=180)
    return actors


def _gathered(ray, actors):
    got = ray.get([a.gathered.remote() for a in actors], timeout=120)
    for other in got[1:]:  # a whole tensor is the same on every rank
        assert other.keys() == got[0].keys() and all(torch.equal(other[k], got[0][k]) for k in other)
    return got[0]


def test_fsdp2_adamw_saved_by_2_ranks_loads_onto_3_fresh_ranks(ray_session, tmp_path):
    ray = ray_session
    src = _world(ray, 2, seed=0)
    dst = []
    try:
        ray.get([a.train.remote(3) for a in src], timeout=120)
        want = _gathered(ray, src)
        assert sum(k.endswith("/exp_avg") for k in want) == 8  # every parameter has its moments
        path = str(tmp_path / "fsdp")
        ray.get([a.run_snippet.remote(GROUP_SAVE, path) for a in src], timeout=180)
        assert _gathered(ray, src).keys() == want.keys()  # the snippet's load back changed nothing
        for k, v in _gathered(ray, src).items():
            assert torch.equal(v, want[k]), k

        dst = _world(ray, 3, seed=1)  # other initial weights, a fresh AdamW (no step taken)
        before = _gathered(ray, dst)
        assert not any("/" in k for k in before)  # no optimizer state yet
        assert any(not torch.equal(before[k], want[k]) for k in before)
        stats = ray.get([a.load.remote(path, "fsdp-load-m3") for a in dst], timeout=180)
        assert all(not skipped for _, skipped in stats) and sum(n for n, _ in stats) > 0
        got = _gathered(ray, dst)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    finally:
        for a in src + dst:
            try:
                ray.get(a.shutdown.remote(), timeout=30)
            except Exception:
                pass
            ray.kill(a)
