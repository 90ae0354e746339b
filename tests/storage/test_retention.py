"""Conformance: listing committed checkpoints under a root, and retention."""
from __future__ import annotations

import os

import pytest

from raydcp.errors import CheckpointError
from raydcp.storage import CheckpointStorage, apply_retention, list_committed, remove_checkpoint


def make(root: str, options, name: str, *, commit: bool = True) -> CheckpointStorage:
    storage = CheckpointStorage(f"{root}/{name}", options)
    storage.write_file("data/s0/r00000-f000.bin", [b"payload"])
    if commit:
        storage.commit(name.encode())
    return storage


def test_list_committed_oldest_first_ignoring_uncommitted(backend):
    root, options = backend
    # Created in name order; where timestamps tie (s3 has 1 s resolution) the name decides.
    committed = [make(root, options, f"ckpt-{i:03d}") for i in range(3)]
    make(root, options, "aaa-in-progress", commit=False)
    make(root, options, "zzz-in-progress", commit=False)
    CheckpointStorage(root, options).write_file("stray-file.txt", [b"not a checkpoint"])

    found = list_committed(root, options)

    assert [c.name for c in found] == ["ckpt-000", "ckpt-001", "ckpt-002"]
    assert [c.url for c in found] == [s.url for s in committed]
    assert all(a.committed_at <= b.committed_at for a, b in zip(found, found[1:]))
    assert all(c.committed_at > 1e9 for c in found)
    assert CheckpointStorage(found[0].url, options).read_metadata_bytes() == b"ckpt-000"


def test_list_committed_sees_commits_from_another_handle(backend):
    root, options = backend
    make(root, options, "ckpt-000")
    assert [c.name for c in list_committed(root, options)] == ["ckpt-000"]  # may cache the listing

    make(root, dict(options or {}, skip_instance_cache=True), "ckpt-001")  # another process

    assert [c.name for c in list_committed(root, options)] == ["ckpt-000", "ckpt-001"]


def test_list_committed_of_a_missing_root_is_empty(backend):
    root, options = backend
    assert list_committed(root, options) == []
    assert apply_retention(root, 1, options) == []


def test_apply_retention_keeps_the_newest(backend):
    root, options = backend
    storages = [make(root, options, f"ckpt-{i:03d}") for i in range(4)]
    in_progress = make(root, options, "aaa-in-progress", commit=False)

    deleted = apply_retention(root, 2, options)

    assert deleted == [storages[0].url, storages[1].url]
    assert [c.name for c in list_committed(root, options)] == ["ckpt-002", "ckpt-003"]
    assert storages[0].list_files() == [] and storages[1].list_files() == []
    assert in_progress.list_files() == ["data/s0/r00000-f000.bin"]
    assert apply_retention(root, 2, options) == []
    assert apply_retention(root, 10, options) == []


@pytest.mark.parametrize("keep_last", [0, -1, 1.5, True, None])
def test_apply_retention_refuses_to_keep_none(backend, keep_last):
    root, options = backend
    make(root, options, "ckpt-000")
    with pytest.raises(CheckpointError, match="keep_last must be an integer >= 1"):
        apply_retention(root, keep_last, options)
    assert [c.name for c in list_committed(root, options)] == ["ckpt-000"]


def test_apply_retention_removes_only_raydcp_files(backend):
    root, options = backend
    old = make(root, options, "ckpt-000")
    old.write_file("_raydcp/gen-000000000001.meta", [b"ckpt-000"])
    old.write_file("_raydcp/begun-g0-0123456789ab", [b""])
    foreign = {"README.md": b"notes", "data/labels.csv": b"id,label", "data/s0/notes.txt": b"mine",
               "_raydcp/notes": b"not a record raydcp writes"}
    for name, data in foreign.items():
        old.write_file(name, [data])
    make(root, options, "ckpt-001")

    assert apply_retention(root, 1, options) == [old.url]

    assert sorted(old.list_files()) == sorted(foreign)
    for name, data in foreign.items():
        assert old.read_file(name) == data
    assert [c.name for c in list_committed(root, options)] == ["ckpt-001"]


def test_apply_retention_scope_is_the_root_it_is_given(backend):
    root, options = backend
    make(root, options, "run-a/ckpt-000")           # a sibling run under the same parent
    nested = make(root, options, "run-b/ckpt-000/sub")  # deeper than the root's children
    b = [make(root, options, f"run-b/ckpt-{i:03d}") for i in range(1, 3)]

    assert apply_retention(f"{root}/run-b", 1, options) == [b[0].url]

    assert CheckpointStorage(f"{root}/run-a/ckpt-000", options).is_committed()
    assert nested.is_committed() and b[1].is_committed()


def test_remove_checkpoint_removes_what_also_names(backend):
    root, options = backend
    ckpt = make(root, options, "ckpt-000")
    ckpt.write_file("status.json", [b"{}"])
    ckpt.write_file("keep.txt", [b"kept"])
    left = remove_checkpoint(ckpt.url, options, also=lambda n: n == "status.json")
    assert left == ["keep.txt"] and ckpt.list_files() == ["keep.txt"]


def test_retention_never_reaches_through_a_symbolic_link(tmp_path):
    root = tmp_path / "root"
    elsewhere = tmp_path / "elsewhere"
    outside = make(str(elsewhere), None, "ckpt-outside")
    original = make(str(root), None, "ckpt-000")
    os.symlink(elsewhere / "ckpt-outside", root / "ckpt-001")   # not a checkpoint of the root
    os.symlink(root / "ckpt-000", root / "latest")              # a name for one of them
    copy = root / "ckpt-002"
    copy.mkdir()
    os.symlink(root / "ckpt-000" / "data", copy / "data")       # a copy sharing the original's data
    CheckpointStorage(str(copy)).commit(b"copy")
    newest = make(str(root), None, "ckpt-003")

    assert apply_retention(str(root), 1) == [original.url, str(copy)]

    assert outside.read_metadata_bytes() == b"ckpt-outside" and outside.list_files() == [
        "data/s0/r00000-f000.bin", "raydcp.meta"]
    assert os.path.islink(root / "ckpt-001") and os.path.islink(root / "latest")
    assert newest.is_committed()
    assert not (copy / "raydcp.meta").exists() and os.path.islink(copy / "data")


def test_a_copy_pruned_by_retention_keeps_its_original_whole(tmp_path):
    root = tmp_path / "root"
    original = make(str(tmp_path), None, "original")
    copy = root / "copy"
    copy.mkdir(parents=True)
    os.symlink(tmp_path / "original" / "data", copy / "data")
    CheckpointStorage(str(copy)).commit(b"copy")
    make(str(root), None, "newer")

    assert apply_retention(str(root), 1) == [str(copy)]

    assert original.read_metadata_bytes() == b"original"
    assert original.read_file("data/s0/r00000-f000.bin") == b"payload"
