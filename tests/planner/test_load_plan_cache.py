"""A load of the same requests from a checkpoint whose chunks lie in the same places (the next
checkpoint of the same run) reuses the previous load plan (raydcp.planner.PlanCache): the same
plan as one made anew, with that checkpoint's files and checksums; other requests or other
places are planned from the start."""
from __future__ import annotations

import numpy as np
import pytest

import raydcp.planner as P
from raydcp.metadata import Metadata, TensorMeta
from raydcp.metadata_format import decode_metadata, encode_metadata
from raydcp.planner.load import stored_sources
from raydcp.transport import decode, encode

SAVE, ROWS = 6, 3
SPECS = {"w": P.TensorSpec("float32", (SAVE * ROWS, 4)), "v": P.TensorSpec("float32", (SAVE * ROWS,))}
ISZ = {"w": 4, "v": 4}


def _checkpoint(save_id: str, crc: int, rows_of_rank0: int = ROWS) -> Metadata:
    plans = []
    for r in range(SAVE):
        lo = 0 if r == 0 else rows_of_rank0 + (r - 1) * ROWS
        n = rows_of_rank0 if r == 0 else (ROWS if r < SAVE - 1 else SAVE * ROWS - lo)
        items = (P.WriteItem("w", (lo, 0), (n, 4), n * 16, crc + r), P.WriteItem("v", (lo,), (n,), n * 4, crc - r))
        plans.append(P.LocalSavePlan(r, SPECS, items, {}))
    gp = P.plan_save(plans, P.SavePlanOptions(save_id=save_id))
    sums = [np.arange(len(rp.files.items), dtype=np.int64) + crc for rp in gp.ranks]
    tables = P.chunk_tables(gp, plans, sums)
    md = Metadata(save_id, SAVE, 0.0, {k: TensorMeta(s.dtype, s.shape, tables[k]) for k, s in gp.tensors.items()},
                  {"step": crc})
    return decode_metadata(encode_metadata(md))


def _loads(world: int, strict: bool = True):
    n = SAVE * ROWS
    out = []
    for r in range(world):
        lo, hi = r * n // world, (r + 1) * n // world
        items = (P.ReadItem("w", (lo, 0), (hi - lo, 4)), P.ReadItem("v", (lo,), (hi - lo,)))
        out.append(decode(encode(P.LocalLoadPlan(r, SPECS, items, ("step",), strict))))
    return out


def _plan(md, loads, cache=None):
    return P.plan_load(stored_sources(md), loads, dict(md.values), ISZ, tiles=md.tensors, cache=cache)


def _same(a, b) -> None:
    assert [(p.rank, p.incoming, p.bytes_read, p.bytes_needed, p.values) for p in a] == \
           [(p.rank, p.incoming, p.bytes_read, p.bytes_needed, p.values) for p in b]
    assert [tuple(p.reads) for p in a] == [tuple(p.reads) for p in b]


def test_the_next_checkpoints_load_reuses_the_plan_with_its_own_files_and_checksums():
    cache = P.PlanCache()
    first_md = _checkpoint("s0", 100)
    first = _plan(first_md, _loads(4), cache)
    assert (cache.load_hits, cache.load_misses) == (0, 1)
    md = _checkpoint("s1", 200)  # the next save of the run: same places, other files, checksums, values
    again = _plan(md, _loads(4), cache)
    assert (cache.load_hits, cache.load_misses) == (1, 1)
    _same(again, _plan(md, _loads(4)))
    assert {cr.source.file.split("/")[1] for p in again for cr in p.reads} == {"s1"}
    assert again[0].values == {"step": 200}
    # the first plan's tables still read as they did (the reuse wrote into a copy)
    _same(first, _plan(first_md, _loads(4)))


@pytest.mark.parametrize("change", ["ranks", "strict", "places"])
def test_other_requests_or_places_are_planned_anew(change):
    cache = P.PlanCache()
    _plan(_checkpoint("s0", 100), _loads(4), cache)
    md, loads = _checkpoint("s1", 200), _loads(4)
    if change == "ranks":
        loads = _loads(5)
    elif change == "strict":
        loads = _loads(4, strict=False)
    else:  # rank 0 of the save held one row fewer: the chunks lie elsewhere
        md = _checkpoint("s1", 200, rows_of_rank0=ROWS - 1)
    got = _plan(md, loads, cache)
    assert (cache.load_hits, cache.load_misses) == (0, 2)
    _same(got, _plan(md, loads))


def test_plans_held_in_many_blocks_read_as_in_one(monkeypatch):
    from raydcp.planner import read_tables

    md, loads = _checkpoint("s0", 100), _loads(5)
    whole = _plan(md, loads)
    monkeypatch.setattr(read_tables, "BLOCK_BYTES", 200)  # a block every rank or two
    cache = P.PlanCache()
    for m in (md, _checkpoint("s1", 300)):
        got = _plan(m, loads, cache)
        assert len(cache._load[2].reads) >= 3
        _same(got, _plan(m, loads) if m is not md else whole)
        assert [decode(encode(p)).reads._all() for p in got] == [tuple(p.reads) for p in got]  # as they travel
    assert cache.load_hits == 1
