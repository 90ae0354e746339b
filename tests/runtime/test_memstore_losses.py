"""raymem:// files that are gone: the reader is told what happened, on one Ray node.

A checkpoint released by ``keep_last`` while a load reads it is not damaged; a holder killed
between a save and a load took the checkpoint with it (the save had committed). Several nodes (a
node that left, a holder lost on a node that stays): tests/cluster.
"""
from __future__ import annotations

import time

import pytest
import torch

import raydcp
from raydcp.engine.save import save_with
from raydcp.errors import CheckpointNotFoundError
from raydcp.runtime.memstore import placement
from raydcp.runtime.memstore.filesystem import RayMemFileSystem
from raydcp.runtime.memstore.holder import MemHolder
from raydcp.runtime.memstore.incarnations import Incarnation
from raydcp.runtime.memstore.layout import is_data_file

from ..engine.helpers import run_ranks
from ._raymem_state import COLS, ROWS
from ._raymem_state import fresh_name
from ._raymem_state import save_two_ranks
from ._raymem_state import this_node as _node
from ._raymem_state import two_rank_state as _state

def _save(url: str, seed: int) -> None:
    errors = save_two_ranks(url, seed)
    assert errors == [None, None], errors


def _blank() -> dict:
    return {"w": torch.zeros(ROWS, COLS), "seed": -1}


@pytest.fixture
def name(ray_session):
    yield from fresh_name(ray_session, "loss")


# ----------------------------------------------------------------------------- plain classes


def test_a_holder_remembers_why_it_removed_a_file():
    h = MemHolder("n", kind="disk")  # no objects: no Ray needed
    h._walked.add("/")
    assert h.create("run/a/data/g0-0123456789ab/r00000-f000.bin", b"x", 1, ("n",), "t")
    assert h.create("run/b/data/g0-0123456789ab/r00000-f000.bin", b"x", 1, ("n",), "t")
    h.remove(["run/a/data/g0-0123456789ab/r00000-f000.bin"], reason="released by keep_last=1 when run/c committed")
    h.remove(["run/b/data/g0-0123456789ab/r00000-f000.bin"])  # no reason: nothing to tell
    gone = h.gone(["run/a/data/g0-0123456789ab/r00000-f000.bin", "run/b/data/g0-0123456789ab/r00000-f000.bin"])
    assert list(gone) == ["run/a/data/g0-0123456789ab/r00000-f000.bin"]
    assert gone["run/a/data/g0-0123456789ab/r00000-f000.bin"][0] == "released by keep_last=1 when run/c committed"


def test_a_successor_finds_what_its_predecessor_held_lost(tmp_path):
    first = Incarnation("node-a", str(tmp_path))
    first.committed("run/step-1", 10)
    first.committed("run/step-2", 20)
    first.released(["run/step-1"])  # released by retention: not held, so not lost either
    second = Incarnation("node-a", str(tmp_path))
    assert set(second.lost_under("run")) == {"run/step-2"}
    assert second.lost_under("run/step-2/raydcp.meta") == {"run/step-2": (20, second.started_ns)}
    assert second.lost_under("run/step-1") == {}
    second.committed("run/step-2", 30)  # saved again: no longer lost
    assert Incarnation("node-a", str(tmp_path)).lost_under("run/step-2")["run/step-2"][0] == 30
    assert Incarnation("node-b", str(tmp_path)).lost == {}  # another node's record is its own


# ----------------------------------------------------------------------------- on the session's Ray


def test_a_load_racing_the_release_of_its_checkpoint_is_told_it_was_released(name, monkeypatch):
    old, new = f"raymem://{name}/run/step-1", f"raymem://{name}/run/step-2"
    _save(old, 1)
    read = RayMemFileSystem._local_arrays
    raced = []

    def racing(self, paths):  # the newer save commits just as the load reads its first data file
        if not raced and any(is_data_file(p) for p in paths):
            raced.append(paths)
            _save(new, 2)  # keep_last=1 releases step-1
        return read(self, paths)

    monkeypatch.setattr(RayMemFileSystem, "_local_arrays", racing)
    whole = _blank()
    with pytest.raises(CheckpointNotFoundError) as err:
        raydcp.load(whole, old)
    assert raced
    text = str(err.value)
    assert f"{old} was released by keep_last=1 when {new} committed" in text, text
    assert "nothing is damaged" in text and "restore" not in text
    assert whole["seed"] == -1 and not whole["w"].any()  # the caller's state is as it was
    monkeypatch.undo()
    # and a load that starts later is told the same, not "not committed yet"
    with pytest.raises(CheckpointNotFoundError, match="released by keep_last=1"):
        raydcp.load(_blank(), old)
    raydcp.load(whole, new)
    assert whole["seed"] == 2


def test_a_holder_killed_between_save_and_load_is_named_as_the_loss(name):
    import ray

    url = f"raymem://{name}/ckpt"
    _save(url, 3)
    holder = placement.holder(_node())
    ray.kill(holder, no_restart=True)
    deadline = time.monotonic() + 60
    while True:  # gone before the load starts: ray.kill does not wait, a call may still be answered
        try:
            ray.get(holder.ping.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            break
        assert time.monotonic() < deadline, "the killed holder still answers"
    with pytest.raises(CheckpointNotFoundError) as err:
        raydcp.load(_blank(), url)
    text = str(err.value)
    assert f"{url} was committed, but the holder that held it is gone" in text, text
    assert _node() in text and "killed or crashed" in text and "replicas" in text
    assert "has not committed" not in text
    # the path can be saved to again, and loads
    _save(url, 4)
    whole = _blank()
    raydcp.load(whole, url)
    assert whole["seed"] == 4


def test_a_holder_killed_during_a_save_is_named_not_a_node_that_left(name, monkeypatch):
    import ray

    write = RayMemFileSystem.hold
    killed = []

    def killing(self, path, data, created_ns):
        if not killed and is_data_file(path):  # the holder dies as the first data file is written
            killed.append(path)
            ray.kill(placement.holder(_node()), no_restart=True)
        return write(self, path, data, created_ns)

    monkeypatch.setattr(RayMemFileSystem, "hold", killing)
    errors = run_ranks(2, lambda t: save_with(t, _state(t.rank, 5), f"raymem://{name}/ckpt", {}), timeout_s=120)[1]
    assert killed and all(e is not None for e in errors), errors
    text = str(errors[0])
    assert "died (killed or crashed) though its node is alive" in text and _node() in text, text
    assert "left the cluster" not in text and "nothing was committed" in text
