"""raymem:// on several nodes: racing saves leave one whole checkpoint; lost copies are named.

The commit log's exclusive creation meets every alive node's holder (a compare-and-set each, in
ring order): of two groups saving to one path from different nodes exactly one commits. A holder
killed on a node that stays alive takes its copies with it, and the reader is told so (not that
the node left the cluster).
"""
from __future__ import annotations

import uuid

import pytest
import torch

import raydcp
from raydcp.errors import CheckpointDamagedError
from raydcp.runtime.memstore.layout import split_data_file
from raydcp.runtime.memstore.placement import NAMESPACE

from ._ranks import COLS, ROWS, MemRank, full_state

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

_POOL: dict[str, object] = {}


def _ranks(tags: list[str]):
    import ray

    remote = ray.remote(MemRank)
    for tag in tags:
        if tag not in _POOL:
            _POOL[tag] = remote.options(num_cpus=0, resources={tag: 1}, max_concurrency=4).remote()
    return [_POOL[t] for t in tags]


def _start_save(actors, ckpt: str, step: int, options: dict | None = None) -> list:
    name = f"save-{uuid.uuid4().hex[:8]}"
    return [a.save.remote(name, r, len(actors), ckpt, step, options, 120.0) for r, a in enumerate(actors)]


def _outcome(refs: list) -> list:
    import ray

    out = []
    for ref in refs:
        try:
            ray.get(ref)
            out.append(None)
        except Exception as exc:  # a rank's error, as Ray hands it over
            out.append(exc)
    return out


def _load_whole(url: str) -> dict:
    whole = {"w": torch.zeros(ROWS, COLS), "e": torch.zeros(ROWS, 3, dtype=torch.int64), "b": torch.zeros(COLS),
             "step": -1}
    raydcp.load(whole, url)
    full = full_state(whole["step"])
    for key in ("w", "e", "b"):
        assert torch.equal(whole[key], full[key]), key
    return whole


def _fs():
    import fsspec

    return fsspec.filesystem("raymem")


def _live_tags(cluster) -> list[str]:
    """The tags of the nodes the package's cluster has now (other tests remove and add nodes)."""
    return sorted(cluster.nodes)


def test_saves_racing_from_different_nodes_leave_one_whole_checkpoint(cluster):
    url = "raymem://race/ckpt"
    tags = _live_tags(cluster)
    assert len(tags) >= 3, tags
    first, second = _ranks(tags[:2]), _ranks(tags[2:4])  # a group of two ranks, one of one or two
    assert _outcome(_start_save(first, url, 1)) == [None, None]
    for round_ in range(3):
        steps = (10 + 2 * round_, 11 + 2 * round_)
        refs = [_start_save(first, url, steps[0]), _start_save(second, url, steps[1])]
        outcomes = [_outcome(r) for r in refs]
        won = [s for s, o in zip(steps, outcomes) if all(e is None for e in o)]
        assert won, f"round {round_}: neither save committed: {outcomes}"
        for s, o in zip(steps, outcomes):
            if s not in won:
                assert all(e is not None and "another save committed" in str(e) for e in o), o
        assert _load_whole(url)["step"] in won
        saves = {split_data_file(p)[1].split("/")[1] for p in _fs().find("race") if split_data_file(p)}
        assert len(saves) == 1, f"round {round_}: files of several saves remain: {saves}"


def test_a_holder_lost_on_a_live_node_is_named_as_such(cluster):
    import ray

    url = "raymem://lost-holder/ckpt"
    tag = next(t for t in _live_tags(cluster) if t != "node0")  # not the driver's node
    assert _outcome(_start_save(_ranks([tag]), url, 5, {"replicas": 0})) == [None]  # its file only there
    assert _load_whole(url)["step"] == 5
    node = cluster.node_id(tag)
    ray.kill(ray.get_actor(f"holder-{node}", namespace=NAMESPACE), no_restart=True)
    with pytest.raises(CheckpointDamagedError) as err:
        _load_whole(url)
    text = str(err.value)
    assert "has no live copy" in text and node in text and "which are alive, are gone" in text, text
    assert "left the cluster" not in text and "replicas" in text
