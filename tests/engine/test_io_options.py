"""The options of a call reach the write and read paths: IOOptions sizes and threads, and
SaveOptions' file size cap, through the synchronous save, both async persisters' session, the
rounds of a multi-round save and the load (observed through the storage calls they make)."""
from __future__ import annotations

import concurrent.futures as cf
import os

import pytest
import torch

import raydcp
from raydcp.engine import reads, session
from raydcp.engine.persist import LocalPersister
from raydcp.engine.rounds import new_save_id, round_save_id, write_round
from raydcp.options import AsyncOptions, IOOptions, LoadOptions, SaveOptions
from raydcp.storage import CheckpointStorage
from raydcp.transport import LocalTransport

MIB = 1 << 20
KIB = 1 << 10


def state():
    g = torch.Generator().manual_seed(3)
    sd = {f"small.{i:03d}": torch.randint(0, 256, (4 * KIB,), dtype=torch.uint8, generator=g) for i in range(64)}
    sd["big"] = torch.randint(0, 256, (9 * MIB + 5,), dtype=torch.uint8, generator=g)
    sd["mid"] = torch.randint(0, 256, (300 * KIB,), dtype=torch.uint8, generator=g)
    return sd


@pytest.fixture
def writes(monkeypatch):
    """Every ``write_files`` call: its ``max_workers`` and, per file, the sizes of the buffers written."""
    seen: dict = {"workers": [], "buffers": {}}
    real = CheckpointStorage.write_files

    def spy(self, files, max_workers=8, **kwargs):
        seen["workers"].append(max_workers)

        def sizes(name, bufs):
            for b in bufs:
                seen["buffers"].setdefault(name, []).append(memoryview(b).nbytes)
                yield b
        return real(self, {name: sizes(name, bufs) for name, bufs in files.items()}, max_workers=max_workers, **kwargs)

    monkeypatch.setattr(CheckpointStorage, "write_files", spy)
    return seen


def test_save_writes_with_the_io_options_it_is_given(tmp_path, writes):
    sd = state()
    raydcp.save(sd, tmp_path / "default")
    assert writes["workers"] == [8]
    assert max(max(v) for v in writes["buffers"].values()) == 4 * MIB  # the default write_bytes
    writes["workers"].clear()
    writes["buffers"].clear()
    io = IOOptions(write_threads=3, write_bytes=2 * MIB, pack_bytes=16 * KIB, pack_max=8 * KIB)
    md = raydcp.save(sd, tmp_path / "tuned", options=SaveOptions(io=io))
    assert writes["workers"] == [3]
    sizes = [s for v in writes["buffers"].values() for s in v]
    assert max(sizes) == 2 * MIB  # the big piece went out 2 MiB at a time
    (big,) = md.tensors["big"].chunks
    assert sizes.count(2 * MIB) == big.nbytes // (2 * MIB)
    # 64 small pieces of 4 KiB, packed 4 to a 16 KiB buffer (with the 64-byte alignment, 3 fit)
    packed = [s for s in sizes if s <= 16 * KIB and s > 4 * KIB]
    assert packed and max(packed) <= 16 * KIB and len(packed) >= 64 // 4
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    raydcp.load(out, tmp_path / "tuned")
    assert all(torch.equal(out[k], v) for k, v in sd.items())


def test_max_file_bytes_caps_the_data_files(tmp_path):
    sd = {f"t{i}": torch.full((256 * KIB,), i, dtype=torch.uint8) for i in range(8)}
    assert len(raydcp.save(sd, tmp_path / "one").files) == 1
    md = raydcp.save(sd, tmp_path / "many", options=SaveOptions(max_file_bytes=600 * KIB))
    assert len(md.files) == 4 and all(n <= 600 * KIB for n in md.files.values())
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    raydcp.load(out, tmp_path / "many")
    assert all(torch.equal(out[k], v) for k, v in sd.items())


def test_load_reads_with_the_io_options_it_is_given(tmp_path, monkeypatch):
    sd = state()
    raydcp.save(sd, tmp_path / "ck")
    calls: dict = {"into": [], "many": 0, "pools": []}
    real_into, real_many = CheckpointStorage.read_into, CheckpointStorage.read_into_many

    def into(self, name, start, out):
        calls["into"].append(memoryview(out).nbytes)
        return real_into(self, name, start, out)

    def many(self, name, requests):
        calls["many"] += 1
        return real_many(self, name, requests)

    class Pool(cf.ThreadPoolExecutor):
        def __init__(self, max_workers=None, **kw):
            calls["pools"].append(max_workers)
            super().__init__(max_workers, **kw)

    monkeypatch.setattr(CheckpointStorage, "read_into", into)
    monkeypatch.setattr(CheckpointStorage, "read_into_many", many)
    monkeypatch.setattr(reads, "ThreadPoolExecutor", Pool)

    def load(options=None):
        for k in calls:
            calls[k] = [] if k != "many" else 0
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        raydcp.load(out, tmp_path / "ck", options=options)
        assert all(torch.equal(out[k], v) for k, v in sd.items())
        calls["many"] -= len(calls["into"])  # read_into is one read_into_many of one request
        return dict(calls)

    default = load()
    assert sorted(default["into"]) == [300 * KIB, MIB + 5, 8 * MIB]  # big in 8 MiB tasks, mid pooled too
    assert default["many"] == 1 and default["pools"] == [2]
    tuned = load(LoadOptions(io=IOOptions(read_task_bytes=2 * MIB, read_threads=1, read_pool_min=512 * KIB,
                                          read_batch_bytes=32 * KIB)))
    assert sorted(tuned["into"]) == [MIB + 5] + [2 * MIB] * 4  # mid is now a small chunk
    assert tuned["pools"] == [1]
    assert tuned["many"] == 64 * 4 * KIB // (32 * KIB) + 1  # small chunks 32 KiB a batch, and mid alone


def test_the_persist_session_plans_and_writes_with_the_save_options(tmp_path, monkeypatch):
    seen = []
    real = session.write_rank_files

    def spy(*args, **kwargs):
        seen.append(kwargs.get("io"))
        return real(*args, **kwargs)

    monkeypatch.setattr(session, "write_rank_files", spy)
    sd = {f"t{i}": torch.full((256 * KIB,), i, dtype=torch.uint8) for i in range(4)}
    from raydcp.engine.save import local_save_plan
    from raydcp.state import flatten_state

    staged = local_save_plan(0, flatten_state(sd), compare_replicas=False)
    io = IOOptions(write_threads=2)
    s = session.PersistSession(LocalTransport(), str(tmp_path / "ck"), None, staged.plan,
                               options=SaveOptions(max_file_bytes=300 * KIB, io=io))
    batches = s.begin()
    assert len(s.plan.files) == 4  # one 256 KiB piece per file under the 300 KiB cap
    for index, _ in enumerate(batches):
        assert s.write(index, staged)
    md = s.commit()
    assert seen == [io] and len(md.files) == 4


def test_the_helper_process_persister_is_handed_the_save_options(tmp_path, monkeypatch):
    jobs = []
    persister = LocalPersister()
    try:
        monkeypatch.setattr(persister, "_send", lambda job, reads_memory=False: jobs.append(job))
        options = SaveOptions(max_file_bytes=1 * MIB, io=IOOptions(write_threads=1))
        persister.begin(None, str(tmp_path / "ck"), None, AsyncOptions(staging="shm"), options)
        assert jobs[0]["op"] == "begin" and jobs[0]["save_options"] is options
    finally:
        persister.close()


def test_async_save_in_the_helper_process_follows_the_save_options(tmp_path):
    sd = {f"t{i}": torch.full((256 * KIB,), i, dtype=torch.uint8) for i in range(6)}
    md = raydcp.async_save(sd, tmp_path / "ck", options=SaveOptions(max_file_bytes=300 * KIB)).result(60)
    assert len(md.files) == 6
    assert sorted(os.listdir(tmp_path / "ck" / "data" / md.save_id)) == sorted(f.rsplit("/", 1)[1] for f in md.files)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    raydcp.load(out, tmp_path / "ck")
    assert all(torch.equal(out[k], v) for k, v in sd.items())


def test_a_round_writes_with_the_save_options(tmp_path, writes):
    t = {f"w#{i}": torch.full((200 * KIB,), i, dtype=torch.uint8) for i in range(3)}
    path = str(tmp_path / "ck")
    rec = write_round(LocalTransport(), t, path, round_save_id(new_save_id(), 0),
                      options=SaveOptions(max_file_bytes=250 * KIB, io=IOOptions(write_threads=2)))
    assert writes["workers"] == [2]
    assert len(set(rec.records.files)) == 3


def test_public_calls_refuse_options_of_the_wrong_kind(tmp_path):
    with pytest.raises(raydcp.CheckpointError, match="options must be a raydcp.SaveOptions"):
        raydcp.save({"a": torch.ones(2)}, tmp_path / "ck", options=LoadOptions())
    with pytest.raises(raydcp.CheckpointError, match="options must be a raydcp.LoadOptions"):
        raydcp.load({"a": torch.ones(2)}, tmp_path / "ck", options=SaveOptions())
    with pytest.raises(raydcp.CheckpointError, match="options must be a raydcp.SaveOptions"):
        raydcp.async_save({"a": torch.ones(2)}, tmp_path / "ck", options=IOOptions()).result(10)
