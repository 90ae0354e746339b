"""ShardGroup.load in place: a load that fails on any rank leaves every rank's held state as it was."""
from __future__ import annotations

import os

import pytest

import raydcp
from raydcp.errors import CheckpointDamagedError, CheckpointError

from ._shards import FaultyShardActor, assert_holds, reference_state

pytestmark = pytest.mark.ray

TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def group(ray_session):
    g = raydcp.ShardGroup(3, num_gpus_per_actor=0, timeout_s=TIMEOUT_S, _actor_cls=FaultyShardActor)
    yield g
    g.shutdown()


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """Another state of the same keys, shapes and dtypes, saved by one participant."""
    path = str(tmp_path_factory.mktemp("other") / "ck")
    raydcp.save(reference_state(seed=7), path)
    return path


def test_damaged_piece_leaves_every_rank_as_it_was(ray_session, group, src, full, other, tmp_path):
    damaged = tmp_path / "damaged"
    md = raydcp.save(reference_state(seed=7), damaged)
    chunk = md.tensors["model.emb"].chunks[0]  # rows of it go to every rank; the damage is in the last row
    with open(os.path.join(damaged, chunk.file), "r+b") as f:
        f.seek(chunk.byte_offset + chunk.nbytes - 1)
        b = f.read(1)
        f.seek(chunk.byte_offset + chunk.nbytes - 1)
        f.write(bytes([b[0] ^ 0x01]))
    group.load(src, layout="dim0")
    with pytest.raises(CheckpointDamagedError, match="model.emb: checksum mismatch"):
        group.load(damaged)  # in place
    assert_holds(ray_session, group, full, "dim0")
    group.load(other)
    assert_holds(ray_session, group, reference_state(seed=7), "dim0")


def test_rank_missing_at_the_last_step_leaves_every_rank_as_it_was(ray_session, group, src, full, other):
    """Every rank has read and written its pieces when rank 1 fails to arrive at the last step:
    the others give up on it, and every rank puts its pieces back."""
    group.load(src, layout="dim1")
    ray_session.get(group.actors[1].inject.remote("load: finish", "absent"))
    with pytest.raises(CheckpointError, match=r"rank.*1"):
        group.load(other)
    assert_holds(ray_session, group, full, "dim1")


def test_failed_reshard_leaves_the_group_it_started_from_as_it_was(ray_session, group, src, full):
    """A kept actor fails to receive its new pieces: the reshard fails, and this group still
    holds its state and reshards again."""
    group.load(src, layout="dim0")
    ray_session.get(group.actors[0].inject.remote("reshard: receive", "raise"))
    with pytest.raises(CheckpointError, match="a failure injected at reshard: receive"):
        group.reshard(2)
    assert_holds(ray_session, group, full, "dim0")
    new = group.reshard(2)
    try:
        assert_holds(ray_session, new, full, "dim0")
    finally:
        new.shutdown()
    assert_holds(ray_session, group, full, "dim0")
