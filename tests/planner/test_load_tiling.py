"""The load's tiling check on the planner's line (``plan_load(..., tiles=)``) against the check of
every tensor on its own (``tiling_problems``), on decoded checkpoints with random damage.

A load must refuse a checkpoint whose chunks do not tile a tensor exactly, whatever it asks for,
and name the tensor; it must accept every tiled one. Tensors split along one dimension are
checked on the load planner's line, the others box by box: the cases mix both, with gaps,
overlaps, shifted pieces, pieces past the tensor's end, duplicates and empty pieces.
"""
from __future__ import annotations

import random

import pytest

from raydcp import CheckpointError
from raydcp.metadata import ChunkMeta, Metadata, TensorMeta
from raydcp.metadata_format import decode_metadata, encode_metadata
from raydcp.planner import LocalLoadPlan, ReadItem, TensorSpec, plan_load
from raydcp.planner.boxes import numel
from raydcp.planner.load import untiled_sources
from raydcp.planner.tiling import tiling_problems

from .test_planner_columns import ISZ, _along_one_dim, _damage, _tiling


def _checkpoint(rng: random.Random, one_dim: bool) -> tuple[Metadata, dict[str, TensorSpec]]:
    """A decoded checkpoint of a few tensors, each tiling maybe damaged (decoding itself refuses a
    piece past the tensor's end: such draws are drawn again)."""
    while True:
        try:
            return _draw(rng, one_dim)
        except CheckpointError:
            continue


def _draw(rng: random.Random, one_dim: bool) -> tuple[Metadata, dict[str, TensorSpec]]:
    tensors, chunks = {}, {}
    for t in range(rng.randint(1, 6)):
        shape = tuple(rng.randint(0 if rng.random() < 0.1 else 1, 7) for _ in range(rng.randint(0, 3)))
        key = f"t{t}"
        tensors[key] = TensorSpec(rng.choice(list(ISZ)), shape)
        boxes = _along_one_dim(rng, shape) if one_dim else _tiling(rng, shape)
        boxes = _damage(rng, boxes, shape) if rng.random() < 0.5 else boxes
        if rng.random() < 0.3:
            rng.shuffle(boxes)  # chunks stored out of order along the line
        chunks[key] = tuple(ChunkMeta(o, s, f"f{i % 3}", 16 * i, numel(s) * ISZ[tensors[key].dtype], 0)
                            for i, (o, s) in enumerate(boxes))
    md = Metadata("s", 1, 0.0, {k: TensorMeta(s.dtype, s.shape, chunks[k]) for k, s in tensors.items()}, {})
    return decode_metadata(encode_metadata(md)), tensors


def _whole_load(tensors: dict[str, TensorSpec], ranks: int) -> list[LocalLoadPlan]:
    """``ranks`` ranks, each asking for a few whole tensors (maybe none)."""
    out = []
    for r in range(ranks):
        items = tuple(ReadItem(k, (0,) * len(s.shape), s.shape) for k, s in tensors.items()
                      if numel(s.shape) and (r + hash(k)) % ranks == 0)
        out.append(LocalLoadPlan(r, tensors, items, ()))
    return out


@pytest.mark.parametrize("seed", range(300))
def test_the_load_refuses_exactly_the_untiled_checkpoints_and_names_them(seed):
    rng = random.Random(seed)
    md, tensors = _checkpoint(rng, one_dim=seed % 2 == 0)
    problems = tiling_problems(md.tensors)
    loads = _whole_load(tensors, rng.randint(1, 3))
    itemsizes = {k: ISZ[s.dtype] for k, s in tensors.items()}
    if problems:
        with pytest.raises(CheckpointError, match="do not cover the tensor exactly once") as info:
            plan_load(untiled_sources(md), loads, {}, itemsizes, tiles=md.tensors)
        for key in problems:
            assert key in str(info.value)
        # asking for nothing still refuses it
        with pytest.raises(CheckpointError, match="do not cover the tensor exactly once"):
            plan_load(untiled_sources(md), [LocalLoadPlan(0, tensors, (), ())], {}, itemsizes, tiles=md.tensors)
    else:
        got = plan_load(untiled_sources(md), loads, {}, itemsizes, tiles=md.tensors)
        assert got == plan_load(untiled_sources(md), loads, {}, itemsizes)


def test_a_gap_in_one_of_many_row_sharded_tensors_is_named():
    """The large case: 200 tensors of 64 row blocks each, the line check alone; one block shifted
    by a row (an overlap and a gap of the same size: the element counts still add up)."""
    tensors, chunks = {}, {}
    for t in range(200):
        shape = (64 * (1 + t % 3), 8)
        tensors[f"w{t}"] = TensorSpec("float32", shape)
        rows = shape[0] // 64
        chunks[f"w{t}"] = [ChunkMeta((i * rows, 0), (rows, 8), "f", 0, rows * 32, 0) for i in range(64)]
    chunks["w118"][40] = ChunkMeta((40 * 2 - 1, 0), (2, 8), "f", 0, 64, 0)
    md = decode_metadata(encode_metadata(Metadata("s", 1, 0.0, {k: TensorMeta(s.dtype, s.shape, tuple(chunks[k]))
                                                                 for k, s in tensors.items()}, {})))
    loads = [LocalLoadPlan(0, tensors, (ReadItem("w0", (0, 0), (64, 8)),), ())]
    with pytest.raises(CheckpointError, match=r"w118.*do not cover the tensor exactly once|"
                                              r"do not cover the tensor exactly once.*w118") as info:
        plan_load(untiled_sources(md), loads, {}, {k: 4 for k in tensors}, tiles=md.tensors)
    assert "w117" not in str(info.value) and "w119" not in str(info.value)
