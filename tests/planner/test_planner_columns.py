"""The planners' array paths against the box-by-box paths, on random layouts.

``plan_save`` and ``plan_load`` first try an array path (columns of every rank's plan, tiling
checked by a sort and a sweep); the box-by-box path (``piece_problems`` and friends) is the
reference. Every random case is built so that either can be wrong: gaps, overlaps, replicas
(some diverging), pieces outside the tensor, empty pieces, grid splits.
"""
from __future__ import annotations

import random

import pytest

from raydcp import CheckpointError
from raydcp.metadata import ChunkMeta, Metadata, TensorMeta
from raydcp.metadata_format import decode_metadata, encode_metadata
from raydcp.planner import (LocalLoadPlan, LocalSavePlan, ReadItem, SavePlanOptions, SourceChunk, TensorSpec,
                            WriteItem, plan_load, plan_save, stored_sources)
from raydcp.planner.boxes import numel
from raydcp.planner.load import _plan_load_objects, untiled_sources
from raydcp.planner.load_arrays import plan_load_columns
from raydcp.planner.save import _plan_columns, _plan_objects
from raydcp.planner.tiling import piece_problems

ISZ = {"float32": 4, "int16": 2}


def _cuts(rng: random.Random, n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` consecutive ranges covering [0, n) (some may be empty)."""
    points = sorted(rng.randint(0, n) for _ in range(parts - 1))
    bounds = [0, *points, n]
    return [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(parts)]


def _tiling(rng: random.Random, shape: tuple[int, ...]) -> list[tuple[tuple, tuple]]:
    """An exact tiling of ``shape``: split along one dimension, along two (a grid), or whole."""
    kind = rng.choice(["dim", "dim", "dim", "grid", "whole"]) if shape else "whole"
    if kind == "whole":
        return [(tuple(0 for _ in shape), tuple(shape))]
    if kind == "dim" or len(shape) < 2:
        d = rng.randrange(len(shape))
        out = []
        for lo, n in _cuts(rng, shape[d], rng.randint(1, 6)):
            out.append((tuple(lo if i == d else 0 for i in range(len(shape))),
                        tuple(n if i == d else s for i, s in enumerate(shape))))
        return out
    d0, d1 = rng.sample(range(len(shape)), 2)
    out = []
    for lo0, n0 in _cuts(rng, shape[d0], rng.randint(1, 3)):
        for lo1, n1 in _cuts(rng, shape[d1], rng.randint(1, 3)):
            off = [0] * len(shape)
            size = list(shape)
            off[d0], size[d0], off[d1], size[d1] = lo0, n0, lo1, n1
            out.append((tuple(off), tuple(size)))
    return out


def _along_one_dim(rng: random.Random, shape: tuple[int, ...]) -> list[tuple[tuple, tuple]]:
    """Blocks along one dimension, spanning the others (a 0-d tensor: the whole)."""
    if not shape:
        return [((), ())]
    d = rng.randrange(len(shape))
    return [(tuple(lo if i == d else 0 for i in range(len(shape))),
             tuple(n if i == d else s for i, s in enumerate(shape)))
            for lo, n in _cuts(rng, shape[d], rng.randint(1, 4))]


def _damage(rng: random.Random, boxes: list, shape: tuple[int, ...]) -> list:
    """Maybe break the tiling: drop a piece, grow one, shift one, add one outside, or add an empty one."""
    boxes = list(boxes)
    op = rng.random()
    live = [i for i, (_, s) in enumerate(boxes) if numel(s) > 0]
    if op < 0.5 or not live or not shape:
        return boxes
    i = rng.choice(live)
    off, size = boxes[i]
    d = rng.randrange(len(shape))
    if op < 0.6:
        del boxes[i]                                                    # a gap
    elif op < 0.7:
        size = tuple(s + (j == d) for j, s in enumerate(size))          # overlap, or outside
        boxes[i] = (off, size)
    elif op < 0.8 and off[d] > 0:
        boxes[i] = (tuple(o - (j == d) for j, o in enumerate(off)), size)  # overlap and a gap
    elif op < 0.9:
        boxes.append((tuple(0 for _ in shape), tuple(1 for _ in shape)))  # a duplicate corner: overlap
    else:
        boxes.append((tuple(shape), tuple(0 for _ in shape)))            # an empty piece: harmless
    return boxes


def _random_save(rng: random.Random, world: int):
    """Local plans for ``world`` ranks of a few random tensors, each tiling maybe damaged, some pieces
    replicated on several ranks (a replica's checksum maybe diverging)."""
    tensors = {}
    held: list[list[WriteItem]] = [[] for _ in range(world)]
    for t in range(rng.randint(1, 4)):
        shape = tuple(rng.randint(0 if rng.random() < 0.1 else 1, 7) for _ in range(rng.randint(0, 3)))
        dtype = rng.choice(list(ISZ))
        key = f"t{t}"
        tensors[key] = TensorSpec(dtype, shape)
        for off, size in _damage(rng, _tiling(rng, shape), shape):
            crc = rng.randrange(1 << 32)
            holders = rng.sample(range(world), rng.randint(1, world) if rng.random() < 0.3 else 1)
            for r in holders:
                c = crc if rng.random() > 0.05 else crc ^ 1
                held[r].append(WriteItem(key, off, size, numel(size) * ISZ[dtype], c if rng.random() > 0.3 else None))
    plans = []
    for r in range(world):
        items = held[r]
        rng.shuffle(items)
        plans.append(LocalSavePlan(r, tensors, tuple(items), {}))
    return tensors, plans


@pytest.mark.parametrize("seed", range(400))
def test_save_array_path_agrees_with_the_box_by_box_path(seed):
    rng = random.Random(seed)
    world = rng.randint(1, 5)
    tensors, plans = _random_save(rng, world)
    options = SavePlanOptions(max_file_bytes=rng.choice([64, 128, 1 << 20]), save_id="s")
    # the reference check of the tiling, tensor by tensor
    boxes = {k: {(it.offsets, it.sizes) for p in plans for it in p.items if it.key == k} for k in tensors}
    tiled = all(not piece_problems(k, s.shape, list(boxes[k])) for k, s in tensors.items())
    try:
        expected = _plan_objects(plans, tensors, {}, options, "s")
    except CheckpointError:
        expected = None
    assert expected is None or tiled
    fast = _plan_columns(plans, tensors, {}, options, "s")
    if expected is None:
        assert fast is None  # the array path never accepts what the reference refuses
        with pytest.raises(CheckpointError):
            plan_save(plans, options)
        return
    if fast is not None:
        assert fast == expected  # same writers, same files, same byte offsets
    assert plan_save(plans, options) == expected


@pytest.mark.parametrize("seed", range(200))
def test_save_array_path_takes_every_one_dimensional_layout(seed):
    """Row or column blocks and whole replicas never need the box-by-box path."""
    rng = random.Random(seed)
    world = rng.randint(1, 6)
    tensors = {}
    held: list[list[WriteItem]] = [[] for _ in range(world)]
    for t in range(rng.randint(1, 5)):
        shape = tuple(rng.randint(1, 9) for _ in range(rng.randint(0, 3)))
        tensors[f"t{t}"] = TensorSpec("float32", shape)
        for off, size in _along_one_dim(rng, shape):
            for r in rng.sample(range(world), rng.randint(1, world)):
                held[r].append(WriteItem(f"t{t}", off, size, numel(size) * 4, 7))
    plans = [LocalSavePlan(r, tensors, tuple(held[r]), {}) for r in range(world)]
    options = SavePlanOptions(save_id="s", max_file_bytes=128)
    fast = _plan_columns(plans, tensors, {}, options, "s")
    assert fast is not None
    assert fast == _plan_objects(plans, tensors, {}, options, "s")


def _stored(plans, tensors, gp) -> Metadata:
    chunks = {k: [] for k in tensors}
    for rp in gp.ranks:
        for name, slots in rp.files:
            for s in slots:
                it = plans[rp.rank].items[s.item]
                chunks[it.key].append(ChunkMeta(it.offsets, it.sizes, name, s.byte_offset, it.nbytes, 0))
    return Metadata("s", len(plans), 0.0, {k: TensorMeta(s.dtype, s.shape, tuple(chunks[k]))
                                          for k, s in tensors.items()}, {})


def _flatten(out):
    """Everything a load plan decides, in an order-free form: (reader, chunk, deliveries) and totals."""
    reads = set()
    for rp in out:
        for cr in rp.reads:
            c = cr.source
            reads.add((rp.rank, c.key, c.offsets, c.sizes, c.file, c.byte_offset, c.nbytes,
                       tuple(sorted((d.rank, d.item, d.offsets, d.sizes) for d in cr.deliveries))))
    return reads, [(rp.rank, rp.incoming, rp.bytes_read, rp.bytes_needed, dict(rp.values)) for rp in out]


@pytest.mark.parametrize("seed", range(150))
def test_load_array_path_agrees_with_the_box_by_box_path(seed):
    rng = random.Random(1000 + seed)
    world = rng.randint(1, 5)
    while True:
        tensors, plans = _random_save(rng, world)
        try:
            gp = plan_save(plans, SavePlanOptions(save_id="s", max_file_bytes=256))
            break
        except CheckpointError:
            continue
    md = decode_metadata(encode_metadata(_stored(plans, tensors, gp)))
    if rng.random() < 0.2:  # a damaged checkpoint: a chunk missing
        k = rng.choice(list(md.tensors))
        t = md.tensors[k]
        if len(t.chunks):
            md = Metadata("s", world, 0.0, {**md.tensors, k: TensorMeta(t.dtype, t.shape, tuple(t.chunks)[1:])}, {})
            if numel(t.chunks[0].sizes):  # a load refuses the metadata whatever it asks for
                with pytest.raises(CheckpointError, match=f"stored pieces of {k} do not cover the tensor exactly"):
                    stored_sources(md)
    m = rng.randint(1, 5)
    loads = []
    for r in range(m):
        items = []
        for k, s in tensors.items():
            boxes = _tiling(random.Random(seed * 31 + hash(k) % 97), s.shape)
            for off, size in boxes:
                if rng.random() < 0.6:
                    items.append(ReadItem(k, off, size))
        loads.append(LocalLoadPlan(r, tensors, tuple(items), ()))
    itemsizes = {k: ISZ[s.dtype] for k, s in tensors.items()}
    as_objects = {k: list(v) for k, v in untiled_sources(md).items()}
    try:
        expected = _flatten(_plan_load_objects(as_objects, loads, {}, itemsizes))
    except CheckpointError as e:
        with pytest.raises(CheckpointError, match="do not cover the tensor exactly"):
            plan_load(untiled_sources(md), loads, {}, itemsizes)
        assert "do not cover" in str(e)
        return
    for sources in (untiled_sources(md), as_objects):
        got = plan_load_columns(sources, loads, {}, itemsizes)
        assert got is not None
        reads, totals = _flatten(got)
        # the same chunks read, with the same deliveries; who reads a chunk needed by several ranks
        # may differ (the array path assigns those after the single-rank ones)
        assert {r[1:] for r in reads} == {r[1:] for r in expected[0]}
        assert [t[3] for t in totals] == [t[3] for t in expected[1]]            # bytes needed per rank
        assert sum(t[2] for t in totals) == sum(t[2] for t in expected[1])      # bytes read in all
        single = {r for r in expected[0] if len({d[0] for d in r[-1]}) == 1}
        assert single <= reads                                                  # read by the one rank needing them


def test_live_sources_are_read_by_a_holder():
    chunks = [SourceChunk("w", "float32", (0, 0), (2, 4), nbytes=32, holders=(0, 2)),
              SourceChunk("w", "float32", (2, 0), (2, 4), nbytes=32, holders=(1,))]
    loads = [LocalLoadPlan(r, {"w": TensorSpec("float32", (4, 4))}, (ReadItem("w", (r, 0), (1, 4)),), ())
             for r in range(4)]
    out = plan_load({"w": chunks}, loads, {}, {"w": 4})
    readers = {cr.source.offsets: rp.rank for rp in out for cr in rp.reads}
    assert readers[(0, 0)] in (0, 2) and readers[(2, 0)] == 1
    assert sum(rp.incoming for rp in out) == 4 - sum(1 for rp in out for cr in rp.reads for d in cr.deliveries
                                                     if d.rank == rp.rank)


def test_plans_travel_as_columns_and_read_the_same():
    """What the coordinator scatters (pickled through Ray) reads the same on the other side."""
    import pickle

    from raydcp.planner import FileTable, ReadTable

    tensors = {"w": TensorSpec("float32", (8, 3)), "b": TensorSpec("float32", (5,))}
    plans = [LocalSavePlan(r, tensors, (WriteItem("w", (2 * r, 0), (2, 3), 24, None),
                                        WriteItem("b", (0,), (5,), 20, 9)), {}) for r in range(4)]
    gp = plan_save(plans, SavePlanOptions(save_id="s", max_file_bytes=64))
    assert all(isinstance(rp.files, FileTable) for rp in gp.ranks)
    assert pickle.loads(pickle.dumps(gp)) == gp
    md = decode_metadata(encode_metadata(_stored(plans, tensors, gp)))
    loads = [LocalLoadPlan(r, tensors, (ReadItem("w", (0, r), (8, 1)), ReadItem("b", (0,), (5,))), ())
             for r in range(3)]
    out = plan_load(stored_sources(md), loads, {}, {"w": 4, "b": 4})
    assert all(isinstance(rp.reads, ReadTable) for rp in out)
    assert [_flatten([pickle.loads(pickle.dumps(rp))]) for rp in out] == [_flatten([rp]) for rp in out]
    assert sum(rp.bytes_read for rp in out) == 8 * 3 * 4 + 5 * 4


@pytest.mark.parametrize("n_save,n_load", [(4, 2), (4, 4), (6, 3), (3, 1)])
def test_load_of_whole_chunks_matches_the_box_by_box_path(n_save, n_load):
    """Loading ranks that each need whole saved chunks (N a multiple of M, rows): deliveries are
    kept as 'the whole chunk' and read back as the same boxes."""
    from raydcp.planner import ReadTable

    tensors = {"w": TensorSpec("float32", (12, 5)), "v": TensorSpec("float32", (12, 2, 2)),
               "s": TensorSpec("float32", ())}

    def rows(n, world, r):
        per = n // world
        return r * per, per

    plans = []
    for r in range(n_save):
        items = [WriteItem("s", (), (), 4, 1)]
        for k in ("w", "v"):
            shape = tensors[k].shape
            lo, n = rows(shape[0], n_save, r)
            size = (n,) + shape[1:]
            items.append(WriteItem(k, (lo,) + (0,) * (len(shape) - 1), size, numel(size) * 4, None))
        plans.append(LocalSavePlan(r, tensors, tuple(items), {}))
    gp = plan_save(plans, SavePlanOptions(save_id="s"))
    md = decode_metadata(encode_metadata(_stored(plans, tensors, gp)))
    loads = []
    for r in range(n_load):
        items = [ReadItem("s", (), ())]
        for k in ("w", "v"):
            shape = tensors[k].shape
            lo, n = rows(shape[0], n_load, r)
            items.append(ReadItem(k, (lo,) + (0,) * (len(shape) - 1), (n,) + shape[1:]))
        loads.append(LocalLoadPlan(r, tensors, tuple(items), ()))
    itemsizes = {"w": 4, "v": 4, "s": 4}
    got = plan_load(stored_sources(md), loads, {}, itemsizes)
    if n_load > 1:
        assert all(isinstance(rp.reads, ReadTable) and rp.reads.d_offsets is None for rp in got)
    expected = _plan_load_objects({k: list(v) for k, v in stored_sources(md).items()}, loads, {}, itemsizes)
    assert {r[1:] for r in _flatten(got)[0]} == {r[1:] for r in _flatten(expected)[0]}
    assert _flatten(got)[1] == _flatten(expected)[1]


@pytest.mark.parametrize("n_save,n_load", [(4, 3), (2, 3), (3, 5), (4, 6)])
def test_large_row_chunks_are_read_part_by_part_by_the_ranks_that_need_them(n_save, n_load):
    """A row-sharded checkpoint of large chunks loaded onto another number of ranks: every rank
    reads exactly its own rows (nothing goes through the exchange), on both planner paths."""
    from raydcp.metadata import BLOCK_BYTES
    from raydcp.planner.load import SPLIT_MIN_BYTES

    rows, cols = 120, SPLIT_MIN_BYTES // 4 // 30 + 1  # each saved chunk is >= SPLIT_MIN_BYTES
    tensors = {"w": TensorSpec("float32", (rows, cols)), "small": TensorSpec("float32", (rows, 2))}
    plans = []
    for r in range(n_save):
        lo, n = r * rows // n_save, (r + 1) * rows // n_save - r * rows // n_save
        plans.append(LocalSavePlan(r, tensors, (WriteItem("w", (lo, 0), (n, cols), n * cols * 4, None),
                                                WriteItem("small", (lo, 0), (n, 2), n * 8, None)), {}))
    gp = plan_save(plans, SavePlanOptions(save_id="s"))
    stored = _stored(plans, tensors, gp)
    blocks = {k: TensorMeta(t.dtype, t.shape, tuple(  # chunks above 1 MiB carry a checksum per block
        ChunkMeta(c.offsets, c.sizes, c.file, c.byte_offset, c.nbytes, 0,
                  (0,) * (-(-c.nbytes // BLOCK_BYTES) if c.nbytes > BLOCK_BYTES else 0)) for c in t.chunks))
        for k, t in stored.tensors.items()}
    md = decode_metadata(encode_metadata(Metadata("s", n_save, 0.0, blocks, {})))
    loads = []
    for r in range(n_load):
        lo, n = r * rows // n_load, (r + 1) * rows // n_load - r * rows // n_load
        loads.append(LocalLoadPlan(r, tensors, (ReadItem("w", (lo, 0), (n, cols)), ReadItem("small", (lo, 0), (n, 2))),
                                   ()))
    itemsizes = {"w": 4, "small": 4}
    for got in (plan_load(stored_sources(md), loads, {}, itemsizes),
                _plan_load_objects({k: list(v) for k, v in stored_sources(md).items()}, loads, {}, itemsizes)):
        reads, _ = _flatten(got)
        for rp in got:
            mine = [r for r in reads if r[0] == rp.rank and r[1] == "w"]
            assert mine and all({d[0] for d in r[-1]} == {rp.rank} for r in mine)  # only its own rows
        w_read = sum(1 for r in reads if r[1] == "w")
        assert w_read > n_save  # some saved chunk was split between ranks
        # bytes: every rank reads what it needs of "w" and no more; "small" chunks are read whole once
        assert sum(rp.bytes_read for rp in got) == sum(rp.bytes_needed for rp in got)
        small_forwarded = sum(rp.incoming for rp in got)
        assert small_forwarded == sum(1 for r in reads for d in r[-1] if d[0] != r[0])
        assert all(d[0] == r[0] for r in reads if r[1] == "w" for d in r[-1])
        # a read of part of a chunk is marked for joint verification; whole-chunk reads are not
        for rp in got:
            for cr in rp.reads:
                whole = [d.sizes for d in cr.deliveries] == [cr.source.sizes]
                assert cr.joint == (cr.source.key == "w" and not whole), (rp.rank, cr)

    # ranks that need only some rows of a shared chunk: it is not split (nobody would verify the rest)
    partial_loads = [LocalLoadPlan(r, tensors, (ReadItem("w", (lo, 0), (n - 1, cols)),), ())
                     for r, (lo, n) in enumerate((r * rows // n_load, (r + 1) * rows // n_load - r * rows // n_load)
                                                 for r in range(n_load))]
    for got in (plan_load(stored_sources(md), partial_loads, {}, itemsizes),
                _plan_load_objects({k: list(v) for k, v in stored_sources(md).items()}, partial_loads, {}, itemsizes)):
        assert not any(cr.joint for rp in got for cr in rp.reads)
