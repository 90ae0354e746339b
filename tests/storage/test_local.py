"""Behaviour specific to one backend: durability and positional reads of local files,
commit-time ordering where the test can set the time, and error translation."""
from __future__ import annotations

import copy
import datetime as dt
import os

import fsspec
import pytest

from raydcp.errors import CheckpointError
from raydcp.storage import METADATA_NAME, CheckpointStorage, list_committed


@pytest.fixture
def local(tmp_path) -> CheckpointStorage:
    return CheckpointStorage(tmp_path / "ckpt")


def test_plain_path_and_file_url_name_the_same_directory(tmp_path):
    by_path = CheckpointStorage(str(tmp_path / "ckpt"))
    by_url = CheckpointStorage((tmp_path / "ckpt").as_uri())
    by_path.write_file("a.bin", [b"x"])
    assert by_url.read_file("a.bin") == b"x"
    assert by_path.url == str(tmp_path / "ckpt")
    assert by_url.url == (tmp_path / "ckpt").as_uri()


def test_data_and_metadata_are_fsynced(local, monkeypatch):
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))

    local.write_file("data/s/r0.bin", [b"a", b"b"])
    assert len(synced) == 1
    local.commit(b"meta")
    assert len(synced) == 3  # the temporary metadata file, then the directory after the rename


def test_commit_renames_a_temporary_file(local, monkeypatch):
    renames: list[tuple[str, str]] = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (renames.append((a, b)), real_replace(a, b)))

    local.commit(b"meta")

    [(src, dst)] = renames
    assert os.path.basename(src).startswith(f"{METADATA_NAME}.tmp-")
    assert dst == os.path.join(local.url, METADATA_NAME)


def test_read_ranges_opens_the_file_once(local, monkeypatch):
    data = bytes(range(256)) * 40
    local.write_file("d.bin", [data])
    target = os.path.join(local.url, "d.bin")
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: (opened.append(p), real_open(p, *a, **k))[1])
    ranges = [(s, s + 3) for s in range(0, len(data) - 3, 7)]

    out = local.read_ranges("d.bin", ranges)

    assert opened == [target]
    assert [bytes(b) for b in out] == [data[s:e] for s, e in ranges]


def test_read_ranges_views_are_writable(local):
    local.write_file("d.bin", [b"abcdef"])
    [view] = local.read_ranges("d.bin", [(1, 4)])
    view[0] = ord("X")  # callers may wrap them in tensors without a copy
    assert bytes(view) == b"Xcd"


def test_remove_files_prunes_empty_directories(local):
    local.write_files({"data/a/r0.bin": [b"x"], "data/b/r0.bin": [b"y"]})
    local.remove_files(["data/a/r0.bin"])
    assert not os.path.exists(os.path.join(local.url, "data", "a"))
    assert os.path.isdir(os.path.join(local.url, "data", "b"))


def test_list_committed_orders_by_commit_time_then_name(tmp_path):
    for name in ("a", "b", "c"):
        CheckpointStorage(tmp_path / name).commit(name.encode())

    def stamp(name: str, t: float) -> None:
        os.utime(tmp_path / name / METADATA_NAME, (t, t))

    stamp("a", 3000), stamp("b", 1000), stamp("c", 1000)
    assert [(c.name, c.committed_at) for c in list_committed(tmp_path)] == [("b", 1000), ("c", 1000), ("a", 3000)]
    assert list_committed(str(tmp_path))[0].url == str(tmp_path / "b")
    assert list_committed(tmp_path.as_uri())[0].url == (tmp_path / "b").as_uri()


def test_list_committed_orders_memory_by_creation_time():
    root = "memory://raydcp-test-order"
    fs = fsspec.filesystem("memory")
    try:
        for name, day in (("a", 3), ("b", 1), ("c", 2)):
            CheckpointStorage(f"{root}/{name}").commit(b"m")
            fs.store[f"/raydcp-test-order/{name}/{METADATA_NAME}"].created = dt.datetime(2024, 1, day, tzinfo=dt.timezone.utc)
        assert [c.name for c in list_committed(root)] == ["b", "c", "a"]
    finally:
        fs.rm("/raydcp-test-order", recursive=True)


def test_storage_copies_by_url_and_options(local):
    twin = copy.copy(local)
    assert twin is not local and twin.url == local.url and twin.storage_options == local.storage_options


def test_filesystem_errors_become_checkpoint_errors(local):
    local.write_file("a.bin", [b"x"])
    with pytest.raises(CheckpointError, match=r"could not write .*a\.bin/b\.bin"):
        local.write_file("a.bin/b.bin", [b"y"])  # a file where a directory is needed


def test_unknown_protocol_or_bad_options_are_checkpoint_errors():
    with pytest.raises(CheckpointError, match="cannot open nosuchproto://x"):
        CheckpointStorage("nosuchproto://x")
    with pytest.raises(CheckpointError, match="storage_options .* must be a dict"):
        CheckpointStorage("memory://x", storage_options=["not", "a", "dict"])
    with pytest.raises(CheckpointError, match="non-empty path"):
        CheckpointStorage("")


def test_write_files_reports_every_failed_file_after_writing_the_rest(local):
    local.write_file("blocker", [b"a file, not a directory"])
    files = {"blocker/a.bin": [b"1"], "blocker/b.bin": [b"2"], "ok.bin": [b"3"]}

    with pytest.raises(CheckpointError, match=r"(?s)2 of 3 files could not be written.*blocker/a\.bin.*blocker/b\.bin"):
        local.write_files(files, max_workers=2)

    assert local.read_file("ok.bin") == b"3"
