"""Conformance: writing, reading and listing the files of one checkpoint directory."""
from __future__ import annotations

import array
import random

import numpy as np
import pytest

from raydcp.errors import CheckpointError
from raydcp.storage import CheckpointStorage

NAME = "data/save0/r00000-f000.bin"


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def test_round_trip_of_several_buffers(storage):
    parts = [b"head", memoryview(payload(300)), np.arange(50, dtype=np.uint8), bytearray(b""), array.array("f", [1.5, -2.0])]
    expected = b"".join(bytes(memoryview(p).cast("B")) for p in parts)

    assert storage.write_file(NAME, parts) == len(expected)

    assert storage.read_file(NAME) == expected
    assert storage.file_size(NAME) == len(expected)
    assert storage.exists(NAME)


def test_write_file_accepts_a_single_buffer(storage):
    assert storage.write_file("one.bin", b"abc") == 3
    assert storage.read_file("one.bin") == b"abc"


def test_rewriting_a_file_replaces_it(storage):
    storage.write_file(NAME, [b"old content, longer"])
    storage.write_file(NAME, [b"new"])
    assert storage.read_file(NAME) == b"new"


def test_a_second_handle_sees_writes(backend):
    url, options = backend
    reader = CheckpointStorage(url, options)
    reader.write_file("data/s/a.bin", [b"1"])
    reader.fs.ls(f"{reader.path}/data/s")  # a listing cached by the filesystem instance (s3fs)
    other = CheckpointStorage(url, dict(options or {}, skip_instance_cache=True))  # another process

    other.write_files({"data/s/b.bin": [b"22"], "c.bin": [b"3"]})

    assert reader.list_files() == ["c.bin", "data/s/a.bin", "data/s/b.bin"]
    assert reader.exists("data/s/b.bin") and reader.file_size("data/s/b.bin") == 2
    other.remove_files(["data/s/a.bin"])
    assert not reader.exists("data/s/a.bin")


def test_read_ranges_thousands_of_touching_ranges_read_once(storage, read_meter):
    data = payload(20_000, seed=1)
    storage.write_file(NAME, [data])
    bounds = sorted(random.Random(2).sample(range(1, len(data)), 2999))
    ranges = list(zip([0] + bounds, bounds + [len(data)]))
    random.Random(3).shuffle(ranges)
    fetched = read_meter(storage)

    out = storage.read_ranges(NAME, ranges)

    assert [bytes(b) for b in out] == [data[s:e] for s, e in ranges]
    assert fetched == [len(data)]  # all touching: one read of exactly the file


def test_read_ranges_overlapping_out_of_order_and_gaps(storage, read_meter):
    data = payload(5_000, seed=4)
    storage.write_file(NAME, [data])
    ranges = [(4000, 4100), (10, 20), (15, 30), (12, 13), (30, 40), (100, 100), (2000, 2500), (2100, 2200), (10, 20)]
    fetched = read_meter(storage)

    out = storage.read_ranges(NAME, ranges)

    assert [bytes(b) for b in out] == [data[s:e] for s, e in ranges]
    assert sorted(fetched) == sorted([100, 30, 500])  # [10,40) [2000,2500) [4000,4100): no gap bytes


def test_read_ranges_many_disjoint_ranges(storage, read_meter):
    data = payload(3_000, seed=5)
    storage.write_file(NAME, [data])
    rng = random.Random(6)
    ranges = [(s, s + rng.randint(1, 5)) for s in range(0, len(data) - 10, 25)]  # one GET each on s3
    rng.shuffle(ranges)
    fetched = read_meter(storage)

    out = storage.read_ranges(NAME, ranges)

    assert [bytes(b) for b in out] == [data[s:e] for s, e in ranges]
    assert sum(fetched) == sum(e - s for s, e in ranges)


def test_read_ranges_of_nothing(storage):
    storage.write_file(NAME, [b"abc"])
    assert storage.read_ranges(NAME, []) == []
    assert [bytes(b) for b in storage.read_ranges(NAME, [(1, 1)])] == [b""]


@pytest.mark.parametrize("bad", [(-1, 2), (5, 3), (0.5, 2), (1,)])
def test_read_ranges_rejects_invalid_ranges(storage, bad):
    storage.write_file(NAME, [b"abcdef"])
    with pytest.raises(CheckpointError, match="invalid byte range"):
        storage.read_ranges(NAME, [bad])


def test_read_into_fills_the_callers_buffer(storage):
    data = payload(1000, seed=7)
    storage.write_file(NAME, [data])
    out = np.zeros(100, dtype=np.float32)  # 400 bytes, read as raw bytes

    storage.read_into(NAME, 200, memoryview(out))

    assert out.tobytes() == data[200:600]
    whole = bytearray(1000)
    storage.read_into(NAME, 0, memoryview(whole))
    assert whole == data


def test_read_into_rejects_a_read_only_buffer(storage):
    storage.write_file(NAME, [b"abcdef"])
    with pytest.raises(CheckpointError, match="writable"):
        storage.read_into(NAME, 0, memoryview(b"xx"))


def test_write_files_in_parallel(storage):
    files = {f"data/s1/r{r:05d}-f000.bin": [payload(100 + r, seed=r), bytes([r])] for r in range(12)}

    written = storage.write_files(files, max_workers=4)

    assert written == {name: 101 + r for r, name in enumerate(files)}
    for r, name in enumerate(files):
        assert storage.read_file(name) == payload(100 + r, seed=r) + bytes([r])


def test_write_files_rejects_bad_names_before_writing(storage):
    with pytest.raises(CheckpointError, match=r"invalid file name '\.\./escape'"):
        storage.write_files({"ok.bin": [b"1"], "../escape": [b"2"]})
    assert storage.list_files() == []


def test_truncated_file_is_named(storage):
    storage.write_file(NAME, [payload(100)])
    with pytest.raises(CheckpointError, match=f"{NAME}.*truncated.*100 bytes"):
        storage.read_ranges(NAME, [(0, 10), (90, 120)])
    with pytest.raises(CheckpointError, match=f"{NAME}.*truncated"):
        storage.read_into(NAME, 50, memoryview(bytearray(60)))


def test_missing_file_is_named(storage):
    storage.write_file("data/s/other.bin", [b"x"])
    for read in (
        lambda: storage.read_ranges(NAME, [(0, 1)]),
        lambda: storage.read_into(NAME, 0, memoryview(bytearray(1))),
        lambda: storage.read_file(NAME),
    ):
        with pytest.raises(CheckpointError, match=f"{NAME} is missing"):
            read()
    assert storage.file_size(NAME) is None and not storage.exists(NAME)


def test_list_files_and_prefixes(storage):
    names = ["data/a/r0.bin", "data/a/r1.bin", "data/ab/r0.bin", "data/b/r0.bin", "top.bin"]
    storage.write_files({n: [b"x"] for n in names})

    assert storage.list_files() == names
    assert storage.list_files("data/a/") == names[:2]
    assert storage.list_files("data/a") == names[:3]
    assert storage.list_files("data/") == names[:4]
    assert storage.list_files("nothing/") == []


def test_remove_files_ignores_missing_ones(storage):
    names = ["data/a/r0.bin", "data/a/r1.bin", "data/b/r0.bin"]
    storage.write_files({n: [b"x"] for n in names})

    storage.remove_files(["data/a/r0.bin", "data/a/r1.bin", "data/a/never.bin"])
    storage.remove_files([])

    assert storage.list_files() == ["data/b/r0.bin"]
    assert storage.list_files("data/a/") == []


def test_delete_removes_everything(storage):
    storage.write_files({"data/a/r0.bin": [b"x"], "b.bin": [b"y"]})
    storage.commit(b"meta")

    storage.delete()
    storage.delete()  # already gone: no error

    assert storage.list_files() == [] and not storage.is_committed()


def test_a_missing_directory_is_empty(storage):
    assert storage.list_files() == []
    assert storage.file_size("a.bin") is None


def test_url_round_trips(storage):
    again = CheckpointStorage(storage.url, storage.storage_options)
    assert again.url == storage.url and again.path == storage.path


@pytest.mark.parametrize("name", ["", "/abs.bin", "a/../b.bin", "a//b.bin", "./a.bin", "a\\b.bin"])
def test_invalid_names_are_refused(storage, name):
    with pytest.raises(CheckpointError, match="invalid file name"):
        storage.write_file(name, [b"x"])


def test_write_file_consumes_a_generator_lazily(storage):
    produced = []

    def gen():
        for i in range(3):
            produced.append(i)
            yield bytes([i]) * (i + 1)

    assert storage.write_file(NAME, gen()) == 6
    assert produced == [0, 1, 2]
    assert storage.read_file(NAME) == b"\x00\x01\x01\x02\x02\x02"


def test_read_into_many_fills_each_buffer(storage):
    data = payload(5000, seed=4)
    storage.write_file(NAME, [data])
    outs = [bytearray(10), bytearray(0), np.zeros(300, np.uint8), bytearray(1)]
    starts = [0, 17, 4000, 4999]
    assert storage.read_into_many(NAME, list(zip(starts, [memoryview(o) for o in outs]))) == 311
    assert bytes(outs[0]) == data[:10] and bytes(outs[2]) == data[4000:4300] and bytes(outs[3]) == data[4999:]
    with pytest.raises(CheckpointError, match="truncated"):
        storage.read_into_many(NAME, [(0, memoryview(bytearray(10))), (4995, memoryview(bytearray(10)))])
    with pytest.raises(CheckpointError, match="read-only"):
        storage.read_into_many(NAME, [(0, memoryview(b"xx"))])


@pytest.mark.parametrize("read_ahead", [False, True])
def test_write_file_read_ahead_makes_the_next_buffer_in_a_second_thread(storage, read_ahead):
    import threading

    caller = threading.get_ident()
    made: list[tuple[int, bool]] = []  # (buffer, made in the caller's thread)

    def gen():
        for i in range(4):
            made.append((i, threading.get_ident() == caller))
            yield bytes([i]) * 1000

    assert storage.write_file(NAME, gen(), read_ahead=read_ahead) == 4000
    assert storage.read_file(NAME) == b"".join(bytes([i]) * 1000 for i in range(4))
    assert [i for i, _ in made] == [0, 1, 2, 3]
    # the first buffer is made at once by the caller; with read_ahead the others while it writes
    assert [here for _, here in made] == [True, True, True, True] if not read_ahead else [True, False, False, False]


def test_write_file_read_ahead_passes_the_producers_error_on(storage):
    def gen():
        yield b"x" * 10
        raise ValueError("producer failed")

    errors = []
    for read_ahead in (False, True):
        with pytest.raises(Exception, match="producer failed") as info:
            storage.write_file(NAME, gen(), read_ahead=read_ahead)
        errors.append(type(info.value))
    assert errors[0] is errors[1]  # the same error as without read_ahead
