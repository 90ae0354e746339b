"""The tiling check (planner/tiling.py): its array core against the box-by-box reference."""
from __future__ import annotations

import random
from types import SimpleNamespace as NS

import numpy as np
import pytest

from raydcp import CheckpointError
from raydcp.planner.tiling import piece_problems, require_tiling, tiling_problems, untiled

from .test_planner_columns import _damage, _tiling


def _tensors(spec: dict) -> dict:
    return {k: NS(shape=shape, chunks=[NS(offsets=o, sizes=s) for o, s in boxes]) for k, (shape, boxes) in spec.items()}


def _reference(shape, boxes) -> bool:
    """Untiled, box by box: a problem found, or a piece listed twice."""
    live = [b for b in boxes if int(np.prod(b[1], dtype=object)) > 0]
    return bool(piece_problems("x", shape, list(set(live)))) or len(set(live)) != len(live)


@pytest.mark.parametrize("seed", range(20))
def test_agrees_with_the_box_by_box_check(seed):
    rng = random.Random(seed)
    for _ in range(100):
        spec = {}
        for t in range(rng.randint(1, 4)):
            shape = tuple(rng.randint(0 if t else 1, 5) for _ in range(rng.choice([0, 1, 2, 3])))
            if rng.random() < 0.5:  # a tiling, maybe damaged (grids included)
                boxes = _damage(rng, _tiling(rng, shape), shape)
            else:  # random boxes until their element counts reach the tensor's (overlaps and gaps)
                boxes, total = [], int(np.prod(shape, dtype=np.int64))
                while sum(int(np.prod(s)) for _, s in boxes) < total:
                    o = tuple(rng.randint(0, n - 1) for n in shape)
                    boxes.append((o, tuple(rng.randint(1, n - a) for n, a in zip(shape, o))))
            if boxes and rng.random() < 0.2:
                boxes.append(rng.choice(boxes))
            rng.shuffle(boxes)
            spec[f"t{t}"] = (shape, boxes)
        want = {k for k, (shape, boxes) in spec.items() if _reference(shape, boxes)}
        assert set(tiling_problems(_tensors(spec))) == want, spec


@pytest.mark.parametrize("shape,boxes,says", [
    ((10,), [((0,), (5,)), ((2,), (5,))], "overlap"),
    ((10,), [((0,), (5,)), ((0,), (5,))], "more than once"),
    ((4, 3), [((0, 0), (2, 3)), ((1, 0), (2, 3))], "overlap"),
    ((4, 4), [((0, 0), (2, 2)), ((2, 2), (2, 2)), ((0, 1), (2, 2)), ((2, 0), (2, 2))], "overlap"),
    ((4,), [((0,), (3,)), ((3,), (2,))], "outside"),
    ((6,), [((0,), (2,)), ((4,), (2,))], "cover 4 of 6"),
])
def test_overlaps_and_gaps_of_equal_size_are_named(shape, boxes, says):
    problems = tiling_problems(_tensors({"w": (shape, boxes), "ok": ((2,), [((0,), (2,))])}))
    assert list(problems) == ["w"] and says in " ".join(problems["w"])
    with pytest.raises(CheckpointError, match=r"the checkpoint is damaged: the stored pieces of w do not cover"):
        require_tiling(_tensors({"w": (shape, boxes)}))


def test_sizes_near_int64_are_checked_exactly():
    # a lattice of corners too large for one int64 key, and tensors too large for int64 sums
    shape = (1 << 40, 1 << 20)
    rows, off = np.array([0, 2]), np.array([[0, 0], [1 << 39, 0]])
    assert not untiled([shape], rows, off, np.array([[1 << 39, 1 << 20], [1 << 39, 1 << 20]]))[0]
    assert untiled([shape], rows, off, np.array([[1 << 39, 1 << 20], [1 << 39, 1 << 19]]))[0]
    huge = ((1 << 62) + 6,)
    half = (1 << 61) + 3
    assert not untiled([huge], np.array([0, 2]), np.array([[0], [half]]), np.array([[half], [half]]))[0]
    assert untiled([huge], np.array([0, 2]), np.array([[0], [half - 1]]), np.array([[half], [half]]))[0]


def test_a_million_row_pieces_in_a_thousand_tensors():
    k, per = 1000, 1000
    off = np.zeros((k * per, 2), np.int64)
    off[:, 0] = np.tile(np.arange(per) * 3, k)
    size = np.tile(np.array([[3, 8]], np.int64), (k * per, 1))
    rows = np.arange(k + 1) * per
    assert not untiled([(3 * per, 8)] * k, rows, off, size).any()
    off[per * 500 + 7, 0] += 1  # one piece of tensor 500 shifted by a row
    assert np.flatnonzero(untiled([(3 * per, 8)] * k, rows, off, size)).tolist() == [500]
