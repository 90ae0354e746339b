"""Repeated saves of one layout reuse the previous global plan (raydcp.planner.PlanCache), and
only those: a changed shape, a new key or another rank count is planned from the start, and the
content (replica checksums, plain values) is checked on every save."""
from __future__ import annotations

import pytest

from raydcp.errors import CheckpointError
from raydcp.planner import LocalSavePlan, PlanCache, SavePlanOptions, TensorSpec, WriteItem, plan_save
from raydcp.transport import decode, encode

ROWS = 4


def _plans(world: int, step: int = 0, shape_of_rank=None, extra_key: str | None = None, crc_of=None):
    plans = []
    for r in range(world):
        rows = (shape_of_rank or {}).get(r, ROWS)
        specs = {"w": TensorSpec("float32", (world * ROWS, 3)), "rep": TensorSpec("float32", (5,))}
        items = [WriteItem("w", (r * ROWS, 0), (rows, 3), rows * 12, 1000 * step + r),
                 WriteItem("rep", (0,), (5,), 20, (crc_of or {}).get(r, 77 + step))]
        if extra_key is not None:
            specs[extra_key] = TensorSpec("float32", (world,))
            items.append(WriteItem(extra_key, (r,), (1,), 4, r))
        plans.append(LocalSavePlan(r, specs, tuple(items), {"step": step}))
    return [decode(encode(p)) for p in plans]  # as the coordinator receives them


def _same(a, b) -> None:
    assert (a.save_id, a.world_size, a.tensors, a.values, a.bytes_per_rank) == (b.save_id, b.world_size, b.tensors, b.values,
                                                                                 b.bytes_per_rank)
    assert [(rp.rank, rp.save_id, tuple(rp.files)) for rp in a.ranks] == \
           [(rp.rank, rp.save_id, tuple(rp.files)) for rp in b.ranks]


def test_a_save_of_the_same_layout_reuses_the_plan_and_gets_the_same_result():
    cache = PlanCache()
    first = plan_save(_plans(8), SavePlanOptions(save_id="s0"), cache)
    assert (cache.hits, cache.misses) == (0, 1)
    _same(first, plan_save(_plans(8), SavePlanOptions(save_id="s0")))
    # the next step: new checksums and plain values, the same layout
    again = plan_save(_plans(8, step=1), SavePlanOptions(save_id="s1"), cache)
    assert (cache.hits, cache.misses) == (1, 1)
    _same(again, plan_save(_plans(8, step=1), SavePlanOptions(save_id="s1")))
    assert again.values == {"step": 1}
    assert all(name.startswith("data/s1/") for rp in again.ranks for name, _ in rp.files)


@pytest.mark.parametrize("change", ["shape", "new key", "ranks", "file size"])
def test_a_changed_layout_is_not_served_from_the_cache(change):
    cache = PlanCache()
    plan_save(_plans(8), SavePlanOptions(save_id="s0"), cache)
    plans, options = _plans(8), SavePlanOptions(save_id="s1")
    if change == "shape":  # one rank holds fewer rows (and another more): still a valid tiling
        plans = _plans(8, shape_of_rank={3: ROWS - 1})
        plans[4] = _shifted(_plans(8, shape_of_rank={4: ROWS + 1})[4])
    elif change == "new key":
        plans = _plans(8, extra_key="bias")
    elif change == "ranks":
        plans = _plans(6)
    else:
        options = SavePlanOptions(save_id="s1", max_file_bytes=64)
    got = plan_save(plans, options, cache)
    assert (cache.hits, cache.misses) == (0, 2)
    _same(got, plan_save(plans, options))


def _shifted(plan: LocalSavePlan) -> LocalSavePlan:
    """Rank 4 of _plans(8, shape_of_rank={4: ROWS + 1}) starting one row earlier (rank 3 holds one fewer)."""
    items = [WriteItem(it.key, (it.offsets[0] - 1, 0), it.sizes, it.nbytes, it.checksum) if it.key == "w" else it
             for it in plan.items]
    return decode(encode(LocalSavePlan(plan.rank, dict(plan.tensors), tuple(items), dict(plan.values))))


def test_diverged_replicas_are_refused_on_a_reused_plan_too():
    cache = PlanCache()
    plan_save(_plans(8), SavePlanOptions(save_id="s0"), cache)
    with pytest.raises(CheckpointError, match=r"rep: replicas on ranks .* differ"):
        plan_save(_plans(8, crc_of={5: 12345}), SavePlanOptions(save_id="s1"), cache)
    assert cache.hits == 1


def test_plain_values_are_checked_on_a_reused_plan_too():
    cache = PlanCache()
    plan_save(_plans(4), SavePlanOptions(save_id="s0"), cache)
    plans = _plans(4, step=1)
    plans[2] = decode(encode(LocalSavePlan(2, dict(plans[2].tensors), tuple(plans[2].items), {"step": 9})))
    with pytest.raises(CheckpointError, match="step"):
        plan_save(plans, SavePlanOptions(save_id="s1"), cache)
