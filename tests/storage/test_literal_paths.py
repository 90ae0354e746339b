"""A plain local path is literal: '::', '#', '?', '%', spaces and unicode are characters of the
directory's name; URL syntax (fsspec's '::' chaining included) only follows a protocol."""
from __future__ import annotations

import os

import fsspec
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

import raydcp
from raydcp import CheckpointError
from raydcp.storage import METADATA_NAME, CheckpointStorage, apply_retention, list_committed
from raydcp.storage.paths import has_protocol, location_to_fs

NAMES = ["run::v2", "run::memory", "run#3", "a?b=1", "100%25", "my run", "é ü 中", "x::y#z?w%41"]


@pytest.mark.parametrize("name", NAMES)
def test_plain_path_is_the_directory_of_that_name(tmp_path, name):
    path = f"{tmp_path}/{name}"
    fs, got = location_to_fs(path)
    assert isinstance(fs, LocalFileSystem) and got == path
    storage = CheckpointStorage(path)
    assert storage.url == path
    storage.write_file("data/f.bin", b"abc")
    storage.commit(b"meta")
    assert sorted(os.listdir(tmp_path)) == [name]
    assert open(os.path.join(tmp_path, name, METADATA_NAME), "rb").read() == b"meta"
    assert CheckpointStorage(storage.url).read_file("data/f.bin") == b"abc"  # the url round-trips


def test_relative_path_with_double_colon_is_under_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert not has_protocol("run::v2") and not has_protocol("run::memory://x")
    storage = CheckpointStorage("run::v2")
    assert storage.url == f"{tmp_path}/run::v2"
    storage.commit(b"m")
    assert os.listdir(tmp_path) == ["run::v2"]


def test_protocols_and_chains():
    assert has_protocol("file:///a") and has_protocol("memory://a") and has_protocol("s3://b/k")
    assert has_protocol("simplecache::memory://a")
    assert not has_protocol("/a/simplecache::memory://b") and not has_protocol("C://x")
    # '::' after a filesystem that wraps none is a character of the path, as in a plain path
    fs, path = location_to_fs("file:///ckpts/run::v2")
    assert isinstance(fs, LocalFileSystem) and path == "/ckpts/run::v2"
    fs, path = location_to_fs("memory://lit/run::v2#a?b")
    assert fs.protocol in ("memory", ("memory",)) and path == "/lit/run::v2#a?b"
    # raydcp's own filesystems (raynode:// is what a node-local tier at a plain path becomes)
    assert location_to_fs("raynode:///ckpts/tier::a#1")[1] == "/ckpts/tier::a#1"
    assert location_to_fs("raymem://job::a/run::v2")[1] == "job::a/run::v2"
    # a chain still chains
    fs, path = location_to_fs("simplecache::memory://lit/x")
    assert "simplecache" in fs.protocol and path == "/lit/x"
    with pytest.raises(CheckpointError, match="nosuch://x"):
        CheckpointStorage("nosuch://x")


def test_file_and_memory_urls_with_double_colon_write_there(tmp_path):
    storage = CheckpointStorage(f"file://{tmp_path}/run::v2")
    storage.commit(b"m")
    assert os.listdir(tmp_path) == ["run::v2"]
    assert CheckpointStorage(storage.url).is_committed()
    mem = CheckpointStorage("memory://literal-paths/run::v2")
    mem.commit(b"m")
    assert fsspec.filesystem("memory").cat_file(f"/literal-paths/run::v2/{METADATA_NAME}") == b"m"
    assert not CheckpointStorage("memory://literal-paths/run").is_committed()


def test_save_load_beside_the_prefix_directory(tmp_path):
    """A save to ``run::v2`` neither writes into nor prunes the checkpoint at ``run``."""
    base = f"{tmp_path}/run"
    raydcp.save({"w": torch.full((4,), 1.0), "tag": "base"}, base)
    base_files = sorted(CheckpointStorage(base).list_files())
    target = f"{tmp_path}/run::v2"
    for value in (2.0, 3.0):  # the second save prunes the first one's data files: in run::v2 only
        raydcp.save({"w": torch.full((4,), value), "tag": "v2"}, target)
    got = {"w": torch.zeros(4), "tag": None}
    raydcp.load(got, target)
    assert got["tag"] == "v2" and got["w"].tolist() == [3.0] * 4
    assert raydcp.read_metadata(target).values["tag"] == "v2"
    assert sorted(CheckpointStorage(base).list_files()) == base_files
    got = {"w": torch.zeros(4), "tag": None}
    raydcp.load(got, base)
    assert got["tag"] == "base" and got["w"].tolist() == [1.0] * 4


def test_listing_and_retention_stay_in_their_root(tmp_path):
    for root in ("ckpts", "ckpts::a"):
        for i in range(3):
            raydcp.save({"w": torch.full((2,), float(i))}, f"{tmp_path}/{root}/step-{i}")
            os.utime(os.path.join(tmp_path, root, f"step-{i}", METADATA_NAME), (1000 + i, 1000 + i))
    root = f"{tmp_path}/ckpts::a"
    assert [c.url for c in list_committed(root)] == [f"{root}/step-{i}" for i in range(3)]
    assert apply_retention(root, keep_last=1) == [f"{root}/step-0", f"{root}/step-1"]
    assert sorted(os.listdir(root)) == ["step-2"]
    assert sorted(os.listdir(f"{tmp_path}/ckpts")) == ["step-0", "step-1", "step-2"]
