"""Replication between tiers: raw byte ranges, CRC32C checked on arrival, metadata last, idempotent."""
from __future__ import annotations

import os

import pytest

import raydcp
from raydcp.errors import CheckpointDamagedError, CheckpointError
from raydcp.pipeline.config import ThreadRunner
from raydcp.pipeline.replicate import commit_copy, copy_segment, replicate_files
from raydcp.storage import CheckpointStorage

from .helpers import files_of, flip_a_byte, make_state


@pytest.fixture(scope="module")
def runner():
    r = ThreadRunner(4)
    yield r
    r.close()


def replicate(src_url, dst_url, runner, part_bytes=4096, dst_options=None, calls=None):
    src, dst = CheckpointStorage(src_url), CheckpointStorage(dst_url, dst_options)
    meta = src.read_metadata_bytes()

    def run(tasks, on_result):
        if calls is not None:
            calls.extend(tasks)
        return runner.map(copy_segment, tasks, on_result)

    result = replicate_files(src, dst, meta, run, part_bytes=part_bytes)
    commit_copy(meta, dst)
    return result


def test_copy_is_raw_and_byte_identical_with_parallel_segments(tmp_path, runner):
    raydcp.save(make_state(8, 1000), tmp_path / "src")  # one 32 KB file: several segments
    calls, progress = [], []
    src = CheckpointStorage(str(tmp_path / "src"))
    dst = CheckpointStorage(str(tmp_path / "dst"))
    meta = src.read_metadata_bytes()

    def run(tasks, on_result):
        calls.extend(tasks)
        return runner.map(copy_segment, tasks, on_result)

    result = replicate_files(src, dst, meta, run, part_bytes=8192, on_bytes=lambda d, t: progress.append((d, t)))
    assert not dst.is_committed()  # invisible until the metadata commits
    commit_copy(meta, dst)
    assert len(calls) >= 3 and {c.kind for c in calls} == {"local"}
    assert result.files_copied == 1 and progress[-1][0] == progress[-1][1] == result.bytes_copied
    assert files_of(str(tmp_path / "dst")) == files_of(str(tmp_path / "src"))  # metadata included, byte for byte
    assert not [n for n in dst.list_files() if n.endswith(".partial")]


def test_again_keeps_complete_files_and_replaces_damaged_ones(tmp_path, runner):
    raydcp.async_save(make_state(6, 1000), tmp_path / "src", max_staging_bytes=4096).result()  # 6+ files
    replicate(str(tmp_path / "src"), str(tmp_path / "dst"), runner)
    flip_a_byte(str(tmp_path / "dst"))
    data = [n for n in CheckpointStorage(str(tmp_path / "dst")).list_files("data/")]
    os.remove(tmp_path / "dst" / data[-1])
    result = replicate(str(tmp_path / "src"), str(tmp_path / "dst"), runner)
    assert result.files_copied == 2 and result.files_kept == len(data) - 2
    assert files_of(str(tmp_path / "dst")) == files_of(str(tmp_path / "src"))


def test_an_older_save_on_the_target_stays_loadable_until_the_commit(tmp_path, runner):
    raydcp.save(make_state(seed=1), tmp_path / "dst")
    raydcp.save(make_state(seed=2), tmp_path / "src")
    src, dst = CheckpointStorage(str(tmp_path / "src")), CheckpointStorage(str(tmp_path / "dst"))
    meta = src.read_metadata_bytes()
    replicate_files(src, dst, meta, lambda t, cb: runner.map(copy_segment, t, cb), part_bytes=4096)
    assert raydcp.read_metadata(str(tmp_path / "dst")).values["step"] == 1  # the old one still
    commit_copy(meta, dst)
    assert raydcp.read_metadata(str(tmp_path / "dst")).values["step"] == 2
    assert files_of(str(tmp_path / "dst")) == files_of(str(tmp_path / "src"))  # old data files removed


def test_damaged_source_is_not_copied(tmp_path, runner):
    raydcp.save(make_state(), tmp_path / "src")
    flip_a_byte(str(tmp_path / "src"))
    with pytest.raises(CheckpointDamagedError, match="checksum mismatch"):
        replicate(str(tmp_path / "src"), str(tmp_path / "dst"), runner)
    assert not CheckpointStorage(str(tmp_path / "dst")).is_committed()


@pytest.mark.s3
def test_s3_target_multipart_is_byte_identical(tmp_path, runner, s3_server):
    # S3 parts are at least 5 MiB: an 11 MiB file makes a 3-part upload
    raydcp.save(make_state(11, 1 << 18), tmp_path / "src")
    url, opts = s3_server.new_url(), s3_server.storage_options
    calls = []
    replicate(str(tmp_path / "src"), url, runner, part_bytes=1, dst_options=opts, calls=calls)
    assert {c.kind for c in calls} == {"s3"} and max(c.segment.parts for c in calls) >= 2
    assert files_of(url, opts) == files_of(str(tmp_path / "src"))
    # nothing left half-uploaded
    dst = CheckpointStorage(url, opts)
    bucket, key, _ = dst.fs.split_path(dst.path)
    assert not dst.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key).get("Uploads")


@pytest.mark.s3
def test_unreachable_target_is_an_error_naming_it(tmp_path, runner, s3_server):
    raydcp.save(make_state(), tmp_path / "src")
    url = f"s3://no-such-bucket-{os.getpid()}/x"
    with pytest.raises(CheckpointError, match="no-such-bucket"):
        replicate(str(tmp_path / "src"), url, runner, dst_options=s3_server.storage_options)


def test_the_commit_of_a_copy_removes_only_raydcps_own_files(tmp_path, runner):
    raydcp.save(make_state(seed=1), tmp_path / "dst")  # an older save on the target: its files go
    old = {f for f in files_of(str(tmp_path / "dst"))}
    foreign = [tmp_path / "dst" / "data" / "labels.csv", tmp_path / "dst" / "data" / "notes" / "r00000-f000.bin"]
    for f in foreign:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("not raydcp's")
    raydcp.save(make_state(seed=2), tmp_path / "src")
    replicate(str(tmp_path / "src"), str(tmp_path / "dst"), runner)
    assert raydcp.read_metadata(str(tmp_path / "dst")).values["step"] == 2
    left = set(files_of(str(tmp_path / "dst")))
    assert not (old & left - set(files_of(str(tmp_path / "src"))))  # the old save's data files removed
    assert all(f.read_text() == "not raydcp's" for f in foreign)     # what raydcp did not write is kept
