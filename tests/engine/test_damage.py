"""Damage and crashes: always a CheckpointError naming the file or key; nothing committed is lost."""
from __future__ import annotations

import os

import pytest
import torch

import raydcp
from raydcp import CheckpointError
from raydcp.storage import CheckpointStorage


@pytest.fixture
def saved(tmp_path):
    ck = tmp_path / "ck"
    sd = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(10, 10)}
    md = raydcp.save(sd, ck)
    return ck, sd, md


def data_file(ck, md, key):
    return os.path.join(ck, md.tensors[key].chunks[0].file), md.tensors[key].chunks[0]


def fresh():
    return {"a": torch.zeros(1000), "b": torch.zeros(10, 10)}


def test_bit_flip_is_caught_by_checksum(saved):
    ck, _, md = saved
    path, chunk = data_file(ck, md, "a")
    with open(path, "r+b") as f:
        f.seek(chunk.byte_offset + 123)
        byte = f.read(1)
        f.seek(chunk.byte_offset + 123)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CheckpointError, match=rf"a: checksum mismatch in {chunk.file}"):
        raydcp.load(fresh(), ck)


def test_truncated_and_missing_data_files(saved):
    ck, _, md = saved
    path, chunk = data_file(ck, md, "b")
    with open(path, "r+b") as f:
        f.truncate(chunk.byte_offset + 10)
    with pytest.raises(CheckpointError, match=r"b: .*(truncated|short)"):
        raydcp.load(fresh(), ck)
    os.remove(path)
    with pytest.raises(CheckpointError, match=rf"{os.path.basename(chunk.file)}"):
        raydcp.load(fresh(), ck)


def test_garbage_and_missing_metadata(saved, tmp_path):
    ck, _, _ = saved
    with open(os.path.join(ck, "raydcp.meta"), "wb") as f:
        f.write(b"\x80\x04garbage that is not metadata")
    with pytest.raises(CheckpointError, match="raydcp.meta: not raydcp metadata"):
        raydcp.load(fresh(), ck)
    with pytest.raises(CheckpointError, match="no committed raydcp checkpoint"):
        raydcp.load(fresh(), tmp_path / "nothing-here")


def test_overwrite_keeps_old_checkpoint_until_new_commit(saved, monkeypatch):
    ck, sd, md = saved
    new = {"a": torch.full((1000,), 7.0), "b": torch.full((10, 10), 7.0)}

    def crash(self, metadata):
        raise OSError("node lost power")

    monkeypatch.setattr(CheckpointStorage, "commit", crash)
    with pytest.raises(CheckpointError, match="node lost power"):
        raydcp.save(new, ck)
    monkeypatch.undo()
    got = fresh()
    raydcp.load(got, ck)
    assert torch.equal(got["a"], sd["a"]) and torch.equal(got["b"], sd["b"])
    md2 = raydcp.save(new, ck)
    got = fresh()
    raydcp.load(got, ck)
    assert torch.equal(got["a"], new["a"])
    files = CheckpointStorage(ck).list_files("data/")
    assert files and all(f.startswith(f"data/{md2.save_id}/") for f in files)  # old saves' files removed


def test_crash_while_writing_commits_nothing(tmp_path, monkeypatch):
    ck = tmp_path / "ck"

    def fail(self, files, max_workers=8, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(CheckpointStorage, "write_files", fail)
    with pytest.raises(CheckpointError, match="disk full"):
        raydcp.save({"a": torch.ones(3)}, ck)
    assert not CheckpointStorage(ck).is_committed()


def test_bad_checkpoint_id_and_group():
    with pytest.raises(CheckpointError, match="checkpoint_id must be a path"):
        raydcp.save({}, "")
    with pytest.raises(CheckpointError, match="group must be a raydcp.Group"):
        raydcp.save({}, "memory://x", group="g")


def flip(path, pos):
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x01]))


def test_partial_reads_are_verified_block_by_block(tmp_path):
    from raydcp import Shard

    ck = tmp_path / "ck"
    big = torch.arange(4 << 20, dtype=torch.uint8).reshape(4, 1 << 20)  # 4 MiB: four checksum blocks
    md = raydcp.save({"big": big, "small": torch.arange(100.0)}, ck)
    chunk = md.tensors["big"].chunks[0]
    assert len(chunk.block_checksums) == 4
    path = os.path.join(ck, chunk.file)
    flip(path, chunk.byte_offset + 3 * (1 << 20) + 5)  # damage in the last block (row 3)
    rows01 = {"big": Shard(torch.zeros(2, 1 << 20, dtype=torch.uint8), (0, 0), (4, 1 << 20))}
    stats = raydcp.load(rows01, ck, strict=False)  # rows 0-1 never touch the damaged block
    assert torch.equal(rows01["big"].tensor, big[:2]) and stats.bytes_read == 2 << 20
    row3 = {"big": Shard(torch.zeros(1, 1 << 20, dtype=torch.uint8), (3, 0), (4, 1 << 20))}
    with pytest.raises(CheckpointError, match=r"big: checksum mismatch .* at bytes"):
        raydcp.load(row3, ck, strict=False)
    small = md.tensors["small"].chunks[0]
    flip(os.path.join(ck, small.file), small.byte_offset + 396)  # the last element
    head = {"small": Shard(torch.zeros(10), (0,), (100,))}
    with pytest.raises(CheckpointError, match="small: checksum mismatch"):  # small chunks are read whole
        raydcp.load(head, ck, strict=False)


def test_metadata_whose_pieces_leave_a_gap_is_refused_on_load(tmp_path):
    from raydcp.metadata import Metadata, TensorMeta
    from raydcp.metadata_format import decode_metadata, encode_metadata
    from raydcp.storage import CheckpointStorage

    ck = tmp_path / "ck"
    raydcp.save({"w": torch.ones(4, 2)}, ck)
    storage = CheckpointStorage(ck)
    md = decode_metadata(storage.read_metadata_bytes())
    c = md.tensors["w"].chunks[0]
    holed = type(c)((0, 0), (3, 2), c.file, c.byte_offset, 24, c.checksum, ())
    md2 = Metadata(md.save_id, 1, md.created_at, {"w": TensorMeta("float32", (4, 2), (holed,))}, {})
    storage.commit(encode_metadata(md2))
    with pytest.raises(CheckpointError, match=r"stored pieces of w do not cover the tensor exactly"):
        raydcp.load({"w": torch.zeros(4, 2)}, ck)
