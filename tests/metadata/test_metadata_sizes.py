"""Hostile sizes in metadata: every size computed from it (elements, bytes, byte ranges) must fit
in an int64 and agree with what the chunk records, and dimensions must not be negative; anything
else is a CheckpointError naming the key, raised while the metadata is decoded (before any
allocation or loop over the sizes)."""
from __future__ import annotations

import pytest
import torch

import raydcp
from raydcp import CheckpointError
from raydcp.metadata import ChunkMeta, Metadata, TensorMeta
from raydcp.metadata_format import decode_metadata, encode_metadata
from raydcp.storage import CheckpointStorage
from raydcp.verify import verify_checkpoint


def _md(tensors: dict) -> Metadata:
    return Metadata("s", 1, 0.0, tensors, {})


def _commit(tmp_path, md: Metadata):
    ck = tmp_path / "ck"
    raydcp.save({"other": torch.ones(2)}, ck)
    CheckpointStorage(ck).commit(encode_metadata(md))
    return ck


def test_element_count_times_itemsize_overflowing_int64_is_refused(tmp_path):
    # 2**60 complex128 elements are 2**64 bytes: in int64 arithmetic, 0 -- the recorded nbytes
    huge = _md({"x": TensorMeta("complex128", (1 << 60,), (ChunkMeta((0,), (1 << 60,), "data/f.bin", 0, 0, 0),))})
    with pytest.raises(CheckpointError, match=r"'x'.*more than a 64-bit size"):
        decode_metadata(encode_metadata(huge))
    ck = _commit(tmp_path, huge)
    with pytest.raises(CheckpointError, match="'x'"):
        raydcp.read_metadata(ck)
    report = verify_checkpoint(ck)
    assert not report.ok and report.problems[0].kind == "metadata" and "'x'" in str(report.problems[0])


@pytest.mark.parametrize("shape", [(-3,), (4, -1), (0, -5)])
def test_negative_dimensions_are_refused(tmp_path, shape):
    md = _md({"neg": TensorMeta("float32", shape, ())})
    with pytest.raises(CheckpointError, match=r"'neg' has a negative dimension"):
        decode_metadata(encode_metadata(md))
    with pytest.raises(CheckpointError, match="'neg'"):
        raydcp.read_metadata(_commit(tmp_path, md))


def test_a_byte_range_past_int64_is_refused():
    chunk = ChunkMeta((0,), (10,), "data/f.bin", (1 << 63) - 8, 40, 0)
    with pytest.raises(CheckpointError, match=r"chunk of 'w' at \(0,\) has a byte range"):
        decode_metadata(encode_metadata(_md({"w": TensorMeta("float32", (10,), (chunk,))})))


def test_nbytes_that_disagrees_with_the_sizes_is_named():
    chunk = ChunkMeta((0,), (10,), "data/f.bin", 0, 39, 0)
    with pytest.raises(CheckpointError, match=r"chunk of 'w' at \(0,\) records 39 bytes, but its sizes \[10\]"):
        decode_metadata(encode_metadata(_md({"w": TensorMeta("float32", (10,), (chunk,))})))


def test_large_sizes_that_fit_still_decode():
    n = 1 << 33  # 32 GiB of float32: large, but every size fits in an int64
    blocks = tuple([0] * -(-(4 * n) // (1 << 20)))
    md = _md({"big": TensorMeta("float32", (n, 1), (ChunkMeta((0, 0), (n, 1), "data/f.bin", 0, 4 * n, 0, blocks),)),
              "u8": TensorMeta("uint8", ((1 << 62) + 5,), ())})
    out = decode_metadata(encode_metadata(md))
    assert out.tensors["big"].chunks[0].nbytes == 4 * n and out.tensors["u8"].shape == ((1 << 62) + 5,)
