"""Checksums computed while writing, and verified while reading: equal to the two-pass reference,
and any damage found whichever read path a chunk takes (batched small chunks, pooled large ones)."""
from __future__ import annotations


import pytest
import torch

import raydcp
from raydcp import CheckpointError
from raydcp.codec import block_checksums, checksum
from raydcp.engine import reads
from raydcp.metadata import BLOCK_BYTES
from raydcp.options import IOOptions, LoadOptions

MIB = 1 << 20


def odd_state():
    g = torch.Generator().manual_seed(5)
    sd = {f"small.{i}": torch.randn(i + 1, generator=g) for i in range(40)}  # packed into shared buffers
    for name, n in [("one_block", MIB), ("block_plus_one", MIB + 1), ("three_and_a_bit", 3 * MIB + 5),
                    ("past_a_write", 5 * MIB + 13), ("mid", 100_000)]:
        sd[name] = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    sd["bf16"] = torch.randn(333, 7, generator=g).to(torch.bfloat16)
    sd["transposed"] = torch.randn(64, 48, generator=g).t()  # not contiguous: written through a copy
    sd["grad"] = torch.nn.Parameter(torch.randn(17, generator=g))
    return sd


def test_checksums_written_equal_the_reference_on_odd_sizes(tmp_path):
    sd = odd_state()
    md = raydcp.save(sd, tmp_path / "ck")
    for key, tm in md.tensors.items():
        (c,) = tm.chunks
        with open(tmp_path / "ck" / c.file, "rb") as f:
            f.seek(c.byte_offset)
            data = f.read(c.nbytes)
        expected = sd[key].detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert data == expected, key
        assert c.checksum == checksum(data), key
        assert c.block_checksums == block_checksums(data, BLOCK_BYTES), key
    for name in {c.file for tm in md.tensors.values() for c in tm.chunks}:  # alignment gaps are zero
        with open(tmp_path / "ck" / name, "rb") as f:
            raw = f.read()
        used = bytearray(len(raw))
        for tm in md.tensors.values():
            for c in tm.chunks:
                if c.file == name:
                    used[c.byte_offset:c.byte_offset + c.nbytes] = b"\x01" * c.nbytes
        assert all(b == 0 for b, u in zip(raw, used) if not u)


def test_round_trip_through_every_read_path(tmp_path):
    sd = odd_state()
    raydcp.save(sd, tmp_path / "ck")
    dest = {k: torch.full_like(v.detach(), 0) for k, v in sd.items()}
    dest["grad"] = torch.nn.Parameter(torch.zeros(17))  # read straight into a parameter's memory
    dest["transposed"] = torch.zeros(64, 48).t()  # not contiguous: read, then copied in
    stats = raydcp.load(dest, tmp_path / "ck")
    assert stats.bytes_read == stats.bytes_needed
    for k, v in sd.items():
        assert torch.equal(dest[k].detach(), v.detach()), k


def flip(path, pos):
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("where", [0, 2 * MIB + 7, 5 * MIB + 12])  # first block, a middle one, the short last
def test_damage_in_any_block_of_a_large_chunk_is_found(tmp_path, where):
    several_tasks = LoadOptions(io=IOOptions(read_task_bytes=2 * BLOCK_BYTES))  # several tasks per chunk
    t = torch.randint(0, 256, (5 * MIB + 13,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    md = raydcp.save({"big": t, "other": torch.ones(3 * MIB, dtype=torch.uint8)}, tmp_path / "ck")
    (c,) = md.tensors["big"].chunks
    flip(tmp_path / "ck" / c.file, c.byte_offset + where)
    lo = where // BLOCK_BYTES * BLOCK_BYTES
    hi = min(lo + BLOCK_BYTES, c.nbytes)
    with pytest.raises(CheckpointError, match=rf"big: checksum mismatch in .* at bytes "
                                              rf"{c.byte_offset + lo}\.\.{c.byte_offset + hi}"):
        raydcp.load({"big": torch.zeros_like(t), "other": torch.zeros(3 * MIB, dtype=torch.uint8)}, tmp_path / "ck",
                    options=several_tasks)


def test_damage_to_one_of_many_small_chunks_names_it(tmp_path):
    several_batches = LoadOptions(io=IOOptions(read_batch_bytes=4096))
    sd = {f"p{i:03d}": torch.full((100 + i,), float(i)) for i in range(300)}
    md = raydcp.save(sd, tmp_path / "ck")
    c = md.tensors["p217"].chunks[0]
    flip(tmp_path / "ck" / c.file, c.byte_offset + c.nbytes - 1)
    with pytest.raises(CheckpointError, match=r"p217: checksum mismatch"):
        raydcp.load({k: torch.zeros_like(v) for k, v in sd.items()}, tmp_path / "ck", options=several_batches)
    with open(tmp_path / "ck" / c.file, "r+b") as f:  # cut the file in the middle of p217
        f.truncate(c.byte_offset + 10)
    with pytest.raises(CheckpointError, match=r"p217: .*truncated"):
        raydcp.load({k: torch.zeros_like(v) for k, v in sd.items()}, tmp_path / "ck", options=several_batches)


def test_a_partial_read_of_a_large_chunk_checks_only_the_blocks_it_reads(tmp_path):
    t = torch.arange(6 * MIB, dtype=torch.uint8).reshape(6, MIB)
    md = raydcp.save({"t": t}, tmp_path / "ck")
    (c,) = md.tensors["t"].chunks
    flip(tmp_path / "ck" / c.file, c.byte_offset + 4 * MIB + 3)  # row 4
    part = {"t": raydcp.Shard(torch.zeros(3, MIB, dtype=torch.uint8), (1, 0), (6, MIB))}
    raydcp.load(part, tmp_path / "ck", strict=False)  # rows 1-3: intact
    assert torch.equal(part["t"].tensor, t[1:4])
    part = {"t": raydcp.Shard(torch.zeros(2, MIB, dtype=torch.uint8), (3, 0), (6, MIB))}
    with pytest.raises(CheckpointError, match=rf"t: checksum mismatch .* at bytes {c.byte_offset + 4 * MIB}\."):
        raydcp.load(part, tmp_path / "ck", strict=False)


def test_reads_given_as_chunk_objects_take_the_same_paths(tmp_path, monkeypatch):
    """A plan whose reads are a plain sequence of ChunkRead (not columns) reads alike."""
    monkeypatch.setattr(reads, "_columnar_reads", lambda r, out, pool_min, compressed: None)
    sd = odd_state()
    raydcp.save(sd, tmp_path / "ck")
    dest = {k: torch.zeros_like(v.detach()) for k, v in sd.items()}
    stats = raydcp.load(dest, tmp_path / "ck")
    assert stats.bytes_read == stats.bytes_needed
    assert all(torch.equal(dest[k], v.detach()) for k, v in sd.items())
    md = raydcp.read_metadata(tmp_path / "ck")
    c = md.tensors["small.7"].chunks[0]
    flip(tmp_path / "ck" / c.file, c.byte_offset)
    with pytest.raises(CheckpointError, match=r"small\.7: checksum mismatch"):
        raydcp.load({k: torch.zeros_like(v.detach()) for k, v in sd.items()}, tmp_path / "ck")


def test_commit_builds_sorted_chunk_tables_from_records():
    from raydcp.metadata import Metadata
    from raydcp.metadata_format import decode_metadata, encode_metadata
    from raydcp.planner import TensorSpec

    from raydcp.engine.protocol import tensor_metas
    from raydcp.engine.save_records import StorageRecord
    tensors = {"w": TensorSpec("float32", (4, 2)), "b": TensorSpec("uint8", (3 * MIB,)),
               "s": TensorSpec("int64", ()), "e": TensorSpec("float32", (0, 3)), "b2": TensorSpec("uint8", (2 * MIB,))}
    records = [("w", (2, 0), (2, 2), "f1", 64, 16, 11, ()),
               ("b2", (0,), (2 * MIB,), "f1", 128, 2 * MIB, 6, (7, 8)),
               ("b", (0,), (3 * MIB,), "f0", 0, 3 * MIB, 5, (1, 2, 3)),
               ("w", (0, 0), (2, 2), "f0", 3 * MIB, 16, 12, ()),
               ("s", (), (), "f1", 0, 8, 13, ())]
    tm = tensor_metas(tensors, [StorageRecord.from_rows(records[:2]), StorageRecord.from_rows(records[2:])])
    assert list(tm) == list(tensors)
    assert [(c.offsets, c.file, c.byte_offset, c.checksum) for c in tm["w"].chunks] == [
        ((0, 0), "f0", 3 * MIB, 12), ((2, 0), "f1", 64, 11)]
    assert tm["w"].chunks[1].offsets == (2, 0)
    assert [c.block_checksums for c in tm["b"].chunks] == [(1, 2, 3)] and tm["b2"].chunks[0].block_checksums == (7, 8)
    assert [c.block_checksums for c in tm["b2"].chunks] == [(7, 8)]
    assert tm["s"].chunks[0].offsets == () and tm["s"].chunks[0].nbytes == 8 and len(tm["e"].chunks) == 0
    md = Metadata("x", 1, 0.0, tm, {})
    back = decode_metadata(encode_metadata(md))
    for k in tensors:
        assert tuple(back.tensors[k].chunks) == tuple(tm[k].chunks), k
    assert tensor_metas({"e": TensorSpec("float32", (0,))}, [])["e"].chunks == ()


@pytest.mark.parametrize("partial", [False, True])
def test_the_planners_reads_are_read_from_their_columns(tmp_path, monkeypatch, partial):
    """The load planner hands columns; reading them must not fall back to one ChunkRead per chunk."""
    got = []
    real = reads._columnar_reads
    monkeypatch.setattr(reads, "_columnar_reads", lambda r, out, *a: got.append(real(r, out, *a)) or got[-1])
    sd = {"a": torch.randn(100), "b": torch.randn(3 * MIB // 4)}
    raydcp.save(sd, tmp_path / "ck")
    if partial:  # deliveries that are parts of chunks: the columns carry their boxes
        dest = {"b": raydcp.Shard(torch.zeros(1000), (5,), (3 * MIB // 4,))}
        raydcp.load(dest, tmp_path / "ck", strict=False)
        assert torch.equal(dest["b"].tensor, sd["b"][5:1005])
    else:
        dest = {k: torch.zeros_like(v) for k, v in sd.items()}
        raydcp.load(dest, tmp_path / "ck")
        assert all(torch.equal(dest[k], v) for k, v in sd.items())
    assert got and all(g is not None for g in got)
