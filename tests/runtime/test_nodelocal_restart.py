"""A node-local disk tier (``raynode://``) whose holder is restarted on a live node, on one Ray node.

The holder's index of the files on its node's disk is in memory; the files are not. A holder
that dies (its process, not its node) is replaced on the next call, and the new one finds the
files of its node's disk again: listings, sizes, loads and the next save's clean-up work as if
nothing happened.
"""
from __future__ import annotations

import glob
import os
import time

import pytest
import torch

import raydcp
from raydcp.runtime.memstore import placement

from ..engine.helpers import run_ranks


def _state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    w = torch.randn(16, 32, generator=g)
    return {"w": raydcp.Shard(w[rank * 8:(rank + 1) * 8].clone(), (rank * 8, 0), (16, 32)), "step": step}


def _save(url: str, step: int) -> None:
    from raydcp.engine.save import save_with

    _, errors = run_ranks(2, lambda t: save_with(t, _state(t.rank, step), url))
    assert errors == [None, None], errors


def _kill_disk_holder(ray, node: str) -> None:
    """Kill this node's disk holder (the node lives on) and wait until its name is free."""
    name = f"disk-holder-{node}"
    ray.kill(ray.get_actor(name, namespace=placement.NAMESPACE))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=placement.NAMESPACE)
        except ValueError:
            return
        time.sleep(0.1)
    raise AssertionError(f"{name} still registered 60 s after ray.kill")


@pytest.fixture
def fs(ray_session):
    import fsspec

    return fsspec.filesystem("raynode")


def test_a_restarted_holder_finds_its_nodes_files_again(ray_session, fs, tmp_path):
    node = ray_session.get_runtime_context().get_node_id()
    url = f"raynode://{tmp_path}/{{node}}/run/ckpt"
    _save(url, 1)
    before = {p: (i["size"], i["created"]) for p, i in fs.find(url, detail=True).items()}
    data = [p for p in before if "/data/" in p]
    assert len(data) == 2 and any(p.endswith("raydcp.meta") for p in before)
    old_files = glob.glob(f"{tmp_path}/{node}/run/ckpt/data/*/*.bin")
    assert len(old_files) == 2
    # a stray temporary file of an interrupted atomic publish: never indexed
    stray = f"{tmp_path}/{node}/run/ckpt/raydcp.meta.tmp-0123456789abcdef"
    open(stray, "wb").close()

    _kill_disk_holder(ray_session, node)
    # this process still has the dead holder's handle: the next call replaces it
    after = {p: (i["size"], i["created"]) for p, i in fs.find(url, detail=True).items()}
    assert after == before  # the same files, sizes and creation times
    info = fs.info(data[0])
    assert info["held_on"] == [node] and info["size"] == before[data[0]][0]

    md = raydcp.read_metadata(url)
    assert md.world_size == 2 and md.values["step"] == 1
    whole = {"w": torch.zeros(16, 32), "step": 0}
    raydcp.load(whole, url)
    assert torch.equal(whole["w"], torch.randn(16, 32, generator=torch.Generator().manual_seed(1)))

    # the next save to the path removes the files of the one it replaces: they are indexed again
    _save(url, 2)
    assert not [f for f in old_files if os.path.exists(f)]
    assert raydcp.read_metadata(url).values["step"] == 2
    assert os.path.exists(stray)  # not raydcp's to remove
