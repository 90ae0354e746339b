"""Pieces stored compressed (SaveOptions(compression=...)): round trips with each codec, every
piece addressable and checksummed over its stored bytes, N -> M loads, damage named by file and
key, and the metadata's versions (1.0 without compressed pieces, 2.0 with)."""
from __future__ import annotations

import json
import os
import struct

import pyarrow as pa
import pytest
import torch

import raydcp
from raydcp.codec import checksum, decompress
from raydcp.engine import load_with, save_with
from raydcp.engine.compressed import MIN_COMPRESSED_BYTES
from raydcp.errors import CheckpointDamagedError, CheckpointError
from raydcp.metadata import COMPRESSED_FORMAT_VERSION, FORMAT_VERSION, ChunkMeta, Metadata, TensorMeta
from raydcp.metadata_format import MAGIC, decode_metadata, encode_metadata
from raydcp.options import IOOptions, SaveOptions
from raydcp.storage import METADATA_NAME
from raydcp.verify import verify_checkpoint

from .helpers import run_ranks

MIB = 1 << 20
CODECS = ["zstd", "lz4"]


def weights(seed: int = 0) -> dict:
    """Tensors that compress (low-entropy bytes) beside ones that do not (random bytes), of odd sizes."""
    g = torch.Generator().manual_seed(seed)
    return {
        "emb": torch.randint(0, 8, (3 * MIB // 2 + 5,), dtype=torch.int16, generator=g),  # > 1 block, compressible
        "w": (torch.randn(256, 96, generator=g) * 0.02).to(torch.bfloat16),
        "ln": torch.ones(300),                                               # under MIN_COMPRESSED_BYTES: raw
        "mask": torch.arange(5000) % 3 == 0,
        "noise": torch.randint(0, 256, (2 * MIB + 7,), dtype=torch.uint8, generator=g),  # does not shrink: raw
        "t": torch.arange(6000, dtype=torch.float64).reshape(60, 100).t(),  # not contiguous
        "empty": torch.empty(0, 4),
        "step": 7,
    }


def zeros_like(sd: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}


def assert_same(a: dict, b: dict) -> None:
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(b[k], v), k
        else:
            assert b[k] == v, k


def stored_bytes(path, c: ChunkMeta) -> bytes:
    with open(os.path.join(path, c.file), "rb") as f:
        f.seek(c.byte_offset)
        return f.read(c.stored_length)


def flip(path, c: ChunkMeta, at: int) -> None:
    with open(os.path.join(path, c.file), "r+b") as f:
        f.seek(c.byte_offset + at)
        b = f.read(1)
        f.seek(c.byte_offset + at)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_and_every_piece_addressable(tmp_path, codec):
    sd = weights()
    md = raydcp.save(sd, tmp_path / "ck", options=SaveOptions(compression=codec))
    assert md.version == COMPRESSED_FORMAT_VERSION
    back = raydcp.read_metadata(tmp_path / "ck")
    assert back.version == COMPRESSED_FORMAT_VERSION and back.compressions == md.compressions
    assert back.compressions[codec] >= 1 and back.stored_bytes < back.total_bytes
    for key, tm in back.tensors.items():
        for c in tm.chunks:
            data = stored_bytes(tmp_path / "ck", c)
            assert c.checksum == checksum(data), key  # over the stored bytes
            raw = sd[key].detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            if c.compression is None:
                assert data == raw and c.stored_nbytes is None, key
            else:
                assert c.compression == codec and c.block_checksums == () and c.stored_length < c.nbytes, key
                assert bytes(decompress(codec, data, c.nbytes)) == raw, key  # each piece a frame of its own
    assert back.tensors["noise"].chunks[0].compression is None  # did not shrink: raw, block checksums kept
    assert len(back.tensors["noise"].chunks[0].block_checksums) == 3
    assert back.tensors["ln"].chunks[0].compression is None and 1200 < MIN_COMPRESSED_BYTES
    assert back.tensors["emb"].chunks[0].compression == codec
    assert all(c.byte_offset % 64 == 0 for tm in back.tensors.values() for c in tm.chunks)
    out = zeros_like(sd)
    stats = raydcp.load(out, tmp_path / "ck")
    assert_same(sd, out)
    assert stats.bytes_read == back.stored_bytes < stats.bytes_needed  # the stored bytes, each read once


@pytest.mark.parametrize("codec", CODECS)
def test_small_packed_pieces_are_compressed_one_by_one(tmp_path, codec):
    sd = {f"p{i:02d}": torch.full((2048 + i,), float(i % 3)) for i in range(40)}  # 8 KiB each: packed
    io = IOOptions(pack_max=64 << 10, pack_bytes=64 << 10)
    raydcp.save(sd, tmp_path / "ck", options=SaveOptions(compression=codec, io=io))
    md = raydcp.read_metadata(tmp_path / "ck")
    assert md.compressions == {codec: 40} and len(md.files) == 1
    for key, tm in md.tensors.items():
        (c,) = tm.chunks
        assert bytes(decompress(codec, stored_bytes(tmp_path / "ck", c), c.nbytes)) == \
            sd[key].view(torch.uint8).numpy().tobytes()
    part = {"p17": torch.zeros(2048 + 17)}
    raydcp.load(part, tmp_path / "ck", strict=False)
    assert torch.equal(part["p17"], sd["p17"])


@pytest.mark.parametrize("codec", CODECS)
def test_n_to_m_load_of_a_compressed_checkpoint(tmp_path, codec):
    g = torch.Generator().manual_seed(1)
    full = torch.randint(0, 16, (96, 12000), dtype=torch.int32, generator=g)  # 1.5 MB pieces: joint-read size
    ck = str(tmp_path / "ck")
    options = SaveOptions(compression=codec, max_file_bytes=400_000)

    def save(tp):
        n = 96 // 3
        return save_with(tp, {"w": raydcp.Shard(full[tp.rank * n:(tp.rank + 1) * n].clone(), (tp.rank * n, 0),
                                                (96, 12000)), "step": 3}, ck, None, options)

    results, errors = run_ranks(3, save)
    assert errors == [None] * 3 and results[0].compressions == {codec: 3}

    def load(tp, m):
        n = 96 // m
        t = torch.zeros(n, 12000, dtype=torch.int32)
        sd = {"w": raydcp.Shard(t, (tp.rank * n, 0), (96, 12000)), "step": None}
        stats = load_with(tp, sd, ck)
        return torch.equal(t, full[tp.rank * n:(tp.rank + 1) * n]) and sd["step"] == 3, stats.bytes_read

    for m in (4, 2, 1):
        results, errors = run_ranks(m, lambda tp: load(tp, m))
        assert errors == [None] * m, errors
        assert all(ok for ok, _ in results)
        # each stored piece is read once, by one rank, whole (no joint reads of compressed pieces)
        assert sum(n for _, n in results) == raydcp.read_metadata(ck).stored_bytes


@pytest.mark.parametrize("codec", CODECS)
def test_a_partial_load_reads_the_compressed_piece_whole(tmp_path, codec):
    t = torch.arange(64 * 1024, dtype=torch.int32).reshape(64, 1024) % 7
    raydcp.save({"t": t}, tmp_path / "ck", options=SaveOptions(compression=codec))
    (c,) = raydcp.read_metadata(tmp_path / "ck").tensors["t"].chunks
    part = {"t": raydcp.Shard(torch.zeros(3, 1024, dtype=torch.int32), (10, 0), (64, 1024))}
    stats = raydcp.load(part, tmp_path / "ck", strict=False)
    assert torch.equal(part["t"].tensor, t[10:13])
    assert stats.bytes_read == c.stored_length and stats.bytes_needed == 3 * 1024 * 4


@pytest.mark.parametrize("codec", CODECS)
def test_damage_to_a_compressed_piece_names_file_and_key(tmp_path, codec):
    sd = weights()
    raydcp.save(sd, tmp_path / "ck", options=SaveOptions(compression=codec))
    md = raydcp.read_metadata(tmp_path / "ck")
    (c,) = md.tensors["emb"].chunks
    flip(tmp_path / "ck", c, c.stored_length // 2)
    with pytest.raises(CheckpointDamagedError, match=r"emb: checksum mismatch in .* at bytes "
                                                     rf"{c.byte_offset}\.\.{c.byte_offset + c.stored_length} "
                                                     rf"\({codec}-compressed piece") as info:
        raydcp.load(zeros_like(sd), tmp_path / "ck")
    assert info.value.file == c.file and info.value.key == "emb"
    report = verify_checkpoint(tmp_path / "ck")
    assert [(p.kind, p.key, p.file) for p in report.problems] == [("checksum", "emb", c.file)]
    with open(os.path.join(tmp_path / "ck", c.file), "r+b") as f:  # cut the file inside the piece
        f.truncate(c.byte_offset + 10)
    with pytest.raises(CheckpointError, match=r"emb: .*truncated"):
        raydcp.load({"emb": torch.zeros_like(sd["emb"])}, tmp_path / "ck", strict=False)


def test_a_frame_that_does_not_decompress_is_damage_even_with_a_matching_checksum(tmp_path):
    """Stored bytes whose checksum matches but which are no frame of the codec (a writer's bug, a
    forged file): the load and verify name the piece, nothing is filled with garbage."""
    t = torch.zeros(64 * 1024, dtype=torch.int32)
    md = raydcp.save({"t": t}, tmp_path / "ck", options=SaveOptions(compression="zstd"))
    (c,) = md.tensors["t"].chunks
    garbage = bytes(range(256)) * (c.stored_length // 256) + bytes(c.stored_length % 256)
    with open(os.path.join(tmp_path / "ck", c.file), "r+b") as f:
        f.seek(c.byte_offset)
        f.write(garbage)
    forged = ChunkMeta(c.offsets, c.sizes, c.file, c.byte_offset, c.nbytes, checksum(garbage), (), "zstd",
                       c.stored_length)
    md2 = Metadata(md.save_id, 1, md.created_at, {"t": TensorMeta("int32", (64 * 1024,), (forged,))}, {})
    with open(tmp_path / "ck" / METADATA_NAME, "wb") as f:
        f.write(encode_metadata(md2))
    with pytest.raises(CheckpointDamagedError, match=r"t: the zstd-compressed piece at \[0\] in .* does not "
                                                     r"decompress to its 262144 bytes") as info:
        raydcp.load({"t": torch.ones_like(t)}, tmp_path / "ck")
    assert info.value.file == c.file and info.value.key == "t"
    (problem,) = verify_checkpoint(tmp_path / "ck").problems
    assert problem.kind == "decompress" and problem.key == "t" and problem.file == c.file


def _preamble(data: bytes) -> tuple[int, int]:
    magic, major, minor = struct.unpack_from("<8sII", data)
    assert magic == MAGIC
    return major, minor


def _schema_and_header(data: bytes) -> tuple[list[str], dict]:
    reader = pa.ipc.open_stream(pa.py_buffer(data[struct.calcsize("<8sIIQI"):]))
    return [f.name for f in reader.schema], json.loads(reader.schema.metadata[b"raydcp"])


def test_an_uncompressed_checkpoint_keeps_format_1_0(tmp_path):
    raydcp.save(weights(), tmp_path / "raw")
    raw = (tmp_path / "raw" / METADATA_NAME).read_bytes()
    assert _preamble(raw) == FORMAT_VERSION == (1, 0)
    names, header = _schema_and_header(raw)
    assert names == ["tensor", "offsets", "sizes", "file", "byte_offset", "nbytes", "checksum", "block_checksums"]
    assert "codecs" not in header  # exactly what a reader of 1.0 reads
    raydcp.save(weights(), tmp_path / "packed", options=SaveOptions(compression="lz4"))
    packed = (tmp_path / "packed" / METADATA_NAME).read_bytes()
    assert _preamble(packed) == COMPRESSED_FORMAT_VERSION
    names, header = _schema_and_header(packed)
    assert names[-2:] == ["codec", "stored_nbytes"] and header["codecs"] == ["lz4"]


def test_metadata_with_compressed_pieces_round_trips_both_encoder_paths():
    chunks = (ChunkMeta((0,), (4,), "f0", 0, 16, 1), ChunkMeta((4,), (4,), "f0", 64, 16, 2, (), "zstd", 9))
    md = Metadata("s", 1, 0.0, {"a": TensorMeta("float32", (8,), chunks),
                                "b": TensorMeta("int8", (2, 8), (ChunkMeta((0, 0), (2, 8), "f1", 0, 16, 3, (), "lz4", 12),))},
                  {"x": 1})
    back = decode_metadata(encode_metadata(md))  # tables of ChunkMeta: concatenated columns
    assert back.version == COMPRESSED_FORMAT_VERSION
    assert tuple(back.tensors["a"].chunks) == chunks and back.tensors["b"].chunks[0].compression == "lz4"
    assert back.compressions == {"zstd": 1, "lz4": 1} and back.files == {"f0": 25, "f1": 12}
    again = decode_metadata(encode_metadata(back))  # decoded columns, written as they are
    assert tuple(again.tensors["a"].chunks) == chunks and again.stored_bytes == 37 and again.total_bytes == 48


def _rewrite(data: bytes, header_change=None, version=None) -> bytes:
    """``data`` with its header changed and/or its version replaced (the payload re-checksummed)."""
    size = struct.calcsize("<8sIIQI")
    reader = pa.ipc.open_stream(pa.py_buffer(data[size:]))
    table = reader.read_all()
    header = json.loads(reader.schema.metadata[b"raydcp"])
    if header_change:
        header_change(header)
    schema = table.schema.with_metadata({b"raydcp": json.dumps(header)})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as w:
        w.write_table(table.cast(schema))
    payload = sink.getvalue().to_pybytes()
    major, minor = version or _preamble(data)
    return struct.pack("<8sIIQI", MAGIC, major, minor, len(payload), checksum(payload)) + payload


def test_readers_refuse_what_they_cannot_read_with_the_next_step():
    md = Metadata("s", 1, 0.0, {"a": TensorMeta("float32", (4,), (ChunkMeta((0,), (4,), "f", 0, 16, 1, (), "zstd", 9),))},
                  {})
    data = encode_metadata(md)
    with pytest.raises(CheckpointError, match=r"format version 4\.0 is not supported .* upgrade raydcp") as info:
        decode_metadata(_rewrite(data, version=(4, 0)))
    assert not isinstance(info.value, CheckpointDamagedError)
    unknown = _rewrite(data, lambda h: h.update(codecs=["brotli"]))
    with pytest.raises(CheckpointError, match=r"compressed with 'brotli', which this raydcp does not know") as info:
        decode_metadata(unknown)
    assert not isinstance(info.value, CheckpointDamagedError)
    no_codec = _rewrite(data, lambda h: h.update(codecs=[]))
    with pytest.raises(CheckpointDamagedError, match="names a codec that is not in the header"):
        decode_metadata(no_codec)
    bad = Metadata("s", 1, 0.0, {"a": TensorMeta("float32", (4,), (ChunkMeta((0,), (4,), "f", 0, 16, 1, (), None, 9),
                                                                   ChunkMeta((0,), (0,), "f", 0, 0, 1, (), "zstd", 1)))},
                   {})
    with pytest.raises(CheckpointDamagedError, match="is stored raw but records a stored length of 9 bytes, not 16"):
        decode_metadata(encode_metadata(bad))


@pytest.mark.parametrize("staging", ["private", "shm"])
def test_async_save_compresses_in_the_helper_process(tmp_path, staging, monkeypatch):
    monkeypatch.setenv("RAYDCP_STAGING", staging)
    sd = weights(seed=2)
    md = raydcp.async_save(sd, tmp_path / "ck", options=SaveOptions(compression="zstd")).result(120)
    assert md.version == COMPRESSED_FORMAT_VERSION and md.compressions["zstd"] >= 3
    out = zeros_like(sd)
    raydcp.load(out, tmp_path / "ck")
    assert_same(sd, out)
    assert verify_checkpoint(tmp_path / "ck").ok


def test_bad_compression_options_name_the_option():
    with pytest.raises(CheckpointError, match=r"SaveOptions.compression must be None or one of 'zstd', 'lz4', "
                                              r"got 'gzip'"):
        SaveOptions(compression="gzip")
    with pytest.raises(CheckpointError, match=r"SaveOptions.compression must be None or one of"):
        SaveOptions(compression=True)


def test_compressed_rounds_journal_and_commit(tmp_path):
    from raydcp.engine.rounds import RoundJournal, RoundRecords, commit_rounds, round_save_id, write_round
    from raydcp.planner import TensorSpec
    from raydcp.transport import LocalTransport

    full = torch.arange(8 * 4096, dtype=torch.int32).reshape(8, 4096) % 5
    path = str(tmp_path / "ck")
    journal = RoundJournal(path, {"job": "rows"})
    journal.start()
    options = SaveOptions(compression="zstd")
    for i in range(2):
        rec = write_round(LocalTransport(), {f"w#{i}": full[4 * i:4 * i + 4].clone()}, path,
                          round_save_id(journal.save_id, i), options=options)
        assert rec.records.codec.tolist() == [1] and rec.records.stored[0] < rec.records.nbytes[0]
        assert RoundRecords.from_json(json.loads(json.dumps(rec.to_json()))) == rec  # the journal keeps codecs
        journal.record(i, rec)
    resumed = RoundJournal(path, {"job": "rows"})  # a rerun finds both rounds done (files long enough)
    assert resumed.resumed and sorted(resumed.done) == [0, 1]
    md = commit_rounds(path, journal.save_id, 1, [resumed.done[0], resumed.done[1]],
                       {"w": TensorSpec("int32", (8, 4096))},
                       placement={"w#0": ("w", (0, 0)), "w#1": ("w", (4, 0))})
    assert md.version == COMPRESSED_FORMAT_VERSION and md.compressions == {"zstd": 2}
    out = {"w": torch.zeros(8, 4096, dtype=torch.int32)}
    raydcp.load(out, path)
    assert torch.equal(out["w"], full)
