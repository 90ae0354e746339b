"""Conformance: the metadata file is published atomically and last."""
from __future__ import annotations

import os

import pytest

from raydcp.errors import CheckpointError
from raydcp.storage import METADATA_NAME, CheckpointStorage, list_committed


def test_metadata_is_invisible_until_commit(storage):
    storage.write_file("data/s0/r0.bin", [b"payload"])

    assert not storage.is_committed()
    with pytest.raises(CheckpointError, match=r"no committed raydcp checkpoint at .*missing raydcp\.meta"):
        storage.read_metadata_bytes()

    storage.commit(b"v1")

    assert storage.is_committed()
    assert storage.read_metadata_bytes() == b"v1"
    assert CheckpointStorage(storage.url, storage.storage_options).read_metadata_bytes() == b"v1"


def test_a_second_commit_replaces_the_first(storage):
    storage.commit(b"first metadata")
    storage.commit(memoryview(b"second"))

    assert storage.read_metadata_bytes() == b"second"
    assert storage.list_files() == [METADATA_NAME]  # no temporary files left behind


def _crash(*args, **kwargs):
    raise OSError("simulated crash while publishing")


def test_a_failed_commit_leaves_the_previous_metadata(storage, monkeypatch):
    storage.write_file("data/s0/r0.bin", [b"old"])
    storage.commit(b"old metadata")
    storage.write_file("data/s1/r0.bin", [b"new"])
    monkeypatch.setattr(os, "replace", _crash)  # local: the rename
    monkeypatch.setattr(storage.fs, "pipe_file", _crash)  # object stores: the single put

    with pytest.raises(CheckpointError, match=r"could not commit the metadata of .*simulated crash"):
        storage.commit(b"new metadata")

    monkeypatch.undo()
    assert storage.read_metadata_bytes() == b"old metadata"
    assert storage.list_files() == ["data/s0/r0.bin", "data/s1/r0.bin", METADATA_NAME]


def test_a_failed_first_commit_leaves_nothing_committed(backend, monkeypatch):
    url, options = backend
    storage = CheckpointStorage(url, options)
    storage.write_file("data/s0/r0.bin", [b"x"])
    monkeypatch.setattr(os, "replace", _crash)
    monkeypatch.setattr(storage.fs, "pipe_file", _crash)

    with pytest.raises(CheckpointError):
        storage.commit(b"meta")

    monkeypatch.undo()
    assert not storage.is_committed()
    root = url.rsplit("/", 1)[0]
    assert url not in [c.url for c in list_committed(root, options)]
