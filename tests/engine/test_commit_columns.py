"""The commit builds its metadata from the ranks' columnar storage records: exactly the metadata
that building it piece by piece gives (the way the commit step worked before), byte for byte.

The reference here is independent of the records: each rank's write plan (what it was told to
write), its local plan's items, and the checksums of the bytes actually in the files, assembled
one ChunkMeta per piece, grouped by tensor and sorted by offsets.
"""
from __future__ import annotations

import random
import sys

import crc32c
import numpy as np
import pytest
import torch
import torch.distributed as dist

import raydcp
from raydcp import CheckpointError, SaveOptions, Shard
from raydcp.engine.protocol import tensor_metas
from raydcp.engine.save_records import StorageRecord
from raydcp.engine.save import local_save_plan, save_with
from raydcp.metadata import BLOCK_BYTES, ChunkMeta, Metadata, TensorMeta
from raydcp.metadata_format import encode_metadata
from raydcp.planner import PackedNames, TensorSpec
from raydcp.planner.layouts import chunk_bounds
from raydcp.state import flatten_state
from raydcp.transport import decode, encode

from .helpers import run_ranks

save_engine = sys.modules["raydcp.engine.save"]


def _reference(ck, written, tensors):
    """The chunk tables built the old way: a ChunkMeta per piece, from the write plans and the files."""
    chunks: dict[str, list[ChunkMeta]] = {k: [] for k in tensors}
    for rank in sorted(written):
        plan, items = written[rank]
        for name, ids, offs in save_engine._file_layouts(plan.files):
            data = (ck / name).read_bytes()
            for i, off in zip(ids, offs):
                it = items[i]
                raw = data[off:off + it.nbytes]
                assert len(raw) == it.nbytes
                blocks = tuple(crc32c.crc32c(raw[b:b + BLOCK_BYTES]) for b in range(0, len(raw), BLOCK_BYTES)) \
                    if it.nbytes > BLOCK_BYTES else ()
                chunks[it.key].append(ChunkMeta(tuple(it.offsets), tuple(it.sizes), name, off, it.nbytes,
                                                crc32c.crc32c(raw), blocks))
    return {k: TensorMeta(s.dtype, tuple(s.shape), tuple(sorted(chunks[k], key=lambda c: c.offsets)))
            for k, s in tensors.items()}


def _save_and_compare(tmp_path, monkeypatch, staged_by_rank, max_file_bytes=256 << 20):
    """Save the ranks' staged states in threads; the committed metadata must equal the reference."""
    ck = tmp_path / "ck"
    written = {}
    real_write = save_engine.write_rank_files

    def spy(storage, plan, staged, read=None, **kw):
        written[plan.rank] = (plan, list(staged.plan.items))
        return real_write(storage, plan, staged, read, **kw)

    monkeypatch.setattr(save_engine, "write_rank_files", spy)
    world = len(staged_by_rank)
    options = SaveOptions(max_file_bytes=max_file_bytes)
    _, errs = run_ranks(world, lambda tp: save_with(tp, {}, str(ck), options=options, staged=staged_by_rank[tp.rank]))
    assert errs == [None] * world
    md = raydcp.read_metadata(ck)
    tensors = {k: TensorSpec(t.dtype, t.shape) for k, t in md.tensors.items()}
    ref = _reference(ck, written, tensors)
    assert dict(md.tensors.items()) == ref
    want = encode_metadata(Metadata(md.save_id, md.world_size, md.created_at, ref, md.values))
    assert (ck / "raydcp.meta").read_bytes() == want
    return md


def _staged(rank, state):
    return local_save_plan(rank, flatten_state(state), compare_replicas=True)


def _mixed_state(rank, world):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(10, 6, generator=g)
    c = torch.randn(5, 9, generator=g)
    big = torch.randn(3 * BLOCK_BYTES // 4 + 5, generator=g)  # ~3 MiB: pieces over one checksum block
    cube = torch.randn(4, 3, 2, generator=g).to(torch.bfloat16)
    lo, n = chunk_bounds(w.shape[0], world, rank)
    clo, cn = chunk_bounds(c.shape[1], world, rank)
    blo, bn = chunk_bounds(big.shape[0], world, rank)
    state = {
        "rows": Shard(w[lo:lo + n], (lo, 0), w.shape),
        "cols": Shard(c[:, clo:clo + cn], (0, clo), c.shape),
        "big": Shard(big[blo:blo + bn], (blo,), big.shape),
        "replica": torch.arange(12.0).reshape(3, 4),            # the same on every rank: written once
        "cube": cube if rank == 0 else Shard(cube[:0], (4, 0, 0), cube.shape),  # one rank holds it
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
        "small": {f"t{i}": torch.full((i % 5 + 1,), float(i + rank)) for i in range(40)},  # packed small pieces
        "step": 12, "lr": 1e-3, "name": "run", "nested": [1, (2, None)],
    }
    state["small"] = {k: v for k, v in state["small"].items() if int(k[1:]) % world == rank}  # each on one rank
    return state


@pytest.mark.parametrize("max_file_bytes", [256 << 20, 512])
def test_mixed_state_commits_the_metadata_built_piece_by_piece(tmp_path, monkeypatch, max_file_bytes):
    world = 3
    md = _save_and_compare(tmp_path, monkeypatch, [_staged(r, _mixed_state(r, world)) for r in range(world)],
                           max_file_bytes)
    assert len(md.tensors["replica"].chunks) == 1 and len(md.tensors["big"].chunks) == world
    assert any(c.block_checksums for c in md.tensors["big"].chunks)
    assert md.values["nested"] == [1, (2, None)] and md.tensors["scalar"].chunks[0].offsets == ()
    if max_file_bytes == 512:
        assert len(md.files) > 2 * world  # several files per rank


def test_dtensor_pieces_commit_the_metadata_built_piece_by_piece(tmp_path, monkeypatch):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard as DShard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = 4
    g = torch.Generator().manual_seed(3)
    grid, rep, uneven = torch.randn(7, 5, generator=g), torch.randn(4, 6, generator=g), torch.randn(3, 2, generator=g)
    layouts = [("grid", grid, [DShard(0), DShard(1)]), ("rep", rep, [Replicate(), DShard(1)]),
               ("uneven", uneven, [DShard(0), DShard(0)])]
    staged = []
    try:
        for rank in range(world):
            if dist.is_initialized():
                dist.destroy_process_group()
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
            mesh = DeviceMesh("cpu", torch.arange(world).reshape(2, 2))
            coord = mesh.get_coordinate()
            state = {}
            for name, full, plc in layouts:
                lo, size = [0] * full.dim(), list(full.shape)
                for mdim, p in enumerate(plc):
                    if isinstance(p, DShard):
                        o, n = chunk_bounds(size[p.dim], 2, coord[mdim])
                        lo[p.dim] += o
                        size[p.dim] = n
                local = full[tuple(slice(o, o + n) for o, n in zip(lo, size))].clone()
                state[name] = DTensor.from_local(local, mesh, plc, run_check=False, shape=full.shape,
                                                 stride=full.stride())
            staged.append(_staged(rank, {**state, "epoch": 2}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    md = _save_and_compare(tmp_path, monkeypatch, staged)
    assert len(md.tensors["grid"].chunks) == 4 and len(md.tensors["rep"].chunks) == 2  # replicas written once
    assert md.values == {"epoch": 2}


def test_ten_thousand_pieces_commit_the_metadata_built_piece_by_piece(tmp_path, monkeypatch):
    world, tensors = 4, 2500
    staged = []
    for rank in range(world):
        state = {f"layer{t // 10}.w{t % 10}": Shard(torch.full((1, 2 + t % 3), float(rank)), (rank, 0),
                                                    (world, 2 + t % 3)) for t in range(tensors)}
        staged.append(_staged(rank, state))
    md = _save_and_compare(tmp_path, monkeypatch, staged)
    assert sum(len(t.chunks) for t in md.tensors.values()) == world * tensors


# -- the records and the commit step, without storage ------------------------------------------

def _old_tensor_metas(tensors, rows):
    """The commit step as it was: one ChunkMeta per row, grouped by tensor, sorted by offsets (stable)."""
    chunks: dict[str, list[ChunkMeta]] = {k: [] for k in tensors}
    for key, off, size, file, boff, nbytes, crc, blocks in rows:
        chunks[key].append(ChunkMeta(tuple(off), tuple(size), file, boff, nbytes, crc, tuple(blocks)))
    return {k: TensorMeta(s.dtype, tuple(s.shape), tuple(sorted(chunks[k], key=lambda c: c.offsets)))
            for k, s in tensors.items()}


def _random_rows(rnd, tensors, nranks):
    """Every tensor row-split into pieces spread over ranks in a random order; some with block CRCs."""
    per_rank = [[] for _ in range(nranks)]
    for key, spec in tensors.items():
        if not spec.shape:
            per_rank[rnd.randrange(nranks)].append((key, (), (), 8))
            continue
        n = spec.shape[0]
        cuts = sorted({0, n, *rnd.sample(range(1, n), min(3, n - 1))}) if n > 1 else [0, n]
        for a, b in zip(cuts, cuts[1:]):
            size = (b - a, *spec.shape[1:])
            per_rank[rnd.randrange(nranks)].append((key, (a, *[0] * (len(spec.shape) - 1)), size, int(np.prod(size)) * 4))
    records, all_rows = [], []
    for r, pieces in enumerate(per_rank):
        rnd.shuffle(pieces)
        rows = []
        for j, (key, off, size, nbytes) in enumerate(pieces):
            blocks = tuple(rnd.randrange(1 << 32) for _ in range(rnd.choice([0, 0, 2, 3])))
            rows.append((key, off, size, f"data/s/r{r:05d}-f{j % 2:03d}.bin", 64 * j, nbytes, rnd.randrange(1 << 32),
                         blocks))
        all_rows += rows
        records.append(StorageRecord.from_rows(rows))
    return records, all_rows


@pytest.mark.parametrize("seed", range(6))
def test_tensor_metas_equal_the_piece_by_piece_build_byte_for_byte(seed):
    rnd = random.Random(seed)
    tensors = {f"k{t:03d}": TensorSpec("float32", rnd.choice([(), (9,), (6, 4), (5, 2, 3), (0, 3)]))
               for t in rnd.sample(range(200), 25)}
    tensors = dict(sorted(tensors.items()))
    records, rows = _random_rows(rnd, tensors, rnd.randint(1, 5))
    sent = [decode(encode(r)) for r in records]  # as the coordinator receives them
    got = tensor_metas(tensors, sent)
    want = _old_tensor_metas(tensors, rows)
    assert dict(got.items()) == want
    assert encode_metadata(Metadata("s", 3, 1.0, got, {"v": 1})) == encode_metadata(Metadata("s", 3, 1.0, want,
                                                                                              {"v": 1}))


def test_storage_records_travel_packed_and_concatenate_across_key_lists():
    a = StorageRecord.from_rows([("w", (0, 0), (2, 3), "f0", 0, 24, 1, ()), ("b", (), (), "f0", 64, 4, 2, ())])
    b = StorageRecord.from_rows([("v", (4,), (2,), "f1", 0, 8, 3, (5, 6)), ("w", (2, 0), (2, 3), "f1", 64, 24, 4, ())])
    back = decode(encode(a))
    assert isinstance(back.keys, PackedNames) and back.keys._objs is None  # no string made per key on receipt
    assert back == a and back.keys_digest == a.keys_digest and list(back.keys) == ["w", "b"]
    both = StorageRecord.concat([back, StorageRecord(), b])
    assert list(both.rows()) == list(a.rows()) + list(b.rows()) and both.width == 2
    assert both.files == ("f0", "f1") and set(both.keys) == {"w", "b", "v"}
    odd = StorageRecord.from_rows([("a\0b", (0,), (1,), "f", 0, 4, 9, ())])
    assert decode(encode(odd)) == odd and decode(encode(odd)).keys == ("a\0b",)


def test_a_record_that_disagrees_with_the_plan_is_refused():
    tensors = {"w": TensorSpec("float32", (4, 2))}
    with pytest.raises(CheckpointError, match=r"'x'.*not tensors of this save's plan"):
        tensor_metas(tensors, [StorageRecord.from_rows([("x", (0, 0), (4, 2), "f", 0, 32, 1, ())])])
    with pytest.raises(CheckpointError, match=r"piece of 'w' with 1 dimensions, the tensor has 2"):
        tensor_metas(tensors, [StorageRecord.from_rows([("w", (0,), (4,), "f", 0, 16, 1, ())])])
    with pytest.raises(ValueError, match="differ in length"):
        StorageRecord(("w",), [0, 0], [1], [[0]], [[1]], ("f",), [0], [0], [4], [1])


@pytest.mark.parametrize("seed", range(4))
def test_compressed_rows_commit_their_codec_and_stored_length_as_built_piece_by_piece(seed):
    """Records with compressed pieces (codec and stored columns) next to all-raw records (none):
    the columnar commit gives the metadata a ChunkMeta per piece gives, and it decodes back."""
    from raydcp.metadata import COMPRESSED_FORMAT_VERSION, COMPRESSIONS
    from raydcp.metadata_format import decode_metadata

    rnd = random.Random(100 + seed)
    tensors = {f"k{t:03d}": TensorSpec("float32", rnd.choice([(9,), (6, 4), (5, 2, 3)])) for t in range(12)}
    tensors["big"] = TensorSpec("float32", (2 * BLOCK_BYTES + 7,))  # pieces over one checksum block
    records, rows = _random_rows(rnd, tensors, 4)
    packed_records, want_rows = [], []
    for r, rec in enumerate(records):  # a raw piece lists one checksum per block where over one block
        rrows = [(*row[:7], tuple(rnd.randrange(1 << 32) for _ in range(-(-row[5] // BLOCK_BYTES)))
                  if row[5] > BLOCK_BYTES else ()) for row in rec.rows()]
        rec = StorageRecord.from_rows(rrows)
        if r % 2:  # odd ranks compress about half of their pieces; even ranks write raw (no columns)
            codec = [rnd.choice([0, 1, 2]) for _ in rrows]
            rrows = [(*row[:7], () if k else row[7]) for row, k in zip(rrows, codec)]
            stored = [rnd.randrange(1, row[5] + 1) if k else row[5] for row, k in zip(rrows, codec)]
            rec = StorageRecord.from_rows(rrows, codec, stored)
            assert rec.codec is None or rec.codec.dtype == np.uint8
        else:
            codec, stored = [0] * len(rrows), [row[5] for row in rrows]
            assert rec.codec is None and rec.stored is None
        packed_records.append(decode(encode(rec)))
        assert packed_records[-1] == rec
        want_rows += [(row, k, s) for row, k, s in zip(rrows, codec, stored)]
    chunks: dict[str, list[ChunkMeta]] = {k: [] for k in tensors}
    for (key, off, size, file, boff, nbytes, crc, blocks), k, s in want_rows:
        chunks[key].append(ChunkMeta(tuple(off), tuple(size), file, boff, nbytes, crc, tuple(blocks),
                                     *((COMPRESSIONS[k - 1], s) if k else ())))
    want = {k: TensorMeta(s.dtype, tuple(s.shape), tuple(sorted(chunks[k], key=lambda c: c.offsets)))
            for k, s in tensors.items()}
    got = tensor_metas(tensors, packed_records)
    assert dict(got.items()) == want
    md = Metadata("s", 4, 1.0, got, {})
    data = encode_metadata(md)
    assert data == encode_metadata(Metadata("s", 4, 1.0, want, {}))
    back = decode_metadata(data)
    compressed = any(k for _, k, _ in want_rows)
    assert (md.version == COMPRESSED_FORMAT_VERSION) == compressed and back.version == md.version
    assert dict(back.tensors.items()) == want
    both = StorageRecord.concat(packed_records)  # raw records' rows: codec 0, their nbytes stored
    if compressed:
        assert both.codec.tolist() == [k for _, k, _ in want_rows] and both.stored.tolist() == [
            s for _, _, s in want_rows]
    assert dict(tensor_metas(tensors, [both]).items()) == want


def test_a_record_whose_pieces_are_all_raw_carries_no_codec_columns():
    row = ("w", (0,), (2,), "f", 0, 8, 1, ())
    assert StorageRecord.from_rows([row], [0], [8]).codec is None
    rec = StorageRecord.from_rows([row, ("w", (2,), (2,), "f", 64, 8, 2, ())], [0, 2], [8, 5])
    assert rec.stored_lengths.tolist() == [8, 5] and decode(encode(rec)) == rec
    assert rec != StorageRecord.from_rows(list(rec.rows()))  # the codecs are part of the record
    with pytest.raises(ValueError, match="come together"):
        StorageRecord.from_rows([row], [1], None)
    with pytest.raises(ValueError, match="differ in length"):
        StorageRecord.from_rows([row], [1, 1], [4, 4])
