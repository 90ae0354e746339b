import random
import struct

import pytest
from hypothesis import given, settings, strategies as st

from raydcp import CheckpointError
from raydcp.metadata import BLOCK_BYTES as BLOCK
from raydcp.metadata import FORMAT_VERSION, READ_MAJORS, ChunkMeta, Metadata, TensorMeta
from raydcp.metadata_format import decode_metadata, encode_metadata


def sample() -> Metadata:
    w = TensorMeta("float32", (4, 3), (ChunkMeta((0, 0), (2, 3), "data/x/r0.bin", 0, 24, 11),
                                       ChunkMeta((2, 0), (2, 3), "data/x/r1.bin", 64, 24, 12)))
    z = TensorMeta("bfloat16", (), (ChunkMeta((), (), "data/x/r0.bin", 64, 2, 5),))
    e = TensorMeta("int64", (0, 4), ())
    return Metadata("x", 2, 1700000000.5, {"w": w, "z": z, "e": e},
                    {"step": 3, "lr": 1e-3, "tags": ("a", b"b"), "cfg": {1: None}})


def test_round_trip():
    md = sample()
    back = decode_metadata(encode_metadata(md))
    assert back.tensors == md.tensors and back.values == md.values
    assert (back.save_id, back.world_size, back.created_at, back.version) == ("x", 2, 1700000000.5, FORMAT_VERSION)
    assert back.files == {"data/x/r0.bin": 26, "data/x/r1.bin": 24} and back.total_bytes == 50


def test_unknown_major_version_is_refused_clearly():
    data = bytearray(encode_metadata(sample()))
    struct.pack_into("<I", data, 8, max(READ_MAJORS) + 1)
    with pytest.raises(CheckpointError, match=rf"format version {max(READ_MAJORS) + 1}\.0 is not supported.*"
                                              r"upgrade raydcp"):
        decode_metadata(bytes(data), "ck/raydcp.meta")


@pytest.mark.parametrize("damage,match", [
    (lambda d: d[: len(d) // 2], "truncated"),
    (lambda d: b"", "too short"),
    (lambda d: b"PK\x03\x04" + d[4:], "bad magic"),
    (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "checksum mismatch"),
    (lambda d: d + b"x", "truncated or damaged"),
])
def test_damage_is_named(damage, match):
    with pytest.raises(CheckpointError, match=match) as e:
        decode_metadata(damage(encode_metadata(sample())), "ck/raydcp.meta")
    assert "ck/raydcp.meta" in str(e.value)


def test_seeded_random_mutations_only_raise_checkpoint_error():
    data = encode_metadata(sample())
    rng = random.Random(1234)
    for _ in range(2000):
        d = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            op = rng.random()
            pos = rng.randrange(len(d))
            if op < 0.6:
                d[pos] = rng.randrange(256)
            elif op < 0.8:
                del d[pos:pos + rng.randint(1, 16)]
            else:
                d[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        if bytes(d) == data:
            continue
        try:
            decode_metadata(bytes(d))
        except CheckpointError:
            pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_arbitrary_bytes_only_raise_checkpoint_error(blob):
    with pytest.raises(CheckpointError):
        decode_metadata(blob)


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=0, max_size=300))
def test_payload_garbage_behind_a_valid_envelope_only_raises_checkpoint_error(payload):
    # a correct envelope and checksum around garbage: the Arrow decoder itself must be guarded
    from raydcp.codec import checksum
    from raydcp.metadata_format import MAGIC, _PREAMBLE

    blob = _PREAMBLE.pack(MAGIC, *FORMAT_VERSION, len(payload), checksum(payload)) + payload
    with pytest.raises(CheckpointError):
        decode_metadata(blob)


def test_chunk_outside_its_tensor_is_refused():
    md = sample()
    bad = TensorMeta("float32", (4, 3), (ChunkMeta((3, 0), (2, 3), "f", 0, 24, 0),))
    blob = encode_metadata(Metadata("x", 1, 0.0, {"w": bad}, {}))
    with pytest.raises(CheckpointError, match="does not fit the tensor's shape"):
        decode_metadata(blob)
    assert md  # the sample itself stays decodable


def test_decoded_chunks_are_columns_that_read_as_chunk_meta():
    import pickle

    from raydcp.metadata import ChunkTable

    md = sample()
    back = decode_metadata(encode_metadata(md))
    w = back.tensors["w"].chunks
    assert isinstance(w, ChunkTable) and len(w) == 2
    assert w[1] == md.tensors["w"].chunks[1] and w[-1] == w[1]  # one chunk, built on access
    assert list(w) == list(md.tensors["w"].chunks) and w == md.tensors["w"].chunks
    assert back.tensors["w"].nbytes == 48 and back.tensors["z"].chunks[0].offsets == ()
    again = pickle.loads(pickle.dumps(back))
    assert again.tensors == md.tensors
    # re-encoding decoded metadata (columns) gives the same bytes as encoding the objects
    assert encode_metadata(back) == encode_metadata(md)


def test_mixed_dimensions_and_block_checksums_round_trip():
    big = 3 * BLOCK + 5
    a = TensorMeta("uint8", (big,), (ChunkMeta((0,), (big,), "f0", 0, big, 1, (10, 11, 12, 13)),))
    b = TensorMeta("float32", (2, 2, 2), (ChunkMeta((0, 0, 0), (1, 2, 2), "f1", 0, 16, 2),
                                          ChunkMeta((1, 0, 0), (1, 2, 2), "f0", big + 59, 16, 3)))
    md = Metadata("x", 2, 0.0, {"a": a, "b": b, "c": TensorMeta("int64", (), (ChunkMeta((), (), "f1", 64, 8, 4),))}, {})
    back = decode_metadata(encode_metadata(md))
    assert back.tensors == md.tensors and back.files == md.files


def test_rows_out_of_tensor_order_decode_on_the_general_path():
    import pyarrow as pa

    from raydcp.metadata_format import _SCHEMA_FIELDS, _envelope, _header

    md = sample()
    cols = [pa.array([1, 0, 0], pa.int32()), pa.array([[], [0, 0], [2, 0]], pa.list_(pa.int64())),
            pa.array([[], [2, 3], [2, 3]], pa.list_(pa.int64())), pa.array([0, 0, 1], pa.int32()),
            pa.array([64, 0, 64], pa.int64()), pa.array([2, 24, 24], pa.int64()), pa.array([5, 11, 12], pa.uint32()),
            pa.array([[], [], []], pa.list_(pa.uint32()))]
    header = _header(Metadata("x", 2, 1.0, {"w": md.tensors["w"], "z": md.tensors["z"]}, {}), ["w", "z"],
                     ["data/x/r0.bin", "data/x/r1.bin"])
    assert [f.name for f in _SCHEMA_FIELDS][0] == "tensor"
    back = decode_metadata(_envelope(cols, header))
    assert back.tensors["w"] == md.tensors["w"] and back.tensors["z"] == md.tensors["z"]


def test_block_checksums_of_every_tensor_survive_decoding():
    """Each tensor's chunks index one shared column of block checksums."""
    n = BLOCK + 1
    tensors = {f"t{i}": TensorMeta("uint8", (n,), (ChunkMeta((0,), (n,), "f", i * 2 * BLOCK, n, i,
                                                           (100 + i, 200 + i)),))
               for i in range(3)}
    back = decode_metadata(encode_metadata(Metadata("x", 1, 0.0, tensors, {})))
    assert [c.block_checksums for t in back.tensors.values() for c in t.chunks] == [(100, 200), (101, 201), (102, 202)]
    assert [back.tensors[k].chunks[0].block_checksums for k in tensors] == [(100, 200), (101, 201), (102, 202)]


def _mixed() -> Metadata:
    big = 2 * BLOCK + 4
    tensors = {
        "a": TensorMeta("uint8", (big, 2), (ChunkMeta((0, 0), (big, 1), "f1", 0, big, 1, (10, 11, 12)),
                                            ChunkMeta((0, 1), (big, 1), "f0", 0, big, 2, (13, 14, 15)))),
        "s": TensorMeta("int64", (), (ChunkMeta((), (), "f2", 64, 8, 3),)),
        "e": TensorMeta("float32", (0, 3), ()),
        "v": TensorMeta("float32", (6,), (ChunkMeta((3,), (3,), "f2", 128, 12, 4), ChunkMeta((0,), (3,), "f1", 0, 12, 5))),
    }
    return Metadata("x", 2, 3.0, tensors, {"step": 1})


def test_decoded_tensors_are_columns_built_into_objects_on_lookup():
    from raydcp.metadata import ChunkColumns, TensorMetas

    md = _mixed()
    blob = encode_metadata(md)
    back = decode_metadata(blob)
    assert isinstance(back.tensors, TensorMetas) and isinstance(back.tensors.columns, ChunkColumns)
    assert list(back.tensors) == list(md.tensors) and len(back.tensors) == 4
    # totals come from the columns, before any per-tensor object exists
    assert back.total_bytes == md.total_bytes and back.files == md.files
    assert back.tensors._dict is None
    assert dict(back.tensors.items()) == dict(md.tensors.items()) and "a" in back.tensors and "zz" not in back.tensors
    assert back.tensors["a"].chunks.origin[0] is back.tensors.columns
    assert encode_metadata(back) == blob


def test_tables_viewing_one_set_of_columns_encode_as_the_objects_do():
    md = _mixed()
    cols = decode_metadata(encode_metadata(md)).tensors
    tables = cols.columns.tables()
    views = {name: TensorMeta(t.dtype, t.shape, table) for (name, t), table in zip(md.tensors.items(), tables)}
    assert encode_metadata(Metadata("x", 2, 3.0, views, {"step": 1})) == encode_metadata(md)
    # a subset in another order takes the rows of just those tensors
    sub = {k: views[k] for k in ("v", "a", "e")}
    assert encode_metadata(Metadata("x", 2, 3.0, sub, {})) == encode_metadata(
        Metadata("x", 2, 3.0, {k: md.tensors[k] for k in sub}, {}))
    back = decode_metadata(encode_metadata(Metadata("x", 2, 3.0, sub, {})))
    assert dict(back.tensors.items()) == {k: md.tensors[k] for k in sub}
    assert back.files == {"f0": 2 * BLOCK + 4, "f1": 2 * BLOCK + 16, "f2": 12}


def test_a_tensor_listed_twice_in_the_header_is_refused():
    from raydcp.metadata_format import _SCHEMA_FIELDS, _envelope, _header

    import pyarrow as pa

    md = sample()
    header = _header(md, ["w", "w"], ["data/x/r0.bin"])
    cols = [pa.array([], f.type) for f in _SCHEMA_FIELDS]
    with pytest.raises(CheckpointError, match="listed twice"):
        decode_metadata(_envelope(cols, header))
