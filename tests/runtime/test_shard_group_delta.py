"""ShardGroup delta saves with real actors: the Group is the writer of base="previous", a delta
loads onto another world size bit-exact, and ShardGroup.reshard of a delta checkpoint stands alone."""
from __future__ import annotations

import pytest
import torch

import raydcp
from raydcp import SaveOptions

from ._shards import assert_holds, bump_key

pytestmark = pytest.mark.ray


def test_group_deltas_reshard_onto_another_world_size(ray_session, tmp_path, src, full):
    two = raydcp.ShardGroup(2, num_gpus_per_actor=0.05, timeout_s=60)
    three = raydcp.ShardGroup(3, num_gpus_per_actor=0.05, timeout_s=60)
    try:
        two.load(src, layout="dim0")
        two.save(str(tmp_path / "step-1"), options=SaveOptions(base="previous"))
        two.apply(bump_key, "model.w")
        md = two.save(str(tmp_path / "step-2"), options=SaveOptions(base="previous"))
        assert set(md.references) == {"../step-1"}
        assert md.owned_bytes == full["model.w"].nbytes  # only the trained tensor was written
        expect = dict(full)
        w = full["model.w"].clone()
        w.reshape(-1).view(torch.uint8).add_(1)
        expect["model.w"] = w
        three.load(str(tmp_path / "step-2"), layout="dim1")
        assert_holds(ray_session, three, expect, "dim1")
    finally:
        two.shutdown()
        three.shutdown()
