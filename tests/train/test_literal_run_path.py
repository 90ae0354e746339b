"""A Ray Train run stored at a plain local path holding '::' lists its own checkpoint directories,
not those of the directory named by the text before the '::'."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pyarrow.fs as pafs

from raydcp.train.checkpoint import run_checkpoint_dirs


def test_run_checkpoint_dirs_at_a_path_with_double_colon(tmp_path):
    names = {"run": "raydcp-step00000001-aaaaaaaa", "run::v2": "raydcp-step00000002-bbbbbbbb"}
    for run, name in names.items():
        os.makedirs(tmp_path / run / name)
    storage = SimpleNamespace(storage_filesystem=pafs.LocalFileSystem(), experiment_fs_path=f"{tmp_path}/run::v2")
    assert run_checkpoint_dirs(storage) == [(names["run::v2"], f"{tmp_path}/run::v2/{names['run::v2']}")]
