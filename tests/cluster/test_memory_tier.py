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
from raydcp.errors import CheckpointError, CheckpointNotFoundError

from ._ranks import COLS, ROWS, MemRank, full_state, rows

# a cluster's start (the first test's setup) and its first workers take minutes on a loaded machine
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

_CLI = [sys.executable, "-c", "import sys; from raydcp.cli import main; sys.exit(main())"]


_POOL: dict[str, object] = {}  # one rank actor per node tag, reused by the tests (worker starts are slow)


def _ranks(tags: list[str], fresh: bool = False):
    """A rank actor on each node of ``tags`` (new ones when ``fresh``: the test kills them)."""
    import ray

    remote = ray.remote(MemRank)
    out = []
    for tag in tags:
        if fresh or tag not in _POOL:
            actor = remote.options(num_cpus=0, resources={tag: 1}, max_concurrency=4).remote()
            if fresh:
                out.append(actor)
                continue
            _POOL[tag] = actor
        out.append(_POOL[tag])
    return out


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
    savers = _ranks(["n1", "n2"], fresh=True)
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
    # one process holding everything (group=None), on the head node
    whole = {"w": torch.zeros(ROWS, COLS), "e": torch.zeros(ROWS, 3, dtype=torch.int64), "b": torch.zeros(COLS),
             "step": 0}
    raydcp.load(whole, "raymem://nm/ckpt")
    full = full_state(1)
    for key in ("w", "e", "b"):
        assert torch.equal(whole[key], full[key])


def test_cli_inspect_and_verify_reach_the_cluster(cluster):
    savers = _ranks(["n2", "n3"])
    _save(savers, "raymem://cli/ckpt", step=4)
    env = dict(os.environ, RAY_ADDRESS=cluster.cluster.address)
    commands = [["inspect", "raymem://cli/ckpt", "--json"], ["verify", "raymem://cli/ckpt"],
                ["verify", "raymem://cli/nothing"]]
    procs = [subprocess.Popen([*_CLI, *cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd in commands]
    (inspected, _), (verified, verr), (missing, merr) = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs[:2]] == [0, 0], verr[-2000:]
    assert json.loads(inspected)["world_size"] == 2
    assert procs[2].returncode != 0 and "Traceback" not in merr
    assert "raymem://cli/nothing" in missing + merr


def test_node_cap_refuses_a_save_before_writing_and_keeps_the_previous(cluster):
    savers = _ranks(["n1", "n3"])
    _save(savers, "raymem://cap/ckpt", step=1)
    before = _fs().find("cap")
    with pytest.raises(CheckpointError) as err:
        _save(savers, "raymem://cap/ckpt", step=2, options={"node_cap_bytes": 1024})
    text = str(err.value)
    assert "no room for" in text and "node_cap_bytes" in text
    assert any(cluster.node_id(t) in text for t in cluster.nodes), text  # names the node
    assert _fs().find("cap") == before  # nothing of the refused save is held
    _assert_exact(_load(savers, "raymem://cap/ckpt"), step=1)


def test_keep_last_releases_older_checkpoints_only_after_a_commit(cluster):
    savers = _ranks(["n1", "n2"])
    _save(savers, "raymem://kl/a", step=1)
    _save(savers, "raymem://kl/b", step=2)  # keep_last=1: a goes once b committed
    # not "not committed": the reader is told it was released (nothing is damaged)
    with pytest.raises(CheckpointNotFoundError, match="raymem://kl/a was released by keep_last=1 when raymem://kl/b"):
        raydcp.read_metadata("raymem://kl/a")
    assert _fs().find("kl/a") == []
    _assert_exact(_load(savers, "raymem://kl/b"), step=2)
    _save(savers, "raymem://kl/c", step=3, options={"keep_last": 2})
    _assert_exact(_load(savers, "raymem://kl/b"), step=2)
    _assert_exact(_load(savers, "raymem://kl/c"), step=3)
    held = {n: u["held"] for n, u in _fs().usage().items()}
    _save(savers, "raymem://kl/d", step=4)  # keep_last=1 again: b and c released, d held
    assert [p.rsplit("/", 1)[0] for p in _fs().find("kl") if p.endswith("raydcp.meta")] == ["kl/d"]
    assert sum(u["held"] for u in _fs().usage().values()) < sum(held.values())


def test_node_lost_after_commit_loads_from_replicas(cluster):
    savers = _ranks(["n1", "n2"])
    _save(savers, "raymem://lost/ckpt", step=5)
    _save(savers, "raymem://single/ckpt", step=6, options={"replicas": 0})
    files = _fs().find("single/ckpt/data")
    on_n2 = [f for f in files if _fs().info(f)["held_on"] == [cluster.node_id("n2")]]
    assert on_n2  # rank 1's file of the unreplicated checkpoint is only on n2
    cluster_lost = cluster.node_id("n2")
    cluster.remove("n2")
    _POOL.pop("n2")
    survivors = _ranks(["n1", "n3", "node0"])
    _assert_exact(_load(survivors, "raymem://lost/ckpt"), step=5)
    # a file whose every copy was lost: the load fails naming it
    with pytest.raises(CheckpointError) as err:
        _load(survivors, "raymem://single/ckpt")
    assert any(f"raymem://{f}" in str(err.value) for f in on_n2), str(err.value)
    assert "no live copy" in str(err.value) and cluster_lost in str(err.value)


def test_node_lost_mid_save_fails_every_rank_and_keeps_the_previous(cluster):
    import ray

    doomed = cluster.add()
    first = [_ranks(["n1"])[0], *_ranks([doomed], fresh=True)]
    _save(first, "raymem://mid/ckpt", step=7)
    timeout_s = 20.0
    name = f"save-{uuid.uuid4().hex[:8]}"
    t0 = time.monotonic()
    waiting = first[0].save.remote(name, 0, 2, "raymem://mid/ckpt", 8, None, timeout_s)
    gated = first[1].save.remote(name, 1, 2, "raymem://mid/ckpt", 8, None, timeout_s, True)
    cluster.remove(doomed)
    with pytest.raises(CheckpointError) as err:
        ray.get(waiting, timeout=timeout_s + 60)
    assert "ranks [1]" in str(err.value) and "did not arrive" in str(err.value)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(gated, timeout=60)
    assert time.monotonic() - t0 < timeout_s + 60  # bounded: no hang
    assert raydcp.read_metadata("raymem://mid/ckpt").values["step"] == 7  # nothing committed
    survivors = _ranks(["n1", "n3"])
    _assert_exact(_load(survivors, "raymem://mid/ckpt"), step=7)


def _whole(step: int) -> dict:
    return {**full_state(step), "step": step}


def test_async_save_from_ranks_and_from_the_driver(cluster):
    import ray

    savers = _ranks(["n1", "n3"])
    name = f"async-{uuid.uuid4().hex[:8]}"
    ray.get([a.async_save.remote(name, r, 2, "raymem://as/ranks", 10) for r, a in enumerate(savers)])
    _assert_exact(_load(_ranks(["n3", "node0", "n1"]), "raymem://as/ranks"), step=10)
    # group=None: a helper process of the driver writes, and reaches the same cluster
    raydcp.async_save(_whole(11), "raymem://as-driver/ckpt").result(timeout=240)
    _assert_exact(_load(savers, "raymem://as-driver/ckpt"), step=11)


def test_shard_group_loads_and_saves_raymem(cluster):
    src = "raymem://sg-src/ckpt"
    raydcp.save(_whole(12), src)
    full = full_state(12)
    two = raydcp.ShardGroup(2, num_gpus_per_actor=0, timeout_s=120)
    try:
        two.load(src)
        two.save("raymem://sg-out/ckpt")
    finally:
        two.shutdown()
    three = raydcp.ShardGroup(3, num_gpus_per_actor=0, timeout_s=120)
    try:
        three.load("raymem://sg-out/ckpt")
        got = three.full_state_dict()
    finally:
        three.shutdown()
    for key in ("w", "e", "b"):
        assert torch.equal(got[key], full[key])
    assert got["step"] == 12


def test_pipeline_with_a_memory_tier_above_disk(cluster, tmp_path):
    from raydcp.pipeline import CheckpointPipeline

    disk = str(tmp_path / "disk")
    p = CheckpointPipeline(["raymem://pipe", disk], driver="local")
    try:
        p.save(_whole(13), "step-13").wait(timeout=240)
        p.save(_whole(14), "step-14").wait(timeout=240)
        assert raydcp.read_metadata(os.path.join(disk, "step-14")).values["step"] == 14
        # the pipeline's retention (one checkpoint on a memory tier by default) pruned step-13 there
        assert not _fs().exists("pipe/step-13/raydcp.meta")
        whole = {**{k: torch.zeros_like(v) for k, v in full_state(0).items()}, "step": 0}
        got = p.load(whole, "step-14")
        assert got.url == "raymem://pipe/step-14" and whole["step"] == 14
        assert all(torch.equal(whole[k], v) for k, v in full_state(14).items())
        _fs().rm("pipe/step-14", recursive=True)  # the memory copy is gone: the disk tier serves
        whole = {**{k: torch.zeros_like(v) for k, v in full_state(0).items()}, "step": 0}
        got = p.load(whole, "step-14")
        assert got.tier == 1 and whole["step"] == 14
        assert all(torch.equal(whole[k], v) for k, v in full_state(14).items())
    finally:
        p.close()
