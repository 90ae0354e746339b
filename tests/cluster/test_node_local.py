"""Node-local disk tiers (``raynode://``, ``Tier(..., node_local=True)``) on a multi-node cluster.

Every simulated node has its own directory (the ``{node}`` placeholder): a file written by a
rank must exist only in its node's directory, a rank elsewhere reads it through that node's
holder, and a pipeline replicates each node's files to the shared tier before committing there.
"""
from __future__ import annotations

import glob
import os
import uuid

import pytest
import torch

import raydcp
from raydcp.pipeline import CheckpointPipeline, Tier

from ._ranks import full_state
from .test_memory_tier import _assert_exact, _load, _ranks, _save

# a cluster's start (the first test's setup) and its first workers take minutes on a loaded machine
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


def _data_files(root: str, node: str, ckpt: str) -> set[str]:
    return {os.path.basename(p) for p in glob.glob(f"{root}/{node}/{ckpt}/data/*/*")}


def test_each_rank_writes_on_its_own_node_and_loads_read_peers(cluster, tmp_path):
    url = f"raynode://{tmp_path}/{{node}}/direct"
    savers = _ranks(["n1", "n3"], fresh=True)
    _save(savers, url, step=20)
    n1, n3, head = cluster.node_id("n1"), cluster.node_id("n3"), cluster.node_id("node0")
    on1, on3 = _data_files(str(tmp_path), n1, "direct"), _data_files(str(tmp_path), n3, "direct")
    assert on1 and on3 and not on1 & on3  # each rank's file on its own node only
    assert not _data_files(str(tmp_path), head, "direct")
    assert os.path.exists(f"{tmp_path}/{head}/direct/raydcp.meta")  # the metadata on every alive node
    assert raydcp.read_metadata(url).world_size == 2
    # 3 ranks, one on a node without data: it reads its share from the other nodes' holders
    _assert_exact(_load(_ranks(["n1", "n3", "node0"]), url), step=20)


def test_pipeline_replicates_each_nodes_files_and_survives_the_node(cluster, tmp_path):
    import ray

    extra = cluster.add()
    tiers = [Tier(f"{tmp_path}/{{node}}", node_local=True), str(tmp_path / "shared")]
    ranks = [_ranks(["n1"])[0], *_ranks([extra], fresh=True)]
    group = f"pipe-{uuid.uuid4().hex[:8]}"
    record, files = ray.get([a.pipeline_save.remote(group, r, 2, tiers, "step-21", 21) for r, a in enumerate(ranks)])
    assert record["state"] == "complete", record
    on_extra = _data_files(str(tmp_path), cluster.node_id(extra), "step-21")
    assert on_extra and _data_files(str(tmp_path), cluster.node_id("n1"), "step-21")
    shared = str(tmp_path / "shared" / "step-21")
    assert on_extra <= {os.path.basename(p) for p in glob.glob(f"{shared}/data/*/*")}  # arrived, committed
    assert raydcp.read_metadata(shared).values["step"] == 21
    cluster.remove(extra)
    # the node-local copy lost a node's files: the pipeline loads the shared tier's copy
    pipe = CheckpointPipeline(tiers, driver="local", resume=False, async_save=False)
    try:
        whole = {**{k: torch.zeros_like(v) for k, v in full_state(0).items()}, "step": 0}
        got = pipe.load(whole, "step-21")
        assert got.tier == 1 and whole["step"] == 21
        assert all(torch.equal(whole[k], v) for k, v in full_state(21).items())
        assert any("raynode://" in url for url, _ in got.fallbacks)
    finally:
        pipe.close()
