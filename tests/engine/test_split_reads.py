"""A row-sharded checkpoint loaded onto another number of ranks: each rank reads exactly its own rows
of a stored chunk it shares with another rank (nothing of it goes through the exchange), and the
checksum block the two shares straddle is verified from both ranks' CRCs."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import raydcp
from raydcp import CheckpointError, Shard
from raydcp.engine.load import load_with
from raydcp.engine.save import save_with
from raydcp.metadata import BLOCK_BYTES

from .helpers import run_ranks

ROWS, COLS = 120, (6 << 20) // 4 // 30 + 1  # 4 saved chunks of 30 rows, a little over 6 MiB each
ROW_BYTES = COLS * 4


def _rows(world: int, rank: int) -> tuple[int, int]:
    lo = rank * ROWS // world
    return lo, (rank + 1) * ROWS // world - lo


def _save(ck: str, full: torch.Tensor) -> None:
    def save(tp):
        lo, n = _rows(4, tp.rank)
        return save_with(tp, {"w": Shard(full[lo:lo + n].clone(), (lo, 0), (ROWS, COLS))}, ck)

    _, errs = run_ranks(4, save)
    assert errs == [None] * 4


def _load(ck: str):
    def load(tp):
        lo, n = _rows(3, tp.rank)
        sd = {"w": Shard(torch.full((n, COLS), float("nan")), (lo, 0), (ROWS, COLS))}
        return sd, load_with(tp, sd, ck)

    return run_ranks(3, load)


def test_ranks_read_exactly_their_own_rows_of_shared_chunks_bit_exact(tmp_path):
    ck = str(tmp_path / "ck")
    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    _save(ck, full)
    out, errs = _load(ck)
    assert errs == [None] * 3
    for r, (sd, stats) in enumerate(out):
        lo, n = _rows(3, r)
        assert torch.equal(sd["w"].tensor, full[lo:lo + n]), r
        # read amplification exactly 1.0: no neighbour's rows, no widening to whole checksum blocks
        assert stats.bytes_read == stats.bytes_needed == n * ROW_BYTES, (r, stats)


# chunk 1 holds rows 30-59; rank 0 of 3 needs rows 30-39, rank 1 rows 40-59. Their boundary, 10 rows
# into the chunk, lies inside checksum block 2, which each of them reads only a share of.
BOUNDARY = 10 * ROW_BYTES
assert 2 * BLOCK_BYTES < BOUNDARY < 3 * BLOCK_BYTES


@pytest.mark.parametrize("where", [BOUNDARY - 3, BOUNDARY + 5, 4 * BLOCK_BYTES + 7],
                         ids=["rank-0-share", "rank-1-share", "whole-block"])
def test_damage_anywhere_in_a_shared_chunk_fails_every_rank(tmp_path, where):
    ck = str(tmp_path / "ck")
    _save(ck, torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS))
    chunk = next(c for c in raydcp.read_metadata(ck).tensors["w"].chunks if c.offsets == (30, 0))
    path = Path(ck, chunk.file)
    data = bytearray(path.read_bytes())
    data[chunk.byte_offset + where] ^= 0x10
    path.write_bytes(bytes(data))
    _, errs = _load(ck)
    assert all(isinstance(e, CheckpointError) for e in errs), errs
    assert all("'w'" in str(e) or "w:" in str(e) for e in errs) and all("checksum mismatch" in str(e) for e in errs)
