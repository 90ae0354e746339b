"""raydcp.train.restore's choice: the run's newest committed checkpoint, whether or not Ray Train
registered it; never one whose save did not commit."""
from __future__ import annotations

from types import SimpleNamespace

import pyarrow.fs as pafs
import torch

import raydcp
from raydcp.train.checkpoint import run_checkpoint_dirs
from raydcp.train.latest import latest_committed


def test_the_newest_commit_wins_registered_or_not(tmp_path):
    run = tmp_path / "run"
    storage = SimpleNamespace(storage_filesystem=pafs.LocalFileSystem(), experiment_fs_path=str(run))
    names = {s: f"raydcp-step{s:08d}-0000000{s}" for s in (3, 5, 7, 9)}
    for step in (3, 9, 5):  # step 9 committed before step 5: an earlier attempt's, then the run went back
        raydcp.save({"w": torch.full((2,), float(step))}, str(run / names[step]))
    (run / names[7] / "data").mkdir(parents=True)  # a save that never committed
    (run / names[7] / "data" / "r00000-f000.bin").write_bytes(b"x" * 8)
    registered = SimpleNamespace(path=str(run / names[3]), filesystem=pafs.LocalFileSystem())
    dirs = run_checkpoint_dirs(storage)
    assert [n for n, _ in dirs] == sorted(names.values())
    assert latest_committed(storage, registered, dirs) == (names[5], str(run / names[5]))
    assert latest_committed(storage, None, dirs)[0] == names[5]
    assert latest_committed(storage, None, [d for d in dirs if d[0] == names[7]]) is None
