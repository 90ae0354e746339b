"""Survivors saves on two nodes: 4 ranks, 2 on a node of the test's own that is removed before or
during the save. With replicated state the 2 survivors commit without the lost ranks and resume
from the checkpoint; with state that only the lost ranks held nothing is committed, every survivor
gets the error naming the keys and ranks, and the resume finds the previous checkpoint."""
from __future__ import annotations

import uuid

import pytest
import ray
import torch

import raydcp

from ._survivors import KEYS, SurvivorRank, replicated

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


@pytest.fixture
def ranks(cluster):
    """Ranks 0-1 on node n1, ranks 2-3 on a node of this test's own (removed by the test)."""
    extra = cluster.add()
    actors = [ray.remote(SurvivorRank).options(num_cpus=0, max_concurrency=2, resources={tag: 1}).remote(r)
              for r, tag in enumerate(["n1", "n1", extra, extra])]
    nodes = ray.get([a.ready.remote() for a in actors], timeout=300)
    assert nodes[2] == cluster.node_id(extra) != nodes[0]
    yield actors, extra
    if extra in cluster.nodes:
        cluster.remove(extra)
    for a in actors[:2]:
        ray.kill(a)


def _resume(actors, path, shard=False) -> list[dict]:
    """The survivors (ranks 0-1) load ``path`` as a group of 2."""
    name = f"resume-{uuid.uuid4().hex[:8]}"
    return ray.get([a.resume.remote(name, path, r, 2, shard) for r, a in enumerate(actors[:2])], timeout=300)


@pytest.mark.parametrize("when", ["during", "before"])
def test_replicated_state_commits_without_the_removed_node_and_resumes(cluster, ranks, tmp_path, when):
    actors, extra = ranks
    name, path = f"survivors-{uuid.uuid4().hex[:8]}", str(tmp_path / "ckpt")
    # step 1: a plain save of all 4 (the group knows every rank's process from it)
    assert ray.get([a.save.remote(name, path, 1, survivors=False) for a in actors], timeout=300) == [[]] * 4
    if when == "during":  # ranks 2-3 stop once the save has planned (they had files to write)
        refs = [a.save.remote(name, path, 2) for a in actors[:2]]
        for a in actors[2:]:
            a.save.remote(name, path, 2, hold=True)
        assert all(ray.get([a.wait_holding.remote(120) for a in actors[2:]], timeout=300))
        cluster.remove(extra)
    else:
        cluster.remove(extra)
        refs = [a.save.remote(name, path, 2) for a in actors[:2]]
    assert ray.get(refs, timeout=300) == [[2, 3]] * 2
    md = raydcp.read_metadata(path)
    assert md.values["step"] == 2 and md.world_size == 4 and md.extra["lost_ranks"] == [2, 3]
    for state in _resume(actors, path):
        assert state["step"] == 2
        for k in KEYS:
            assert torch.equal(state[k], replicated(2)[k]), k


def test_state_only_the_removed_node_held_commits_nothing(cluster, ranks, tmp_path):
    actors, extra = ranks
    name, path = f"survivors-{uuid.uuid4().hex[:8]}", str(tmp_path / "ckpt")
    assert ray.get([a.save.remote(name, path, 1, survivors=False, shard=True) for a in actors], timeout=300) == [[]] * 4
    cluster.remove(extra)
    for err in ray.get([a.save.remote(name, path, 2, shard=True) for a in actors[:2]], timeout=300):
        assert isinstance(err, raydcp.StateNotCoveredError), err
        assert err.keys == ("w",) and err.lost_ranks == (2, 3) and "rank 2" in str(err) and "rank 3" in str(err)
    assert raydcp.read_metadata(path).values["step"] == 1  # the previous checkpoint, whole
    first = _resume(actors, path, shard=True)  # ranks 0-1 of 2 now hold rows 0-3 and 4-7 of step 1's w
    assert [s["step"] for s in first] == [1, 1]
    assert torch.equal(torch.cat([s["w"] for s in first]),
                       torch.cat([torch.full((2, 4), float(r + 100)) for r in range(4)]))
