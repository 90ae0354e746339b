"""Loads from storage where each request is a round trip (object stores): chunks under one read
task are batched, touching ones in one range request, not one request per chunk."""
from __future__ import annotations

import uuid

import fsspec
import torch

import raydcp
from raydcp.options import DEFAULT_IO
from raydcp.storage import CheckpointStorage

KIB = 1 << 10


def test_only_remote_storage_counts_its_requests(tmp_path):
    assert CheckpointStorage(f"memory://{uuid.uuid4().hex}/ck").round_trip_reads
    assert not CheckpointStorage(str(tmp_path / "ck")).round_trip_reads


def test_touching_chunks_of_a_remote_file_come_in_one_request(monkeypatch):
    url = f"memory://{uuid.uuid4().hex}/ck"
    # 8 pieces of 300 KiB: each over read_pool_min (a task of its own on local files), under a read task
    sd = {f"t{i}": torch.full((300 * KIB // 4,), float(i)) for i in range(8)}
    assert DEFAULT_IO.read_pool_min < 300 * KIB < DEFAULT_IO.read_task_bytes
    md = raydcp.save(sd, url)
    assert len(md.files) == 1
    fs = type(fsspec.filesystem("memory"))
    ranges: list[int] = []
    real = fs.cat_ranges

    def counting(self, paths, starts, ends, *args, **kwargs):
        if any("/data/" in p for p in paths):
            ranges.append(len(paths))
        return real(self, paths, starts, ends, *args, **kwargs)

    monkeypatch.setattr(fs, "cat_ranges", counting)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    raydcp.load(out, url)
    assert all(torch.equal(out[k], v) for k, v in sd.items())
    assert ranges == [1]  # one call, one range: the 8 pieces touch (64-byte aligned, 300 KiB each)
