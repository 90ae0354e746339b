"""raymem:// per-node byte caps: a whole save is reserved at its plan step, on one Ray node.

The room a save needs is known once the global plan is (each rank's bytes, times the copies, per
node): a save that does not fit fails every rank there, before any byte is staged or written, and
the room it gets is reserved -- two saves in flight cannot both count on it -- until it commits
or fails. (Several nodes and replicas: tests/cluster.)
"""
from __future__ import annotations

import concurrent.futures as cf
import sys
import threading
import uuid

import pytest
import torch

import raydcp
from raydcp.engine.background import start_async_save
from raydcp.engine.save import save_with
from raydcp.errors import CheckpointError
from raydcp.options import AsyncOptions
from raydcp.runtime.memstore import placement
from raydcp.runtime.memstore.capacity import NodeCapacityError
from raydcp.runtime.memstore.holder import MemHolder

from ..engine.helpers import run_ranks

ROWS, COLS = 64, 128  # float32: 32 KiB per rank's piece with 2 ranks, a multiple of the 64-byte alignment
PER_RANK = ROWS // 2 * COLS * 4


def _state(rank: int, seed: int) -> dict:
    full = torch.Generator().manual_seed(seed)
    w = torch.randn(ROWS, COLS, generator=full)
    lo = rank * ROWS // 2
    return {"w": raydcp.Shard(w[lo:lo + ROWS // 2].clone(), (lo, 0), (ROWS, COLS)), "seed": seed}


def _save(url: str, seed: int, options: dict) -> tuple[list, list]:
    return run_ranks(2, lambda t: save_with(t, _state(t.rank, seed), url, options))


def _fs():
    import fsspec

    return fsspec.filesystem("raymem")


def _node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _usage() -> dict:
    return _fs().usage()[_node()]


@pytest.fixture
def name(ray_session):
    ray_session.get(placement.holder(_node()).ping.remote())  # this node's holder runs (usage() counts it)
    name = f"cap-{uuid.uuid4().hex[:8]}"
    yield name
    _fs().rm(name, recursive=True)


# ----------------------------------------------------------------------------- the holder's accounting


def test_holder_files_take_their_bytes_from_their_saves_reservation():
    h = MemHolder("n")
    assert h.reserve_save("ck/data/g0-a", 100, cap=150, created_ns=1) is None
    # a second save that would not fit beside the first is refused as a whole, saying why
    refusal = h.reserve_save("ck/data/g0-b", 60, cap=150, created_ns=2)
    assert refusal == {"node": "n", "used": 100, "held": 0, "cap": 150, "need": 60}
    # the first save's files fit in its reservation, though the cap has no room left beside it
    assert h.reserve("t1", 70, 150, "ck/data/g0-a/r00000-f000.bin") is None
    assert h.usage()["reserved"] == 100
    # beyond its reservation a file is checked against the cap like any other
    assert h.reserve("t2", 90, 150, "ck/data/g0-a/r00001-f000.bin")["need"] == 90
    assert h.reservations("ck/") == {"ck/data/g0-a": (30, 1)}  # the refused file took nothing
    assert h.reserve("t3", 10, 150, "other/data/g0-a/r00000-f000.bin") is None  # another save's file
    h.release_saves(["ck/data/g0-a"])
    assert h.usage()["reserved"] == 80  # the two files being written


# ----------------------------------------------------------------------------- saves on the cluster


def test_a_save_that_does_not_fit_fails_every_rank_before_writing(name):
    base = _usage()["held"]
    cap = base + 2 * PER_RANK + 1024  # room for one checkpoint (files take it from their reservation)
    options = {"node_cap_bytes": cap}
    results, errors = _save(f"raymem://{name}/a", 1, options)
    assert errors == [None, None] and results[0].values["seed"] == 1
    assert _usage()["reserved"] == 0  # released by the commit
    held = sorted(_fs().find(name))
    # keep_last=1 releases a only once b committed: a and b together do not fit
    results, errors = _save(f"raymem://{name}/b", 2, options)
    assert all(isinstance(e, NodeCapacityError) for e in errors), errors
    err = errors[0]
    text = str(err)
    assert err.node == _node() and err.needed == 2 * PER_RANK and err.free < err.needed
    assert f"raymem://{name}/b" in text and _node() in text and f"needs {2 * PER_RANK} bytes" in text
    assert "node_cap_bytes" in text and "keep_last=1" in text and "nothing was staged or written" in text
    assert sorted(_fs().find(name)) == held  # nothing of b: no data file, no record of its begin
    assert _usage()["reserved"] == 0
    whole = {"w": torch.zeros(ROWS, COLS), "seed": 0}
    raydcp.load(whole, f"raymem://{name}/a")
    assert whole["seed"] == 1


def test_a_reservation_in_flight_keeps_its_room_from_another_save(name):
    fs = _fs()
    node = _node()
    cap = _usage()["held"] + 3 * PER_RANK
    site = (node, cap)
    fs.reserve_save(f"{name}/other", "g0-000000000000", {site: 2 * PER_RANK})  # a save in flight
    try:
        _, errors = _save(f"raymem://{name}/a", 3, {"node_cap_bytes": cap})
        assert all(isinstance(e, NodeCapacityError) for e in errors), errors
        assert f"{2 * PER_RANK} reserved by saves in flight" in str(errors[0])
    finally:
        fs.release_save(f"{name}/other", "g0-000000000000")
    _, errors = _save(f"raymem://{name}/a", 3, {"node_cap_bytes": cap})
    assert errors == [None, None]


def test_of_two_saves_racing_for_the_same_room_one_gets_it(name):
    fs = _fs()
    cap = _usage()["held"] + _usage()["reserved"] + 3 * PER_RANK
    site = (_node(), cap)
    start = threading.Barrier(2)

    def reserve(i: int) -> BaseException | None:
        start.wait()
        try:
            fs.reserve_save(f"{name}/race-{i}", f"g0-{i:012d}", {site: 2 * PER_RANK})
        except CheckpointError as exc:
            return exc
        return None

    with cf.ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(reserve, range(2)))
    try:
        assert sum(o is None for o in outcomes) == 1
        assert any(isinstance(o, NodeCapacityError) for o in outcomes)
        assert _usage()["reserved"] >= 2 * PER_RANK
    finally:
        for i in range(2):
            fs.release_save(f"{name}/race-{i}", f"g0-{i:012d}")
    assert _usage()["reserved"] == 0


def test_a_save_that_fails_while_writing_gives_its_room_back(name, monkeypatch):
    engine_save = sys.modules["raydcp.engine.save"]  # the module (raydcp.engine.save is also a function's name)
    write = engine_save.write_rank_files

    def failing(storage, plan, staged, read=None, **kwargs):
        if plan.rank == 1:
            raise OSError("device full (injected)")
        return write(storage, plan, staged, read, **kwargs)

    monkeypatch.setattr(engine_save, "write_rank_files", failing)
    cap = _usage()["held"] + 4 * PER_RANK
    _, errors = _save(f"raymem://{name}/a", 4, {"node_cap_bytes": cap})
    assert all(isinstance(e, CheckpointError) and "injected" in str(e) for e in errors), errors
    assert _usage()["reserved"] == 0
    assert not [p for p in _fs().find(name) if "/data/" in p]  # rank 0's file was removed too


# ----------------------------------------------------------------------------- async_save


class _RefusingPersister:
    """An AsyncPersister whose plan step refuses the save, as a raymem:// plan that does not fit."""

    rank, world_size = 0, 1

    def __init__(self):
        self.staged = []

    def begin(self, plan, checkpoint_id, storage_options, options, save_options):
        fut: cf.Future = cf.Future()
        fut.set_exception(NodeCapacityError("no room (test)", node="n", needed=2, free=1, cap=3))
        return fut

    def write(self, index, staged, items):
        self.staged.append(items)
        fut: cf.Future = cf.Future()
        fut.set_result(False)
        return fut

    def commit(self, error):
        fut: cf.Future = cf.Future()
        fut.set_exception(CheckpointError("committed nothing"))
        return fut


@pytest.mark.parametrize("url, stages", [("raymem://async-cap/ckpt", False), ("/tmp/raydcp-async-cap", True)])
def test_async_save_to_memory_waits_for_the_plan_before_staging(url, stages):
    persister = _RefusingPersister()
    future = start_async_save(persister, {"w": torch.ones(4)}, url, None, AsyncOptions())
    with pytest.raises(CheckpointError):
        future.result(timeout=10)
    assert bool(persister.staged) is stages  # raymem://: nothing staged once the plan refused it
