"""Conformance: the commit log (raydcp.storage.commits) on every backend -- exclusive creation,
one winner among saves begun on the same commit, and removal of nothing but what a path began."""
from __future__ import annotations

import threading

import pytest

from raydcp.errors import ConcurrentSaveError
from raydcp.storage import CheckpointStorage
from raydcp.storage.commits import begin_save, commit_generation, current_generation, prune, save_generation


def test_create_exclusive_refuses_an_existing_file(storage):
    storage.create_exclusive("_raydcp/probe", b"first")
    with pytest.raises(FileExistsError):
        storage.create_exclusive("_raydcp/probe", b"second")
    assert storage.read_file("_raydcp/probe") == b"first"


def test_of_two_saves_begun_on_one_commit_the_second_to_commit_fails(storage):
    a, b = begin_save(storage), begin_save(storage)
    assert save_generation(a) == save_generation(b) == 0
    storage.write_file(f"data/{a}/r00000-f000.bin", [b"A"])
    storage.write_file(f"data/{b}/r00000-f000.bin", [b"B"])

    assert commit_generation(storage, a, b"metadata of A") == 1
    with pytest.raises(ConcurrentSaveError, match="another save committed") as info:
        commit_generation(storage, b, b"metadata of B")
    assert info.value.save_id == b and info.value.generation == 0
    assert storage.read_metadata_bytes() == b"metadata of A"
    assert current_generation(storage) == 1

    prune(storage, 1, a)  # B can never commit now: its files go, A's stay
    assert not storage.exists(f"data/{b}/r00000-f000.bin")
    assert storage.read_file(f"data/{a}/r00000-f000.bin") == b"A"


def test_threads_racing_to_commit_have_exactly_one_winner(backend):
    url, options = backend
    n = 4
    base = CheckpointStorage(url, options)
    ids = [begin_save(base) for _ in range(n)]
    start = threading.Barrier(n)
    outcome: dict[int, object] = {}

    def run(i):
        storage = CheckpointStorage(url, options)
        start.wait()
        try:
            outcome[i] = commit_generation(storage, ids[i], f"metadata {i}".encode())
        except ConcurrentSaveError as exc:
            outcome[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, o in outcome.items() if o == 1]
    assert len(winners) == 1, outcome
    assert all(isinstance(o, ConcurrentSaveError) for i, o in outcome.items() if i != winners[0])
    assert base.read_metadata_bytes() == f"metadata {winners[0]}".encode()


def test_prune_removes_only_what_this_path_began(storage):
    foreign = {
        "data/labels.csv": b"id,label",
        "data/notes/r00000-f000.bin": b"a user's file named like ours",
        "data/0123456789abcdef/r00000-f000.bin": b"another checkpoint's save in a shared data/",
        "data/g0-aaaaaaaaaaaa/r00000-f000.bin": b"a save begun at another path",
    }
    for name, data in foreign.items():
        storage.write_file(name, [data])
    first = begin_save(storage)
    storage.write_file(f"data/{first}/r00000-f000.bin", [b"1"])
    storage.write_file(f"data/{first}/README", [b"not a raydcp name"])
    prune(storage, commit_generation(storage, first, b"m1"), first)
    second = begin_save(storage)
    storage.write_file(f"data/{second}/r00000-f000.bin", [b"2"])
    prune(storage, commit_generation(storage, second, b"m2"), second)

    assert not storage.exists(f"data/{first}/r00000-f000.bin")  # replaced: removed
    assert storage.read_file(f"data/{first}/README") == b"not a raydcp name"
    assert storage.read_file(f"data/{second}/r00000-f000.bin") == b"2"
    for name, data in foreign.items():
        assert storage.read_file(name) == data, name
