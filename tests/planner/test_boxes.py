import itertools
import random

import torch

from raydcp.planner import byte_runs, intersect, merge_runs


def _gather(chunk: torch.Tensor, chunk_off, sub_off, sub_size):
    """Bytes of a sub-box gathered through byte_runs, as a tensor."""
    raw = chunk.contiguous().view(-1).view(torch.uint8)
    runs = byte_runs(chunk_off, tuple(chunk.shape), sub_off, sub_size, chunk.element_size())
    data = torch.cat([raw[s:e] for s, e in runs]) if runs else raw[:0]
    return data.view(chunk.dtype).reshape(sub_size)


def test_byte_runs_match_tensor_slicing_over_random_boxes():
    rng = random.Random(0)
    for _ in range(300):
        nd = rng.randint(1, 4)
        shape = tuple(rng.randint(1, 5) for _ in range(nd))
        off = tuple(rng.randint(0, 3) for _ in range(nd))
        chunk = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.int32).reshape(shape)
        sub_rel = tuple(rng.randint(0, s - 1) for s in shape)
        sub_size = tuple(rng.randint(1, s - r) for s, r in zip(shape, sub_rel))
        sub_off = tuple(o + r for o, r in zip(off, sub_rel))
        expect = chunk[tuple(slice(r, r + n) for r, n in zip(sub_rel, sub_size))]
        assert torch.equal(_gather(chunk, off, sub_off, sub_size), expect)


def test_full_trailing_dims_merge_into_one_run_per_row():
    runs = byte_runs((0, 0, 0), (4, 3, 2), (1, 0, 0), (2, 3, 2), 4)
    assert runs == [(24, 72)]
    runs = byte_runs((0, 0), (4, 6), (0, 2), (4, 2), 1)
    assert runs == [(2, 4), (8, 10), (14, 16), (20, 22)]


def test_zero_dim_chunk_is_one_item():
    assert byte_runs((), (), (), (), 8) == [(0, 8)]


def test_intersect():
    assert intersect((0, 0), (4, 4), (2, 3), (4, 4)) == ((2, 3), (2, 1))
    assert intersect((0,), (4,), (4,), (2,)) is None
    assert intersect((), (), (), ()) == ((), ())


def test_merge_runs_unions_touching_and_overlapping_only():
    assert merge_runs([(10, 20), (0, 5), (5, 8), (15, 25), (30, 31)]) == [(0, 8), (10, 25), (30, 31)]
    runs = [(a, a + 3) for a in range(0, 30, 4)]
    assert merge_runs(runs) == runs  # a gap of one byte is never read


def test_runs_of_disjoint_boxes_tile_the_chunk():
    shape = (4, 6)
    boxes = [((r, c), (2, 3)) for r, c in itertools.product((0, 2), (0, 3))]
    runs = merge_runs([x for o, s in boxes for x in byte_runs((0, 0), shape, o, s, 2)])
    assert runs == [(0, 48)]
