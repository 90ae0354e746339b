"""Metadata whose chunks overlap and leave a gap of the same size: every element count adds up,
yet part of the tensor is stored twice and another part not at all. A load must refuse it (it
would leave the gap's old values in place) with the check ``raydcp verify`` uses."""
from __future__ import annotations

import os

import pytest
import torch

import raydcp
from raydcp import CheckpointError
from raydcp.codec import checksum, itemsize
from raydcp.metadata import ChunkMeta, Metadata, TensorMeta
from raydcp.metadata_format import encode_metadata
from raydcp.storage import CheckpointStorage
from raydcp.verify import verify_checkpoint


def _rewrite(ck, key: str, boxes: list[tuple[tuple, tuple]]) -> None:
    """Commit metadata in which ``key`` is stored as ``boxes`` of its saved whole chunk: each box
    reads the bytes where its first element lies in the saved row-major data, with a correct
    checksum, so only the tiling is wrong. Boxes are runs of whole rows (or 1-D ranges)."""
    md = raydcp.read_metadata(ck)
    t = md.tensors[key]
    whole = t.chunks[0]
    isz = itemsize(t.dtype)
    row = isz
    for s in t.shape[1:]:
        row *= s
    with open(os.path.join(ck, whole.file), "rb") as f:
        f.seek(whole.byte_offset)
        data = f.read(whole.nbytes)
    chunks = []
    for off, size in boxes:
        start, n = off[0] * row, size[0] * row
        chunks.append(ChunkMeta(off, size, whole.file, whole.byte_offset + start, n, checksum(data[start:start + n])))
    tensors = {**md.tensors, key: TensorMeta(t.dtype, t.shape, tuple(chunks))}
    CheckpointStorage(ck).commit(encode_metadata(Metadata(md.save_id, md.world_size, md.created_at, tensors,
                                                          dict(md.values))))


CASES = {
    "1-D overlap [0,5) and [2,7) of 10": ((10,), [((0,), (5,)), ((2,), (5,))]),
    "1-D duplicate row": ((10,), [((0,), (5,)), ((0,), (5,))]),
    "2-D overlap of rows": ((4, 3), [((0, 0), (2, 3)), ((1, 0), (2, 3))]),
    "2-D duplicate rows": ((4, 3), [((0, 0), (2, 3)), ((0, 0), (2, 3))]),
}


@pytest.mark.parametrize("shape,boxes", CASES.values(), ids=list(CASES))
def test_load_refuses_chunks_that_overlap_and_leave_a_gap(tmp_path, shape, boxes):
    ck = tmp_path / "ck"
    full = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).reshape(shape)
    raydcp.save({"w": full, "b": torch.ones(3)}, ck)
    _rewrite(ck, "w", boxes)
    dest = {"w": torch.full(shape, -1.0), "b": torch.zeros(3)}
    with pytest.raises(CheckpointError, match=r"damaged: the stored pieces of w do not cover the tensor exactly"):
        raydcp.load(dest, ck)
    assert (dest["w"] == -1).all()  # refused before anything was read
    # the same check is the one verify reports
    report = verify_checkpoint(ck)
    assert not report.ok and {(p.kind, p.key) for p in report.problems} == {("tiling", "w")}


def test_a_piece_of_the_tensor_loads_no_better(tmp_path):
    """Even a rank whose own piece the stored chunks cover is refused: the checkpoint is damaged."""
    ck = tmp_path / "ck"
    raydcp.save({"w": torch.arange(10.0)}, ck)
    _rewrite(ck, "w", [((0,), (5,)), ((2,), (5,))])
    head = {"w": raydcp.Shard(torch.zeros(2), (0,), (10,))}
    with pytest.raises(CheckpointError, match="stored pieces of w"):
        raydcp.load(head, ck)


def test_tiled_chunks_still_load(tmp_path):
    ck = tmp_path / "ck"
    full = torch.arange(12.0).reshape(4, 3)
    raydcp.save({"w": full}, ck)
    _rewrite(ck, "w", [((2, 0), (2, 3)), ((0, 0), (2, 3))])  # out of order, exact
    dest = {"w": torch.zeros(4, 3)}
    raydcp.load(dest, ck)
    assert torch.equal(dest["w"], full)
