"""A row-sharded checkpoint of large chunks loaded onto another number of ranks: every rank reads
its own rows of a chunk it shares with another rank (nothing of them goes through the exchange)."""
from __future__ import annotations

import torch

import raydcp
from raydcp import Shard
from raydcp.engine.load import load_with
from raydcp.engine.save import save_with
from raydcp.metadata import BLOCK_BYTES
from raydcp.planner.load import SPLIT_MIN_BYTES

from .helpers import run_ranks

ROWS, COLS = 120, 2 * SPLIT_MIN_BYTES // 4 // 30 + 1  # 4 saved chunks of 30 rows, each twice SPLIT_MIN_BYTES


def _rows(world: int, rank: int) -> tuple[int, int]:
    lo = rank * ROWS // world
    return lo, (rank + 1) * ROWS // world - lo


def test_ranks_read_their_own_rows_of_shared_chunks_bit_exact(tmp_path):
    ck = str(tmp_path / "ck")
    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)

    def save(tp):
        lo, n = _rows(4, tp.rank)
        return save_with(tp, {"w": Shard(full[lo:lo + n].clone(), (lo, 0), (ROWS, COLS))}, ck)

    _, errs = run_ranks(4, save)
    assert errs == [None] * 4
    assert all(c.nbytes >= SPLIT_MIN_BYTES for c in raydcp.read_metadata(ck).tensors["w"].chunks)

    def load(tp):
        lo, n = _rows(3, tp.rank)
        sd = {"w": Shard(torch.full((n, COLS), float("nan")), (lo, 0), (ROWS, COLS))}
        return sd, load_with(tp, sd, ck)

    out, errs = run_ranks(3, load)
    assert errs == [None] * 3
    for r, (sd, stats) in enumerate(out):
        lo, n = _rows(3, r)
        assert torch.equal(sd["w"].tensor, full[lo:lo + n]), r
        partial = 1 if r in (0, 2) else 2  # saved chunks this rank needs only part of
        # its own rows, each partial read widened to whole checksum blocks at most; reading a
        # neighbour's rows too would add a third of a chunk (far more than a block)
        assert stats.bytes_needed <= stats.bytes_read <= stats.bytes_needed + partial * 2 * BLOCK_BYTES, (r, stats)
