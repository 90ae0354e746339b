import math

import pytest
import torch

from raydcp import CheckpointError
from raydcp.codec import (DTYPES, checksum, decode_value, dtype_from_name, dtype_name, encode_value,
                          is_plain_value, tensor_bytes, tensor_from_bytes)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_dtype_round_trips_bit_exact(name):
    dt = DTYPES[name]
    raw = torch.randint(0, 256, (48,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    if dt == torch.bool:
        raw = raw % 2
    t = raw.view(dt).reshape(-1)
    back = tensor_from_bytes(bytes(tensor_bytes(t).numpy()), name, tuple(t.shape))
    assert back.dtype == dt and torch.equal(back.view(torch.uint8), t.view(torch.uint8))


def test_non_contiguous_zero_size_and_0d():
    t = torch.arange(24.0).reshape(4, 6).t()
    assert not t.is_contiguous()
    back = tensor_from_bytes(bytes(tensor_bytes(t).numpy()), "float32", (6, 4))
    assert torch.equal(back, t)
    assert tensor_bytes(torch.empty(0, 3)).numel() == 0
    assert tensor_from_bytes(b"", "float32", (0, 3)).shape == (0, 3)
    zero_d = torch.tensor(-7, dtype=torch.int64)
    assert tensor_from_bytes(bytes(tensor_bytes(zero_d).numpy()), "int64", ()).item() == -7


def test_int64_extremes():
    t = torch.tensor([torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max, 0])
    assert torch.equal(tensor_from_bytes(bytes(tensor_bytes(t).numpy()), "int64", (3,)), t)


def test_dtype_names():
    assert dtype_name(torch.bfloat16) == "bfloat16" and dtype_from_name("bfloat16") is torch.bfloat16
    with pytest.raises(CheckpointError, match="unknown dtype"):
        dtype_from_name("float128")


def test_checksum_is_crc32c():
    assert checksum(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert checksum(torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)) == 0xE3069283


@pytest.mark.parametrize("value", [
    None, True, 0, -(2**70), 1.5, "ünï", b"\x00\xff", [1, [2, "a"]], (1, (2.0, None)),
    {"a": 1, 3: [b"x"], None: (True,)}, {"__tuple__": 1}, [], {},
])
def test_plain_values_round_trip_exactly(value):
    assert is_plain_value(value)
    back = decode_value(encode_value(value))
    assert back == value and type(back) is type(value)


def test_special_floats_round_trip():
    back = decode_value(encode_value([math.inf, -math.inf, math.nan]))
    assert back[0] == math.inf and back[1] == -math.inf and math.isnan(back[2])


def test_not_plain():
    assert not is_plain_value(object())
    assert not is_plain_value([1, {2}])


@pytest.mark.parametrize("n", [0, 1, 63, 1023, 1024, 1025, 4096, 5 * 1024 + 17])
def test_checksums_in_one_pass_equal_the_two_passes(n):
    from raydcp.codec import block_checksums, checksums

    data = bytes(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n)).numpy())
    assert checksums(data, 1024) == (checksum(data), block_checksums(data, 1024))


def test_crc32c_combine_of_random_pieces():
    import random

    from raydcp.codec import combine_block_checksums, crc32c_combine

    rng = random.Random(3)
    for _ in range(50):
        a, b = rng.randbytes(rng.randrange(0, 2000)), rng.randbytes(rng.randrange(0, 2000))
        assert crc32c_combine(checksum(a), checksum(b), len(b)) == checksum(a + b)
    data = rng.randbytes(10 * 1000 + 1)
    blocks = [checksum(data[i:i + 1000]) for i in range(0, len(data), 1000)]
    assert combine_block_checksums(blocks, len(data), 1000) == checksum(data)
    with pytest.raises(ValueError):
        combine_block_checksums(blocks, len(data) + 1000, 1000)
