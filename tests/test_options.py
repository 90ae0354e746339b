"""AsyncOptions / IOOptions: validated when built; RAYDCP_* overrides parsed once, explicit arguments win."""
import pytest

from raydcp import CheckpointError
from raydcp.engine.protocol import StorageRecord
from raydcp.options import DEFAULT_IO, AsyncOptions, IOOptions


def test_env_overrides_apply_and_explicit_arguments_win():
    env = {"RAYDCP_STAGING": " SHM ", "RAYDCP_MAX_STAGING_BYTES": "4096", "RAYDCP_PERSIST_NICE": "5"}
    assert AsyncOptions.from_env(env) == AsyncOptions(staging="shm", max_staging_bytes=4096, persist_nice=5)
    assert AsyncOptions.from_env(env, max_staging_bytes=8192).max_staging_bytes == 8192
    assert AsyncOptions.from_env({}) == AsyncOptions()  # unset: auto staging, no cap, nice 19
    assert AsyncOptions.from_env({"RAYDCP_PERSIST_NICE": "lots"}).persist_nice == 19  # unreadable: the default


@pytest.mark.parametrize("env, explicit, message", [
    ({"RAYDCP_STAGING": "mmap"}, {}, "'mmap' is not one of shm, private"),
    ({"RAYDCP_MAX_STAGING_BYTES": "big"}, {}, "RAYDCP_MAX_STAGING_BYTES='big' is not a number"),
    ({}, {"max_staging_bytes": 10}, "at least 1 KiB"),
    ({}, {"max_staging_bytes": "x"}, "must be a number of bytes"),
])
def test_bad_async_options_name_the_option(env, explicit, message):
    with pytest.raises(CheckpointError, match=message):
        AsyncOptions.from_env(env, **explicit)


def test_options_are_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        AsyncOptions("shm")  # the fields are keyword-only
    with pytest.raises(AttributeError):
        DEFAULT_IO.write_threads = 2


@pytest.mark.parametrize("change, message", [
    ({"write_threads": 0}, "write_threads must be an int >= 1"),
    ({"write_bytes": 3 << 20 | 1}, "write_bytes must be a multiple of the checksum block"),
    ({"pack_max": 8 << 20}, "pack_max .* must not exceed pack_bytes"),
])
def test_bad_io_options_name_the_option(change, message):
    with pytest.raises(CheckpointError, match=message):
        IOOptions(**change)
    assert DEFAULT_IO.replace(read_threads=2).read_threads == 2


def test_storage_records_concatenate_and_round_trip_through_rows():
    a = StorageRecord.from_rows([("w", (0,), (2,), "f0", 0, 8, 1, ()), ("b", (), (), "f0", 64, 4, 2, ())])
    b = StorageRecord.from_rows([("w", (2,), (2,), "f1", 0, 8, 3, (5, 6))])
    both = StorageRecord.concat([a, StorageRecord(), b])
    assert len(both) == 3 and both.total_bytes == 20
    assert list(both.rows()) == list(a.rows()) + list(b.rows())
    assert StorageRecord.from_rows(list(both.rows())) == both
    assert len(StorageRecord.concat([])) == 0
