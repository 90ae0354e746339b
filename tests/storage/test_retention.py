"""Conformance: listing committed checkpoints under a root, and retention."""
from __future__ import annotations

import pytest

from raydcp.errors import CheckpointError
from raydcp.storage import CheckpointStorage, apply_retention, list_committed


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
