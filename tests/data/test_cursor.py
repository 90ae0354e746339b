"""DataCursor: the global sample order DistributedSampler reads, a position saved as plain values,
and a resume on another number of ranks that sees exactly the samples an uninterrupted run would."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import raydcp
from raydcp.data import DataCursor

N = 50  # not a multiple of the global batch: epochs end with a part batch


def run(cursor: DataCursor, world: int, steps: int) -> list[list[int]]:
    """Each step's samples on all ranks together (rank order), consuming ``steps`` global batches."""
    out = []
    for _ in range(steps):
        out.append([i for r in range(world) for i in cursor.batch_indices(r, world)])
        cursor.step()
    return out


def resumed(cursor: DataCursor) -> DataCursor:
    fresh = DataCursor(N, cursor.global_batch_size, seed=cursor.seed, drop_last=cursor.drop_last)
    fresh.load_state_dict(cursor.state_dict())
    return fresh


def test_a_rank_reads_what_distributed_sampler_gives_it():
    data = TensorDataset(torch.arange(N))
    cursor = DataCursor(N, 8, seed=3)
    for rank in range(4):
        sampler = DistributedSampler(data, num_replicas=4, rank=rank, shuffle=True, seed=3, drop_last=True)
        ours = [b[0].tolist() for b in cursor.loader(data, rank, 4)]
        theirs = [b[0].tolist() for b in DataLoader(data, batch_size=2, sampler=sampler)]
        assert ours == theirs[:len(ours)] and len(ours) == N // 8


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("before, after", [(4, 2), (4, 3), (2, 4), (3, 3)])
def test_a_resume_on_another_world_size_continues_the_same_samples(before, after, drop_last):
    steps = 20  # past the end of several epochs
    whole = run(DataCursor(N, 12, seed=7, drop_last=drop_last), before, steps)
    for cut in (1, 4, 5, 9):
        first = DataCursor(N, 12, seed=7, drop_last=drop_last)
        seen = run(first, before, cut)
        seen += run(resumed(first), after, steps - cut)
        # every step takes the same samples; per rank order aside, as the uninterrupted run
        assert [sorted(s) for s in seen] == [sorted(s) for s in whole]
    per_epoch = len(DataCursor(N, 12, drop_last=drop_last).order())
    flat = [i for s in whole for i in s]
    for e in range(len(flat) // per_epoch):  # within an epoch no sample repeats, none is skipped
        assert len(set(flat[e * per_epoch:(e + 1) * per_epoch])) == per_epoch


def test_the_position_travels_in_a_checkpoint(tmp_path):
    cursor = DataCursor(N, 10, seed=1)
    run(cursor, 2, 7)
    path = str(tmp_path / "ckpt")
    raydcp.save({"data": cursor}, path)
    back = DataCursor(N, 10, seed=1)
    raydcp.load({"data": back}, path)
    assert (back.epoch, back.consumed) == (cursor.epoch, cursor.consumed) == (1, 20)
    assert back.batch_indices(0, 5) == cursor.batch_indices(0, 5)


def test_a_position_in_another_sample_order_is_refused():
    saved = DataCursor(N, 10, seed=1)
    saved.step()
    with pytest.raises(raydcp.CheckpointError, match="num_samples=50.*this one 60"):
        DataCursor(60, 10, seed=1).load_state_dict(saved.state_dict())
    with pytest.raises(raydcp.CheckpointError, match="not a whole number of global batches of 4"):
        DataCursor(N, 4, seed=1).load_state_dict(saved.state_dict())
    with pytest.raises(raydcp.CheckpointError, match="does not split evenly over 3 ranks"):
        saved.loader(list(range(N)), 0, 3)
