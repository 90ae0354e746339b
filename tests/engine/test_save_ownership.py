"""A save owns exactly ``data/<save_id>/``: it never deletes files raydcp did not write, a failed
save (a full disk) removes its own files before it returns, and a crashed one is removed by the
next save to the path."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

import raydcp
import raydcp.storage._local as local_io
from raydcp.storage import CheckpointStorage
from raydcp.storage.commits import begin_save


def _state(n: int, tag: float) -> dict:
    return {"w": torch.full((n,), tag)}


def _loads(path: str, n: int, tag: float) -> bool:
    out = {"w": torch.zeros(n)}
    raydcp.load(out, path)
    return torch.equal(out["w"], torch.full((n,), tag))


def _data_files(path) -> set[str]:
    return {str(p.relative_to(path)) for p in Path(path, "data").rglob("*") if p.is_file()}


def test_save_keeps_foreign_files_symlinked_dirs_and_a_shared_data_dir(tmp_path):
    proj = tmp_path / "proj"
    (proj / "data").mkdir(parents=True)
    (proj / "data" / "labels.csv").write_text("id,label\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "r00000-f000.bin").write_bytes(b"someone else's")
    os.symlink(outside, proj / "data" / "linked")
    for tag in (1.0, 2.0, 3.0):
        raydcp.save(_state(16, tag), str(proj))
    assert _loads(str(proj), 16, 3.0)
    assert (proj / "data" / "labels.csv").read_text() == "id,label\n"
    assert (outside / "r00000-f000.bin").read_bytes() == b"someone else's"
    md = raydcp.read_metadata(str(proj))
    ours = {f for f in _data_files(proj) if not f.startswith(("data/labels", "data/linked"))}
    assert ours == set(md.files)  # the earlier saves' files went with the metadata that named them

    # two checkpoints sharing one data/ directory (a symlink): saving one never breaks the other
    ck1, ck2 = tmp_path / "ck1", tmp_path / "ck2"
    raydcp.save(_state(8, 1.0), str(ck1))
    ck2.mkdir()
    os.symlink(ck1 / "data", ck2 / "data")
    for tag in (2.0, 3.0):
        raydcp.save(_state(8, tag), str(ck2))
    assert _loads(str(ck1), 8, 1.0) and _loads(str(ck2), 8, 3.0)


@pytest.fixture
def small_disk(monkeypatch, tmp_path):
    """Local writes under ``tmp_path`` fail with ENOSPC once the files there would exceed ``cap``
    bytes (a nearly full disk), after writing what fits, as a real disk does."""
    real = local_io.write_durably
    cap = {"bytes": 0}

    def used() -> int:
        return sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())

    def write_durably(path, views):
        free = cap["bytes"] - used()
        data = b"".join(bytes(v) for v in views)
        if len(data) > free:
            real(path, [memoryview(data[:max(free, 0)])])
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(path, [memoryview(data)])

    monkeypatch.setattr(local_io, "write_durably", write_durably)
    return cap


def test_a_save_that_fills_the_disk_removes_its_files_and_the_next_one_fits(tmp_path, small_disk):
    path = str(tmp_path / "ck")
    small_disk["bytes"] = 120_000
    raydcp.save(_state(10_000, 1.0), path)  # 40 kB
    with pytest.raises(raydcp.StorageError, match="No space left"):
        raydcp.save(_state(20_000, 2.0), path)  # 80 kB: does not fit beside the first
    assert _loads(path, 10_000, 1.0)  # the previous checkpoint is whole
    assert _data_files(path) == set(raydcp.read_metadata(path).files)  # no partial file left
    raydcp.save(_state(15_000, 3.0), path)  # 60 kB fits beside the first
    assert _loads(path, 15_000, 3.0)


def test_a_crashed_save_is_removed_by_the_next_save_and_nothing_else(tmp_path):
    path = str(tmp_path / "ck")
    raydcp.save(_state(8, 1.0), path)
    storage = CheckpointStorage(path)
    crashed = begin_save(storage)  # what a process killed while writing leaves behind
    storage.write_file(f"data/{crashed}/r00000-f000.bin", [b"\0" * 100])
    storage.write_file("data/labels.csv", [b"id"])
    raydcp.save(_state(8, 2.0), path)
    assert not storage.exists(f"data/{crashed}/r00000-f000.bin")
    assert storage.read_file("data/labels.csv") == b"id"
    assert _loads(path, 8, 2.0)
