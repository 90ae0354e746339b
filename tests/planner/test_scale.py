"""A save by 16,384 ranks and its load onto 12,288, planned through the planner's own functions:
every piece written once, every load request covered exactly, each needed byte read once, and
each rank's plan naming only the files it reads (a plan that named every file of the checkpoint
made the coordinator's replies grow with the square of the ranks)."""
from __future__ import annotations

import numpy as np

import raydcp.planner as P
from raydcp.metadata import Metadata, TensorMeta
from raydcp.metadata_format import decode_metadata, encode_metadata
from raydcp.planner.load import stored_sources

SAVE, LOAD = 16384, 12288
ROWS = 2  # rows of "w" and "b" per saving rank
SPECS = {"w": P.TensorSpec("float32", (SAVE * ROWS, 4)), "b": P.TensorSpec("bfloat16", (SAVE * ROWS,)),
         "r": P.TensorSpec("float32", (3,))}  # "r": the same on every rank (a replica)
ISZ = {"w": 4, "b": 2, "r": 4}


def _save_plans() -> list[P.LocalSavePlan]:
    plans = []
    for r in range(SAVE):
        lo = r * ROWS
        items = (P.WriteItem("w", (lo, 0), (ROWS, 4), ROWS * 16, r), P.WriteItem("b", (lo,), (ROWS,), ROWS * 2, r),
                 P.WriteItem("r", (0,), (3,), 12, 7))
        plans.append(P.LocalSavePlan(r, SPECS, items, {}))
    return plans


def _load_plans() -> list[P.LocalLoadPlan]:
    n = SAVE * ROWS
    plans = []
    for r in range(LOAD):
        lo, hi = r * n // LOAD, (r + 1) * n // LOAD
        items = (P.ReadItem("w", (lo, 0), (hi - lo, 4)), P.ReadItem("b", (lo,), (hi - lo,)), P.ReadItem("r", (0,), (3,)))
        plans.append(P.LocalLoadPlan(r, SPECS, items, ()))
    return plans


def test_a_16384_rank_save_and_its_load_onto_12288_ranks_are_planned_whole():
    local = _save_plans()
    gp = P.plan_save(local, P.SavePlanOptions(save_id="scale"))
    # every piece written once: the row pieces by their own rank, the replica by one rank
    written = {k: [] for k in SPECS}
    for rp in gp.ranks:
        items = np.concatenate([rp.files.items]) if isinstance(rp.files, P.FileTable) else \
            np.array([s.item for _, slots in rp.files for s in slots], np.int64)
        for i in items.tolist():
            it = local[rp.rank].items[i]
            written[it.key].append((rp.rank, it.offsets))
    for k in ("w", "b"):
        assert sorted(written[k]) == [(r, (r * ROWS,) + (0,) * (k == "w")) for r in range(SAVE)]
    assert len(written["r"]) == 1

    checksums = [np.zeros(len(rp.files.items) if isinstance(rp.files, P.FileTable)
                          else sum(len(s) for _, s in rp.files), np.int64) for rp in gp.ranks]
    tables = P.chunk_tables(gp, local, checksums)
    md = Metadata("scale", SAVE, 0.0, {k: TensorMeta(s.dtype, s.shape, tables[k]) for k, s in gp.tensors.items()}, {})
    md = decode_metadata(encode_metadata(md))
    assert sum(len(t.chunks) for t in md.tensors.values()) == 2 * SAVE + 1

    loads = _load_plans()
    P.check_requests({k: P.TensorSpec(t.dtype, t.shape) for k, t in md.tensors.items()}, {}, loads)
    plans = P.plan_load(stored_sources(md), loads, {}, ISZ, tiles=md.tensors)
    assert [p.rank for p in plans] == list(range(LOAD))
    # every request covered exactly: the elements delivered to each (rank, item) add up to the item
    got = np.zeros((LOAD, 3), np.int64)
    reads_of = {}  # (key, chunk offset) -> readers
    for p in plans:
        t = p.reads
        sizes = np.asarray(t.sizes if t.d_sizes is None else t.d_sizes)
        n_per = np.diff(np.asarray(t.delivery_bounds))
        if t.d_sizes is None:
            sizes = np.repeat(sizes, n_per, axis=0)
        counts = np.prod(sizes, axis=1)  # boxes are padded with size 1
        np.add.at(got, (np.asarray(t.d_rank), np.asarray(t.d_item)), counts)
        for k, off in zip(np.asarray(t.key).tolist(), np.asarray(t.offsets)[:, 0].tolist()):
            reads_of.setdefault((t.keys[k], off), []).append(p.rank)
        assert len(t.files) <= 3  # the files of the chunks it reads (two of rows, the replica's), not all of them
    want = np.array([[numel(it.sizes) for it in lp.items] for lp in loads], np.int64)
    assert np.array_equal(got, want)
    # each stored chunk read by one rank (rows shared by two loading ranks: by one of them)
    assert len(reads_of) == 2 * SAVE + 1 and all(len(r) == 1 for r in reads_of.values())
    assert sum(p.bytes_read for p in plans) == sum(p.bytes_needed for p in plans) - (LOAD - 1) * 12
    assert sum(p.incoming for p in plans) > 0  # shared rows and the replica go through the exchange


def numel(sizes) -> int:
    return int(np.prod(sizes)) if sizes else 1
