"""raymem:// commits: exclusive for real, and files known by the checkpoint's own layout.

Two saves racing to one memory-tier path: the commit log's exclusive creation is a
compare-and-set in each node's holder, so exactly one of them commits, the loser removes only its
own files, and the path holds one whole checkpoint afterwards. (Several nodes: tests/cluster.)
"""
from __future__ import annotations

import concurrent.futures as cf
import threading

import pytest
import torch

import raydcp
from raydcp.errors import ConcurrentSaveError
from raydcp.runtime.memstore.layout import checkpoint_dir, is_data_file, split_data_file
from raydcp.runtime.memstore.holder import MemHolder

from ._raymem_state import COLS, ROWS
from ._raymem_state import fresh_name
from ._raymem_state import raymem_fs as _fs
from ._raymem_state import save_two_ranks as _save
from ._raymem_state import this_node as _node

PER_RANK = ROWS // 2 * COLS * 4


def _load(url: str) -> dict:
    whole = {"w": torch.zeros(ROWS, COLS), "seed": -1}
    raydcp.load(whole, url)
    assert torch.equal(whole["w"], torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(whole["seed"])))
    return whole


@pytest.fixture
def name(ray_session):
    yield from fresh_name(ray_session, "cas")


# ----------------------------------------------------------------------------- the holder's compare-and-set


def test_holder_create_is_a_compare_and_set_and_uncreate_takes_back_only_its_own():
    h = MemHolder("n", kind="disk")  # a disk holder keeps no objects: no Ray needed here
    h._walked.add("/")  # nothing on this disk to index
    assert h.create("ck/_raydcp/gen-1", b"x", 1, ("n",), "tok-a", local_path=None) is True
    assert h.create("ck/_raydcp/gen-1", b"y", 2, ("n",), "tok-b", local_path=None) is False
    assert h.uncreate("ck/_raydcp/gen-1", "tok-b") is False  # not b's: it stays
    assert h.sizes(["ck/_raydcp/gen-1"]) == {"ck/_raydcp/gen-1": 1}
    assert h.uncreate("ck/_raydcp/gen-1", "tok-a") is True
    assert h.sizes(["ck/_raydcp/gen-1"]) == {}


# ----------------------------------------------------------------------------- on the session's Ray


def test_of_creators_racing_for_one_name_exactly_one_creates_it(name):
    fs = _fs()
    creators = 6
    for round_ in range(4):
        path = f"{name}/r{round_}/_raydcp/gen-000000000001.meta"
        start = threading.Barrier(creators)

        def create(i: int) -> bool:
            start.wait()
            try:
                fs.pipe_file(path, f"creator {i}".encode(), mode="create")
            except FileExistsError:
                return False
            return True

        with cf.ThreadPoolExecutor(creators) as pool:
            won = list(pool.map(create, range(creators)))
        assert sum(won) == 1, f"round {round_}: {sum(won)} creators were told they created {path}"
        assert fs.cat_file(path) == f"creator {won.index(True)}".encode()


def test_racing_saves_to_one_path_leave_one_whole_checkpoint(name):
    url = f"raymem://{name}/ckpt"
    assert _save(url, 100) == [None, None]
    for round_ in range(4):
        seeds = (2 * round_ + 1, 2 * round_ + 2)
        start = threading.Barrier(2)

        def save(seed: int) -> list:
            start.wait()
            return _save(url, seed)

        with cf.ThreadPoolExecutor(2) as pool:
            outcomes = dict(zip(seeds, pool.map(save, seeds)))
        won = [s for s, errors in outcomes.items() if errors == [None, None]]
        lost = {s: errors for s, errors in outcomes.items() if s not in won}
        assert won, f"round {round_}: no save committed: {outcomes}"
        for errors in lost.values():
            assert all(isinstance(e, ConcurrentSaveError) for e in errors), errors
            assert "another save committed" in str(errors[0])
        loaded = _load(url)  # whole: every byte of one save, its checksum verified
        assert loaded["seed"] in won
        # nothing of the loser stays, and the winner's files are all there
        saves = {p.split("/data/", 1)[1].split("/", 1)[0] for p in _fs().find(name) if is_data_file(p)}
        assert len(saves) == 1, f"round {round_}: the files of several saves remain: {saves}"


def test_a_checkpoint_named_with_a_data_component_commits_under_a_cap(name):
    """The cap is for data files: a commit log's file under ``.../data/step-1/_raydcp`` is not one."""
    fs = _fs()
    held = fs.usage()[_node()]
    cap = held["held"] + held["reserved"] + 2 * PER_RANK + 16  # room for the data files and no more
    url = f"raymem://{name}/data/step-1"
    assert _save(url, 7, {"node_cap_bytes": cap}) == [None, None]
    assert _load(url)["seed"] == 7
    assert _save(url, 8, {"node_cap_bytes": cap + 4 * PER_RANK}) == [None, None]  # replaces it
    assert _load(url)["seed"] == 8
    data = [p for p in fs.find(name) if is_data_file(p)]
    assert len(data) == 2 and all(checkpoint_dir(p) == f"{name}/data/step-1" for p in data)


def test_files_are_known_by_the_checkpoints_layout():
    assert split_data_file("exp/data/step-1/data/g0-0123456789ab/r00000-f000.bin") == (
        "exp/data/step-1", "data/g0-0123456789ab/r00000-f000.bin")
    assert split_data_file("data/0123456789abcdef/00002/r00001-f003.bin") == (
        "", "data/0123456789abcdef/00002/r00001-f003.bin")
    for other in ("exp/data/step-1/raydcp.meta", "exp/data/step-1/_raydcp/gen-000000000001.meta",
                  "exp/data/step-1/_raydcp/begun-g0-0123456789ab", "exp/data/labels.csv", "data/g0-x/r00000-f000.bin"):
        assert split_data_file(other) is None, other
