"""The public calls raise the typed errors, with attributes that name what went wrong."""
from __future__ import annotations

import errno

import pytest
import torch

import raydcp
from raydcp.engine.save import save_with
from raydcp.errors import (CheckpointDamagedError, CheckpointNotFoundError, RanksTimedOutError, StateMismatchError,
                           StorageError)
from raydcp.storage._common import is_transient, translating

from ..engine.helpers import run_ranks


def test_nothing_committed_is_not_found(tmp_path):
    with pytest.raises(CheckpointNotFoundError) as info:
        raydcp.read_metadata(tmp_path / "nothing")
    assert info.value.path.endswith("nothing") and "no committed raydcp checkpoint" in str(info.value)


def test_wrong_shape_dtype_and_keys_are_a_state_mismatch_naming_each_key(tmp_path):
    raydcp.save({"a": torch.zeros(4), "b": torch.zeros(2), "c": torch.zeros(3), "gone": torch.zeros(1)}, tmp_path / "ck")
    with pytest.raises(StateMismatchError) as info:
        raydcp.load({"a": torch.zeros(5), "b": torch.zeros(2, dtype=torch.int64), "c": torch.zeros(3),
                     "new": torch.zeros(1)}, tmp_path / "ck")
    e = info.value
    assert e.shapes == {"a": ((4,), (5,))} and e.dtypes == {"b": ("float32", "int64")}
    assert e.missing_keys == ("new",) and e.unexpected_keys == ("gone",) and e.keys == ("a", "b", "gone", "new")


def test_a_flipped_byte_is_damage_naming_file_key_and_byte_range(tmp_path):
    raydcp.save({"w": torch.arange(64.0)}, tmp_path / "ck")
    (c,) = raydcp.read_metadata(tmp_path / "ck").tensors["w"].chunks
    path = tmp_path / "ck" / c.file
    data = bytearray(path.read_bytes())
    data[c.byte_offset + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointDamagedError) as info:
        raydcp.load({"w": torch.zeros(64)}, tmp_path / "ck")
    e = info.value
    assert e.key == "w" and e.file == c.file and e.byte_range[0] <= c.byte_offset + 5 < e.byte_range[1]


def test_a_missing_rank_times_out_naming_it(tmp_path):
    def rank(t):
        if t.rank == 1:
            return None  # never arrives
        return save_with(t, {"w": raydcp.Shard(torch.zeros(2), (0,), (4,))}, str(tmp_path / "ck"))

    _, errs = run_ranks(2, rank, timeout_s=0.5)
    assert isinstance(errs[0], RanksTimedOutError) and errs[0].missing_ranks == (1,) and errs[0].timeout_s == 0.5


def test_storage_failures_say_whether_a_retry_may_help():
    with pytest.raises(StorageError) as info:
        with translating("write", "s3://bucket/ck/data/x.bin"):
            raise ConnectionResetError(errno.ECONNRESET, "connection reset by peer")
    assert info.value.retriable and info.value.path == "s3://bucket/ck/data/x.bin"
    with pytest.raises(StorageError) as info:
        with translating("write", "/ckpt/data/x.bin"):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert not info.value.retriable and "No space left" in str(info.value)
    with pytest.raises(StorageError) as info:
        with translating("read", "/ckpt/x"):
            raise PermissionError(errno.EACCES, "denied")
    assert not info.value.retriable
    assert is_transient(TimeoutError()) and not is_transient(ValueError("bad name"))
