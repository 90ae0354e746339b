"""The load planner on decoded metadata: chunk arrays taken from the metadata's shared columns
give the same plans as the arrays copied tensor by tensor."""
from __future__ import annotations

import random

import numpy as np
import pytest

from raydcp.metadata import BLOCK_BYTES, ChunkMeta, ChunkTable, Metadata, TensorMeta
from raydcp.metadata_format import decode_metadata, encode_metadata
from raydcp.planner import LocalLoadPlan, ReadItem, StoredChunks, TensorSpec, plan_load, stored_sources
from raydcp.planner.sources import StoredSources, shared_columns

ISZ = {"float32": 4, "int16": 2}


def _rows(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` consecutive ranges covering [0, n) (some may be empty)."""
    cuts = [0, *sorted(random.randint(0, n) for _ in range(parts - 1)), n]
    return [(cuts[i], cuts[i + 1] - cuts[i]) for i in range(parts)]


def _checkpoint(rng: random.Random, count: int):
    """Decoded metadata of ``count`` tensors of 0 to 3 dimensions (some empty, some split along
    their first dimension, one large enough to carry block checksums) and their specs."""
    random.seed(rng.random())
    tensors, specs = {}, {}
    pos = 0
    for t in range(count):
        dtype = rng.choice(["float32", "int16"])
        nd = rng.choice([0, 1, 1, 2, 2, 3])
        shape = tuple(rng.randint(0, 5) if rng.random() < 0.1 else rng.randint(1, 6) for _ in range(nd))
        if t == 7:
            dtype, nd, shape = "float32", 2, (3 * BLOCK_BYTES // 4 // 4, 4)  # 3 MiB
        if nd and shape[0] and rng.random() < 0.5:
            boxes = [((lo,) + (0,) * (nd - 1), (n,) + shape[1:]) for lo, n in _rows(shape[0], rng.randint(2, 4))]
        else:
            boxes = [((0,) * nd, shape)]
        chunks = []
        for off, size in boxes:
            nbytes = int(np.prod(size, dtype=np.int64)) * ISZ[dtype]
            blocks = tuple(rng.randrange(1 << 32) for _ in range(-(-nbytes // BLOCK_BYTES))) \
                if nbytes > BLOCK_BYTES else ()
            chunks.append(ChunkMeta(off, size, f"f{rng.randrange(3)}", pos, nbytes, rng.randrange(1 << 32), blocks))
            pos += nbytes
        tensors[f"t{t:04d}"] = TensorMeta(dtype, shape, tuple(chunks))
        specs[f"t{t:04d}"] = TensorSpec(dtype, shape)
    return decode_metadata(encode_metadata(Metadata("s", 2, 0.0, tensors, {}))), specs


def _requests(rng: random.Random, specs: dict, world: int) -> list[LocalLoadPlan]:
    """Every tensor split by rows among the ranks (or wanted whole by a few ranks)."""
    items: list[list[ReadItem]] = [[] for _ in range(world)]
    for key, spec in specs.items():
        shape = spec.shape
        if shape and rng.random() < 0.7:
            for r, (lo, n) in enumerate(_rows(shape[0], world)):
                items[r].append(ReadItem(key, (lo,) + (0,) * (len(shape) - 1), (n,) + shape[1:]))
        else:
            for r in rng.sample(range(world), rng.randint(1, world)):
                items[r].append(ReadItem(key, (0,) * len(shape), shape))
    return [LocalLoadPlan(r, {it.key: specs[it.key] for it in items[r]}, tuple(items[r]), (), False)
            for r in range(world)]


def _per_table(sources: dict) -> dict:
    """The same sources with tables that are not views of shared columns."""
    return {k: StoredChunks(s.key, s.dtype, ChunkTable(
        s.table.offsets, s.table.sizes, s.table.files, s.table.file, s.table.byte_offset, s.table.nbytes,
        s.table.checksum, s.table.block_values, s.table.block_bounds)) for k, s in sources.items()}


def _same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.rank, x.incoming, x.bytes_read, x.bytes_needed, x.values) == \
               (y.rank, y.incoming, y.bytes_read, y.bytes_needed, y.values)
        rx, ry = x.reads, y.reads
        for name in rx.__slots__:
            u, v = getattr(rx, name), getattr(ry, name)
            if name == "packed":  # the matrices the columns are views of
                assert (u is None) == (v is None), name
                if u is not None:
                    assert all(np.array_equal(p, q) if p is not None else q is None for p, q in zip(u, v)), name
            elif isinstance(u, np.ndarray) or isinstance(v, np.ndarray):
                assert u is not None and v is not None, name
                assert np.array_equal(np.asarray(u), np.asarray(v)), name
            else:
                assert u == v, name
        assert tuple(rx) == tuple(ry)


@pytest.mark.parametrize("seed", range(6))
def test_shared_columns_give_the_per_table_plans(seed):
    rng = random.Random(seed)
    md, specs = _checkpoint(rng, 300)
    loads = _requests(rng, specs, rng.choice([1, 2, 3, 5]))
    itemsizes = {k: ISZ[s.dtype] for k, s in specs.items()}
    sources = stored_sources(md)
    assert isinstance(sources, StoredSources)  # the decoded columns, no per-tensor objects
    expected = plan_load(_per_table(sources), loads, {}, itemsizes)
    _same(plan_load(sources, loads, {}, itemsizes), expected)
    # the same tables in a plain dict: their shared columns are found through the tables' origin
    tables = [s.table for s in sources.values()]
    assert shared_columns(tables, np.array([t.offsets.shape[1] for t in tables])) is not None
    _same(plan_load(dict(sources), loads, {}, itemsizes), expected)

    # some of the keys, in another order: the rows are gathered by the keys' tensors
    keys = rng.sample(list(sources), 200)
    some = {k: sources[k] for k in keys}
    _same(plan_load(some, loads, {}, itemsizes), plan_load(_per_table(some), loads, {}, itemsizes))


def test_the_reads_name_keys_dtypes_and_files_once_packed_and_travel_so():
    from raydcp.planner import PackedNames
    from raydcp.transport import decode, encode

    rng = random.Random(11)
    md, specs = _checkpoint(rng, 60)
    loads = _requests(rng, specs, 3)
    plans = plan_load(stored_sources(md), loads, {}, {k: ISZ[s.dtype] for k, s in specs.items()})
    tables = [p.reads for p in plans]
    for name in ("keys", "dtypes"):
        lists = {id(getattr(t, name)) for t in tables}
        assert len(lists) == 1 and isinstance(getattr(tables[0], name), PackedNames), name  # one shared list
    assert list(tables[0].keys) == list(specs) and list(tables[0].dtypes) == [s.dtype for s in specs.values()]
    for t in tables:  # a rank's table names the files it reads, each once, not every file of the checkpoint
        assert isinstance(t.files, PackedNames)
        assert sorted(t.files) == sorted({cr.source.file for cr in t}) and len(set(t.files)) == len(t.files)
    for p in plans:
        back = decode(encode(p)).reads
        assert isinstance(back.keys, PackedNames) and back.keys._objs is None  # no string per key until used
        assert tuple(back) == tuple(p.reads)


@pytest.mark.parametrize("names", [(), ("",), ("", ""), ("a",), ("w.0", "w.1"), ("é", "x\ud800"), ("a\0b", "c"),
                                   (1, 2)])
def test_packed_names_read_back_as_the_names(names):
    import pickle

    from raydcp.planner import PackedNames

    packed = PackedNames.of(names)
    assert isinstance(packed, tuple) == (names in (("a\0b", "c"), (1, 2)))  # a NUL or a non-string: as they are
    back = pickle.loads(pickle.dumps(packed))
    assert tuple(back) == names and len(back) == len(names) and PackedNames.of(back) is back
