"""AsyncOptions / IOOptions / SaveOptions / LoadOptions: validated when built; RAYDCP_* overrides parsed
once, explicit arguments win."""
import pytest

from raydcp import CheckpointError
from raydcp.engine.save_records import StorageRecord
from raydcp.options import DEFAULT_IO, DEFAULT_LOAD, DEFAULT_SAVE, AsyncOptions, IOOptions, LoadOptions, SaveOptions


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


@pytest.mark.parametrize("kind, change, message", [
    ("save", {"max_file_bytes": 63}, r"SaveOptions.max_file_bytes must be an int >= 64, got 63"),
    ("save", {"max_file_bytes": 1.5e9}, r"SaveOptions.max_file_bytes must be an int"),
    ("save", {"max_file_bytes": True}, r"SaveOptions.max_file_bytes must be an int"),
    ("save", {"io": {"write_threads": 2}}, r"SaveOptions.io must be a raydcp.options.IOOptions, got dict"),
    ("load", {"io": None}, r"LoadOptions.io must be a raydcp.options.IOOptions, got NoneType"),
])
def test_bad_save_and_load_options_name_the_option(kind, change, message):
    cls = SaveOptions if kind == "save" else LoadOptions
    with pytest.raises(CheckpointError, match=message):
        cls(**change)


def test_save_and_load_options_default_to_the_engines_defaults_and_are_public():
    import raydcp

    assert raydcp.SaveOptions is SaveOptions and raydcp.LoadOptions is LoadOptions and raydcp.IOOptions is IOOptions
    assert SaveOptions() == DEFAULT_SAVE and SaveOptions().io is DEFAULT_IO and LoadOptions() == DEFAULT_LOAD
    assert SaveOptions(max_file_bytes=1 << 20).replace(max_file_bytes=64).max_file_bytes == 64
    with pytest.raises(TypeError):
        SaveOptions(1 << 20)  # keyword-only
