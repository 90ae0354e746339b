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

    def fail(self, files, max_workers=8):
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
