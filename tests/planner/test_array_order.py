"""``sorted_runs``: the order by (key, columns...) of rows that come rank after rank, without a
sort where every rank lists the same tensors, against the stable sort it stands for."""
from __future__ import annotations

import numpy as np
import pytest

from raydcp.planner import LocalSavePlan, SavePlanOptions, TensorSpec, WriteItem, plan_save
from raydcp.planner.arrays import sorted_runs, stable_order
from raydcp.planner.save import _plan_columns, _plan_objects


def _runs(rng: np.random.Generator, runs: int, keys: int, kind: str) -> list[np.ndarray]:
    row = rng.permutation(keys)  # every run lists the same distinct keys, in one order
    key = np.tile(row, runs)
    start = np.repeat(np.arange(runs), keys) * 10 + rng.integers(0, 3, runs * keys) * (kind == "unsorted")
    if kind == "ties":  # replicas: every run holds the same piece of some keys
        start[np.isin(key, row[: keys // 2])] = 0
    if kind == "repeated key" and keys > 1:
        key[::keys] = row[1]  # a run lists a key twice: the transpose does not hold
    if kind == "unequal runs":
        key, start = key[1:], start[1:]
    length = rng.integers(1, 4, len(key))
    return [key.astype(np.int64), start.astype(np.int64), length.astype(np.int64)]


@pytest.mark.parametrize("kind", ["sorted", "ties", "unsorted", "repeated key", "unequal runs"])
@pytest.mark.parametrize("seed", range(20))
def test_the_order_of_runs_is_the_stable_sort(kind, seed):
    rng = np.random.default_rng(seed)
    runs, keys = int(rng.integers(1, 9)), int(rng.integers(1, 12))
    cols = _runs(rng, runs, keys, kind)
    order, got = sorted_runs(cols, runs)
    expected = stable_order(cols)
    assert np.array_equal(order, expected)
    for c, g in zip(cols, got):
        assert np.array_equal(g, c[expected])


@pytest.mark.parametrize("replicated", [False, True])
def test_every_rank_a_row_block_of_every_tensor_plans_as_the_box_by_box_path(replicated):
    """The layout the transpose serves (each rank a block of rows of every tensor; or, replicated,
    every rank the whole of some tensors): the same plan as the reference path."""
    world, tensors = 4, {f"t{i}": TensorSpec("float32", (8, 3 + i)) for i in range(5)}
    plans = []
    for r in range(world):
        items = []
        for k, s in tensors.items():
            if replicated and k in ("t1", "t3"):
                items.append(WriteItem(k, (0, 0), s.shape, 8 * s.shape[1] * 4, 11))
            else:
                items.append(WriteItem(k, (2 * r, 0), (2, s.shape[1]), 2 * s.shape[1] * 4, r))
        plans.append(LocalSavePlan(r, tensors, tuple(items), {}))
    options = SavePlanOptions(save_id="s", max_file_bytes=1 << 20)
    fast = _plan_columns(plans, tensors, {}, options, "s")
    assert fast is not None and fast == _plan_objects(plans, tensors, {}, options, "s")
    assert plan_save(plans, options) == fast
