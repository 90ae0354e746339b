"""Conformance: the commit log (raydcp.storage.commits) on every backend -- exclusive creation,
one winner among saves begun on the same commit, removal of nothing but what a path owns, and a
damaged log (forged, corrupt or missing records) that never wedges the path."""
from __future__ import annotations

import os
import threading

import pytest
import torch

import raydcp
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
        "data/0123456789abcdef/r00000-f000.bin": b"a save id from before the commit log, not replaced here",
        "data/g1-custom/r00000-f000.bin": b"not a save id the commit log makes",
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


def _meta(sid: str, payload: bytes) -> bytes:
    """Stands for a save's metadata: it names the save's files in plain text, as raydcp's does."""
    return b"metadata " + payload + f" data/{sid}/r00000-f000.bin".encode()


def _save(storage, payload: bytes) -> str:
    """One whole save through the log: begin, write, commit, prune; returns its id."""
    sid = begin_save(storage)
    storage.write_file(f"data/{sid}/r00000-f000.bin", [payload])
    prune(storage, commit_generation(storage, sid, _meta(sid, payload)), sid)
    return sid


def _begun(storage) -> list[str]:
    return [n for n in storage.list_files("_raydcp/") if n.startswith("_raydcp/begun-")]


def test_a_forged_high_generation_does_not_wedge_the_path(storage):
    first = _save(storage, b"1")
    storage.write_file("_raydcp/gen-999999999999.meta", [b"forged"])
    ids = [_save(storage, str(i).encode()) for i in range(2, 5)]  # each used to fail: ConcurrentSaveError
    assert storage.read_metadata_bytes() == _meta(ids[-1], b"4")
    assert current_generation(storage) == 999999999999 + 3
    assert "_raydcp/gen-999999999999.meta" not in storage.list_files("_raydcp/")  # pruned like any other
    assert not storage.exists(f"data/{first}/r00000-f000.bin")
    assert [n for n in storage.list_files("data/")] == [f"data/{ids[-1]}/r00000-f000.bin"]


def test_unknown_and_corrupt_log_records_are_ignored(storage):
    _save(storage, b"1")
    for name, data in {"_raydcp/gen-7.meta": b"not the writer's name", "_raydcp/gen-x.meta": b"?",
                       "_raydcp/gen-0000000000099.meta": b"a leading zero the writer never writes",
                       "_raydcp/begun-nonsense": b""}.items():
        storage.write_file(name, [data])
    storage.write_file("_raydcp/gen-000000000001.meta", [b"\x00corrupt"])  # the current generation's record
    assert current_generation(storage) == 1
    _save(storage, b"2")
    last = _save(storage, b"3")
    assert storage.read_metadata_bytes() == _meta(last, b"3")
    assert current_generation(storage) == 3


def test_cleanup_of_the_replaced_save_does_not_depend_on_the_begun_records(storage):
    first = _save(storage, b"1")
    crashed = begin_save(storage)  # a save whose process died after writing
    storage.write_file(f"data/{crashed}/r00000-f000.bin", [b"partial"])
    storage.remove_files(_begun(storage))  # the records are lost
    second = _save(storage, b"2")
    assert not storage.exists(f"data/{first}/r00000-f000.bin")  # the replaced save: its metadata named it
    # a save with no record and never committed is not provably this path's (a data/ may be shared)
    assert storage.read_file(f"data/{crashed}/r00000-f000.bin") == b"partial"
    assert storage.read_metadata_bytes() == _meta(second, b"2")


def test_a_log_that_lost_its_generations_is_rebuilt_from_what_is_committed(storage):
    for i in range(3):
        committed = _save(storage, str(i).encode())
    in_flight = begin_save(storage)  # began on generation 3
    storage.write_file(f"data/{in_flight}/r00000-f000.bin", [b"late"])
    storage.remove_files([n for n in storage.list_files("_raydcp/") if "/gen-" in n])
    assert current_generation(storage) == 0

    after = begin_save(storage)  # the log is rebuilt: generation 3 was reached
    assert save_generation(after) == 3
    assert storage.read_file("_raydcp/gen-000000000003.meta") == _meta(committed, b"2")
    storage.write_file(f"data/{after}/r00000-f000.bin", [b"new"])
    prune(storage, commit_generation(storage, after, _meta(after, b"new")), after)
    with pytest.raises(ConcurrentSaveError):  # one winner among the saves begun on generation 3
        commit_generation(storage, in_flight, b"metadata late")
    assert storage.read_metadata_bytes() == _meta(after, b"new")
    assert storage.list_files("data/") == [f"data/{after}/r00000-f000.bin"]
    assert committed != after


def test_a_forged_generation_does_not_wedge_raydcp_save(tmp_path):
    path = str(tmp_path / "ckpt")
    raydcp.save({"w": torch.zeros(4)}, path)
    os.makedirs(f"{path}/_raydcp", exist_ok=True)
    with open(f"{path}/_raydcp/gen-999999999999.meta", "wb") as f:
        f.write(b"forged")
    for step in (1, 2):
        raydcp.save({"w": torch.full((4,), float(step))}, path)
        out = {"w": torch.empty(4)}
        raydcp.load(out, path)
        assert torch.equal(out["w"], torch.full((4,), float(step)))
    assert len(os.listdir(f"{path}/data")) == 1


def test_a_copy_whose_data_links_to_the_original_keeps_the_original_whole(tmp_path):
    original = CheckpointStorage(str(tmp_path / "original"))
    sid = _save(original, b"original")
    copy_dir = tmp_path / "copy"
    copy_dir.mkdir()
    os.symlink(tmp_path / "original" / "data", copy_dir / "data")
    copy = CheckpointStorage(str(copy_dir))
    copy.commit(original.read_metadata_bytes())  # the copy's metadata names the linked data

    # a save at the copy replaces the original's save id there: it must not reach through the link
    new = begin_save(copy)
    assert not copy.exists(f"data/{new}/r00000-f000.bin")
    prune(copy, commit_generation(copy, new, b"metadata of the copy"), new, replaced_save_id=sid)
    assert original.read_file(f"data/{sid}/r00000-f000.bin") == b"original"
    assert original.read_metadata_bytes() == _meta(sid, b"original")


def test_a_log_that_lost_every_record_is_rebuilt_from_the_committed_metadata(storage):
    for i in range(3):
        committed = _save(storage, str(i).encode())  # the last began on generation 2, committed 3
    storage.remove_files(storage.list_files("_raydcp/"))
    after = begin_save(storage)
    assert save_generation(after) == 3
    storage.write_file(f"data/{after}/r00000-f000.bin", [b"new"])
    prune(storage, commit_generation(storage, after, _meta(after, b"new")), after)
    assert storage.list_files("data/") == [f"data/{after}/r00000-f000.bin"]  # the replaced save went
    assert not storage.exists(f"data/{committed}/r00000-f000.bin")


def test_a_checkpoint_whose_data_another_links_to_never_removes_the_other_s_saves(tmp_path):
    ck1, ck2 = str(tmp_path / "ck1"), str(tmp_path / "ck2")
    raydcp.save({"w": torch.full((4,), 1.0)}, ck1)
    os.mkdir(ck2)
    os.symlink(os.path.join(ck1, "data"), os.path.join(ck2, "data"))  # ck2 shares ck1's data/
    for step in (2.0, 3.0):
        raydcp.save({"w": torch.full((4,), step)}, ck2)
    for step in (4.0, 5.0):
        raydcp.save({"w": torch.full((4,), step)}, ck1)  # ck1's cleanup lists data/, where ck2's saves are
    for path, step in ((ck1, 5.0), (ck2, 3.0)):
        out = {"w": torch.empty(4)}
        raydcp.load(out, path)
        assert torch.equal(out["w"], torch.full((4,), step))
