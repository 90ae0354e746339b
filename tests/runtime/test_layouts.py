"""Layouts and placement planning of ShardGroup, as pure functions (no Ray started)."""
from __future__ import annotations

import pytest
import torch

from raydcp.errors import CheckpointError
from raydcp.planner.layouts import piece_box
from raydcp.runtime.shard_group.piece_tensors import empty_state, take_piece
from raydcp.runtime.shard_group.group import plan_placement
from raydcp.state import Shard


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("shape", [(7, 5), (5,), (2, 9, 3), (0, 4), (1, 1)])
def test_dim0_matches_torch_chunk_and_tiles(shape, world):
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    chunks = list(torch.chunk(full, world, dim=0)) if shape[0] else []
    rows = 0
    for r in range(world):
        offsets, sizes = piece_box(shape, "dim0", r, world)
        assert offsets[1:] == (0,) * (len(shape) - 1) and sizes[1:] == shape[1:]
        assert offsets[0] == min(rows, shape[0])
        expect = chunks[r] if r < len(chunks) else full[shape[0]:]  # trailing ranks: empty pieces
        assert torch.equal(take_piece(full, "dim0", r, world).tensor, expect)
        rows += sizes[0]
    assert rows == shape[0]


def test_dim1_and_fallbacks():
    assert piece_box((4, 10), "dim1", 1, 3) == ((0, 4), (4, 4))
    assert piece_box((4, 10), "dim1", 2, 3) == ((0, 8), (4, 2))
    assert piece_box((10,), "dim1", 2, 3) == ((8,), (2,))  # 1-D: along dim 0
    assert piece_box((), "dim0", 0, 3) is None  # scalars: replicated
    assert piece_box((4, 10), "replicated", 2, 3) is None
    with pytest.raises(CheckpointError, match="unknown layout"):
        piece_box((4,), "dim2", 0, 1)


def test_empty_state():
    specs = {"w": ((5, 3), "float32"), "s": ((), "int64"), "h": ((4,), "bfloat16")}
    st = empty_state(specs, ["step", "cfg.lr"], "dim0", 1, 2)
    assert isinstance(st["w"], Shard) and st["w"].offsets == (3, 0) and tuple(st["w"].tensor.shape) == (2, 3)
    assert st["w"].global_shape == (5, 3) and st["h"].tensor.dtype == torch.bfloat16
    assert isinstance(st["s"], torch.Tensor) and st["s"].shape == () and st["s"].dtype == torch.int64
    assert st["step"] is None and st["cfg.lr"] is None
    whole = empty_state(specs, [], "replicated", 0, 1)
    assert tuple(whole["w"].shape) == (5, 3)


def test_placement_without_gpus_falls_back_to_cpu_actors():
    bundles, gpus, note = plan_placement({"CPU": 8.0}, 3, 1, 0)
    assert gpus == 0 and "no GPU resources" in note and "3 CPU actors" in note
    assert bundles == [{"CPU": 0.001}] * 3


def test_placement_with_gpus():
    assert plan_placement({"CPU": 8.0, "GPU": 4.0}, 4, 1, 0) == ([{"GPU": 1}] * 4, 1, None)
    assert plan_placement({"GPU": 4.0}, 6, 0.5, 2)[0] == [{"GPU": 0.5, "CPU": 2}] * 6
    assert plan_placement({"GPU": 4.0}, 2, 0, 0)[:2] == ([{"CPU": 0.001}] * 2, 0)
    with pytest.raises(CheckpointError, match=r"needs 6 GPUs but the Ray cluster has 4.*num_gpus_per_actor <= 0.666667"):
        plan_placement({"GPU": 4.0}, 6, 1, 0)


def test_reuse_ranks_keeps_the_pieces_in_place():
    from raydcp.planner.layouts import reuse_ranks

    specs = {f"t{i}": ((2048, 1024), "float32") for i in range(4)}
    # 4 -> 6 along rows: old rank 1 holds new rank 2's rows, old 2 new 3's, old 3 new 5's
    assert reuse_ranks(specs, "dim0", 4, "dim0", 6) == [0, None, 1, 2, None, 3]
    assert reuse_ranks(specs, "dim0", 6, "dim0", 4) == [0, 2, 3, 5]  # shrinking: 4 of the 6 stay
    assert reuse_ranks(specs, "dim0", 4, "dim0", 4) == [0, 1, 2, 3]
    assert reuse_ranks(specs, "dim0", 2, "dim1", 3).count(None) == 1  # rows -> columns: any two, one added
    assert reuse_ranks(specs, "replicated", 3, "dim0", 2) in ([0, 1], [0, 2], [1, 2], [1, 0], [2, 0], [2, 1])
    # halving pieces: each old rank keeps the first half of its rows (ties go to the nearer rank)
    mixed = {"big": ((600, 10), "float64"), "small": ((4, 6), "float32")}
    assert reuse_ranks(mixed, "dim0", 3, "dim0", 6) == [0, None, 1, None, 2, None]
    # bytes decide: a big tensor split by rows outweighs a small one split by columns
    assert reuse_ranks({"big": ((90, 4), "float64"), "small": ((4, 30), "float32")}, "dim0", 3, "dim1", 3) == [0, 1, 2]
    assert reuse_ranks({"big": ((90, 4), "float64"), "small": ((4, 30), "float32")}, "dim1", 3, "dim0", 3) == [0, 1, 2]
    assert reuse_ranks({}, "dim0", 2, "dim0", 3).count(None) == 1  # nothing held: any assignment
    with pytest.raises(CheckpointError, match="unknown layout"):
        reuse_ranks(specs, "rows", 2, "dim0", 3)


def test_shard_actor_prepares_pieces_and_drops_them_with_the_group():
    from raydcp.runtime.shard_group.actor import ShardActor

    actor = ShardActor(0, 2)  # the plain class: no Ray
    specs = {"w": ((6, 4), "float32"), "s": ((), "int64")}
    actor.prepare_receive("g1", 1, 3, specs, ["step"], "dim0")
    key, state = actor._prepared["g1"]
    assert key[:3] == (1, 3, "dim0") and state["w"].offsets == (2, 0) and state["step"] is None
    assert int(state["w"].tensor.count_nonzero()) == 0  # touched: zeroed ahead of the reshard
    actor.drop("g1")
    assert "g1" not in actor._prepared
