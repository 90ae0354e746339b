"""ShardGroup.reshard keeps the source group's actors where their new pieces already are.

Its own module: the 2 -> 4 reshard takes all 4 of the session's logical GPUs, so no
other group may hold any (the pool of test_shard_group.py ends with its module).
"""
from __future__ import annotations

import pytest
import torch

import raydcp
from raydcp.errors import CheckpointError

from ._shards import assert_holds, same_bits

pytestmark = pytest.mark.ray


def _ids(handles) -> list[str]:
    return [h._actor_id.hex() for h in handles]


def _alive(ray, handles) -> list[bool]:
    out = []
    for h in handles:
        try:
            ray.get(h.info.remote(), timeout=30)
            out.append(True)
        except ray.exceptions.RayActorError:
            out.append(False)
    return out


def test_reshard_keeps_the_actors_holding_their_new_pieces(ray_session, src, full):
    from raydcp.planner.layouts import reuse_ranks

    # 2 -> 4 with a GPU each: the session's 4 GPUs are enough only because the reshard adds
    # 2 actors, not 4 beside the 2 it has.
    g = raydcp.ShardGroup(2, num_gpus_per_actor=1, timeout_s=30).load(src, layout="dim0")
    try:
        big = g.reshard(4)
        specs = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in full.items()
                 if isinstance(v, torch.Tensor)}
        reuse = reuse_ranks(specs, "dim0", 2, "dim0", 4)
        assert sorted(i for i in reuse if i is not None) == [0, 1]
        assert [_ids(big.actors)[j] for j, i in enumerate(reuse) if i is not None] == \
            [_ids(g.actors)[i] for i in reuse if i is not None]
        added = [h for j, h in enumerate(big.actors) if reuse[j] is None]
        assert not set(_ids(added)) & set(_ids(g.actors))
        assert_holds(ray_session, big, full, "dim0")
        assert_holds(ray_session, g, full, "dim0")  # both groups hold their own pieces, in the same actors
        small = big.reshard(3, layout="dim1")  # shrinking: 3 of the 4 stay, none added
        assert set(_ids(small.actors)) < set(_ids(big.actors))
        assert_holds(ray_session, small, full, "dim1")
        everyone = g.actors + added
        g.shutdown()
        big.shutdown()
        # only the actors the last group still uses live on; it works without the others
        assert _alive(ray_session, everyone) == [h in set(_ids(small.actors)) for h in _ids(everyone)]
        got = small.full_state_dict()
        assert all(same_bits(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v for k, v in full.items())
        small.shutdown()
        assert _alive(ray_session, everyone) == [False] * len(everyone)
    finally:
        g.shutdown()


def test_prepare_reshard_starts_the_added_actors_ahead(ray_session, src, full):
    g = raydcp.ShardGroup(2, num_gpus_per_actor=0, timeout_s=30).load(src, layout="dim0")
    try:
        assert g.prepare_reshard(3) is g
        spares = [m.handle for m in g._spares]
        assert len(spares) == 1 and _alive(ray_session, spares) == [True]  # up before the reshard
        ray_session.get(g._prepared)  # every actor of the reshard allocated its new pieces
        new = g.reshard(3)
        assert set(_ids(spares)) <= set(_ids(new.actors)) and not g._spares
        assert_holds(ray_session, new, full, "dim0")
        new.shutdown()
        g.prepare_reshard(3, layout="dim1")  # pieces prepared for columns, used for rows: new ones
        new = g.reshard(3)
        assert_holds(ray_session, new, full, "dim0")
        new.shutdown()
        g.prepare_reshard(5)  # never used: ends with the group
        spares = [m.handle for m in g._spares]
        assert len(spares) == 3
    finally:
        g.shutdown()
    assert _alive(ray_session, spares) == [False] * 3
    with raydcp.ShardGroup(1, num_gpus_per_actor=0) as empty:
        with pytest.raises(CheckpointError, match="holds no state"):
            empty.prepare_reshard(2)
