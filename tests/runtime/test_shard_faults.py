"""ShardGroup under faults: every rank fails together, names the culprit, and commits nothing."""
from __future__ import annotations

import threading
import time

import pytest
import torch

import raydcp
from raydcp.errors import CheckpointError

from ._shards import FaultyShardActor, bump, check_pieces, grow_global_shape, reference_state, same_bits

pytestmark = pytest.mark.ray

TIMEOUT_S = 3.0
# Bounds on whole operations: the timeout plus starting the operation's coordinator actor, which
# takes seconds on a loaded machine (tests/transport/test_transport.py times the timeout itself closely).
OPERATION_SLACK_S = 20.0


@pytest.fixture(scope="module")
def full():  # overrides conftest's: another seed
    return reference_state(seed=1)


@pytest.fixture(scope="module")
def faulty(ray_session):
    """Three CPU actors that survive their faults (nobody is killed here)."""
    g = raydcp.ShardGroup(3, num_gpus_per_actor=0, timeout_s=TIMEOUT_S, _actor_cls=FaultyShardActor)
    yield g
    g.shutdown()


def holds(ray, g, full, layout="dim0"):
    return ray.get([g.apply_remote(r, check_pieces, full, layout, r, g.world_size)
                    for r in range(g.world_size)]) == [[]] * g.world_size


def killed_while(ray, victim, step: str, operation) -> None:
    """Run ``operation`` while rank 1's actor ``victim`` hangs at ``step`` and is killed there: it fails
    within the timeout with one CheckpointError naming rank 1 as dead."""
    ray.get(victim.inject.remote(step, "hang"))

    def kill_when_stalled():
        if ray.get(victim.wait_reached.remote(60)):
            ray.kill(victim)

    killer = threading.Thread(target=kill_when_stalled)
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(CheckpointError) as info:
        operation()
    killer.join()
    assert time.monotonic() - t0 < TIMEOUT_S + OPERATION_SLACK_S
    assert "ranks [1] died" in str(info.value) and 1 in info.value.failures


def test_rank_that_never_arrives_is_named(ray_session, faulty, src, full, tmp_path):
    faulty.load(src, layout="dim0")
    # rank 1 stays away from the save's planning step until the others gave up on it
    ray_session.get(faulty.actors[1].inject.remote("save: plan", "absent"))
    t0 = time.monotonic()
    with pytest.raises(CheckpointError) as info:
        faulty.save(tmp_path / "ckpt")
    assert time.monotonic() - t0 < TIMEOUT_S + OPERATION_SLACK_S
    msg = str(info.value)
    assert "on ranks [0, 2]" in msg and "ranks [1]" in msg and "did not arrive within 3s" in msg
    assert 1 in info.value.failures
    with pytest.raises(CheckpointError, match="no committed raydcp checkpoint"):
        raydcp.read_metadata(tmp_path / "ckpt")
    # the group is still usable: the next operation runs under a fresh name
    faulty.save(tmp_path / "ckpt")
    assert raydcp.read_metadata(tmp_path / "ckpt").world_size == 3


def test_inconsistent_plans_fail_every_rank_naming_the_key(ray_session, faulty, src, full, tmp_path):
    faulty.load(src, layout="dim0")
    ray_session.get(faulty.actors[2].apply.remote(grow_global_shape, "model.w"))
    with pytest.raises(CheckpointError) as info:
        faulty.save(tmp_path / "bad")
    msg = str(info.value)
    assert "on ranks [0, 1, 2]" in msg and "model.w" in msg
    assert not (tmp_path / "bad" / "raydcp.meta").exists()
    faulty.load(src, layout="dim0")  # a fresh load repairs the state
    assert holds(ray_session, faulty, full)


def test_strict_load_with_missing_keys_fails_every_rank(ray_session, faulty, src, full, tmp_path):
    partial = {k: v for k, v in full.items() if k not in ("model.b", "step")}
    raydcp.save(partial, tmp_path / "partial")
    faulty.load(src, layout="dim1")
    with pytest.raises(CheckpointError) as info:
        faulty.load(tmp_path / "partial")  # in place: the group holds model.b and step
    msg = str(info.value)
    assert "on ranks [0, 1, 2]" in msg and "model.b" in msg and "step" in msg
    assert holds(ray_session, faulty, full, "dim1")  # nothing was overwritten
    ray_session.get([a.apply.remote(bump) for a in faulty.actors])
    faulty.load(tmp_path / "partial", strict=False)
    got = faulty.full_state_dict()
    assert all(same_bits(got[k], full[k]) for k in partial if isinstance(full[k], torch.Tensor))
    assert not same_bits(got["model.b"], full["model.b"])  # not in the checkpoint: left as it was


def test_actor_killed_mid_save_commits_nothing(ray_session, src, full, tmp_path):
    g = raydcp.ShardGroup(3, num_gpus_per_actor=0, timeout_s=TIMEOUT_S, _actor_cls=FaultyShardActor)
    try:
        path = tmp_path / "ckpt"
        g.load(src, layout="dim0")
        first = g.save(path)
        ray_session.get([a.apply.remote(bump) for a in g.actors])
        victim = g.actors[1]
        # rank 1 writes its files, then stalls before the commit step until it is killed
        killed_while(ray_session, victim, "save: commit", lambda: g.save(path))
        # nothing committed: the previous checkpoint is still the one there, bit-exact
        assert raydcp.read_metadata(path).save_id == first.save_id
        state = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else None) for k, v in full.items()}
        raydcp.load(state, path)
        assert all(same_bits(state[k], v) if isinstance(v, torch.Tensor) else state[k] == v for k, v in full.items())
        with pytest.raises(CheckpointError, match=r"died during save.*load the last checkpoint"):
            g.save(path)
    finally:
        g.shutdown()


def test_actor_killed_mid_reshard_breaks_both_groups_it_serves(ray_session, src, full):
    g = raydcp.ShardGroup(2, num_gpus_per_actor=0, timeout_s=TIMEOUT_S, _actor_cls=FaultyShardActor)
    try:
        g.load(src, layout="dim0")
        g.prepare_reshard(3)
        added = [m.handle for m in g._spares]
        ray_session.get([a.info.remote() for a in added])  # the added actor is up
        victim = g.actors[1]  # kept by the 3-rank group too: it sends its pieces and receives new ones
        killed_while(ray_session, victim, "reshard: publish", lambda: g.reshard(3))
        with pytest.raises(CheckpointError, match=r"died during reshard\(3\).*load the last checkpoint"):
            g.full_state_dict()
        assert ray_session.get(g.apply_remote(0, check_pieces, full, "dim0", 0, 2)) == []  # rank 0 kept its state
        with pytest.raises(ray_session.exceptions.RayActorError):  # the new group's added actor ended with it
            ray_session.get(added[0].info.remote(), timeout=30)
    finally:
        g.shutdown()
