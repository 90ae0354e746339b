"""raymem:// on a multi-node Ray cluster: saves and loads across nodes, node loss, caps, retention."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
import torch

import raydcp
from raydcp.errors import CheckpointError

from ._ranks import COLS, ROWS, MemRank, full_state, rows

pytestmark = pytest.mark.cluster


def _ranks(tags: list[str]):
    import ray

    remote = ray.remote(MemRank)
    return [remote.options(num_cpus=0, resources={tag: 1}, max_concurrency=4).remote() for tag in tags]


def _save(actors, ckpt: str, step: int, options: dict | None = None, timeout_s: float = 60.0):
    import ray

    name = f"save-{uuid.uuid4().hex[:8]}"
    n = len(actors)
    return ray.get([a.save.remote(name, r, n, ckpt, step, options, timeout_s) for r, a in enumerate(actors)])


def _load(actors, ckpt: str, options: dict | None = None) -> list[dict]:
    import ray

    name = f"load-{uuid.uuid4().hex[:8]}"
    n = len(actors)
    return ray.get([a.load.remote(name, r, n, ckpt, options) for r, a in enumerate(actors)])


def _assert_exact(pieces: list[dict], step: int) -> None:
    full = full_state(step)
    n = len(pieces)
    for r, piece in enumerate(pieces):
        lo, hi = rows(r, n)
        np.testing.assert_array_equal(piece["w"], full["w"][lo:hi].numpy())
        np.testing.assert_array_equal(piece["e"], full["e"][lo:hi].numpy())
        np.testing.assert_array_equal(piece["b"], full["b"].numpy())
        assert piece["step"] == step


def _fs():
    import fsspec

    return fsspec.filesystem("raymem")


def _kill(actors) -> None:
    import ray

    for a in actors:
        ray.kill(a)


def test_save_on_two_nodes_load_on_three_bit_exact(cluster):
    savers = _ranks(["n1", "n2"])
    files = _save(savers, "raymem://nm/ckpt", step=1)
    _kill(savers)  # the bytes outlive the workers that saved them
    md = raydcp.read_metadata("raymem://nm/ckpt")  # from the driver, on the head node
    assert md.world_size == 2 and set(md.tensors) == {"w", "e", "b"}
    # each file: on its writer's node and on one other node, never twice on one node
    writer_nodes = {cluster.node_id("n1"), cluster.node_id("n2")}
    for name in files[0]:
        info = _fs().info(f"raymem://nm/ckpt/{name}")
        assert len(info["held_on"]) == 2 and sorted(info["held_on"]) == sorted(info["nodes"])
        assert info["nodes"][0] in writer_nodes
    loaders = _ranks(["n1", "n2", "n3"])
    _assert_exact(_load(loaders, "raymem://nm/ckpt"), step=1)
    _kill(loaders)
    # one process holding everything (group=None), on the head node
    whole = {"w": torch.zeros(ROWS, COLS), "e": torch.zeros(ROWS, 3, dtype=torch.int64), "b": torch.zeros(COLS),
             "step": 0}
    raydcp.load(whole, "raymem://nm/ckpt")
    full = full_state(1)
    for key in ("w", "e", "b"):
        assert torch.equal(whole[key], full[key])
