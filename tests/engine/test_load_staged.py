"""Two-phase loads from storage whose reads are views of memory it holds (``memory_reads``, the
memory tier): every piece is read and verified on every rank before any tensor is written, so a
failed load leaves the tensors untouched without an undo copy. Run here on a local directory
whose storage is taken for such storage (its reads are copies, but the protocol is the same)."""
from __future__ import annotations

import pytest
import torch

from raydcp import CheckpointError, LoadOptions, Shard
from raydcp.engine.load import load_with, read_metadata
from raydcp.engine.save import save_with
from raydcp.state import FlatState
from raydcp.storage import CheckpointStorage

from .helpers import run_ranks
from .test_load_atomic import Counter, assert_same, flip, last_chunk, snapshot

ROWS, COLS = 12, 10


def _full(fill: float) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + fill


def _piece(rank: int, world: int, fill: float) -> dict:
    """Rank ``rank``'s rows of "w" (split ``world`` ways), a tensor of its own, and a value."""
    lo, hi = rank * ROWS // world, (rank + 1) * ROWS // world
    return {"w": Shard(_full(fill)[lo:hi].clone(), (lo, 0), (ROWS, COLS)),
            "own": Shard(torch.full((1, 300), fill + rank), (rank, 0), (world, 300)), "step": int(fill)}


@pytest.fixture
def staged(monkeypatch):
    """Loads take the two-phase path; yields the number of undo copies taken (a list, one per copy)."""
    monkeypatch.setattr(CheckpointStorage, "memory_reads", property(lambda self: True))
    copies: list = []
    real = FlatState.undo_copy

    def counting(self, keys):
        copies.append(list(keys))
        return real(self, keys)

    monkeypatch.setattr(FlatState, "undo_copy", counting)
    return copies


def _save(ck: str, world: int) -> None:
    _, errs = run_ranks(world, lambda t: save_with(t, _piece(t.rank, world, 1.0), ck))
    assert errs == [None] * world


def test_staged_reshard_load_is_exact_without_an_undo_copy(tmp_path, staged):
    ck = str(tmp_path / "ck")
    _save(ck, 2)
    dests = [{"w": Shard(torch.zeros(4, COLS), (4 * r, 0), (ROWS, COLS))} for r in range(3)]  # 2 -> 3
    _, errs = run_ranks(3, lambda t: load_with(t, dests[t.rank], ck, strict=False))
    assert errs == [None] * 3
    for r, d in enumerate(dests):
        assert torch.equal(d["w"].tensor, _full(1.0)[4 * r:4 * r + 4])
    assert staged == []


def test_staged_load_damaged_on_one_rank_leaves_every_rank_untouched(tmp_path, staged):
    ck = str(tmp_path / "ck")
    _save(ck, 2)
    path, chunk = last_chunk(read_metadata(ck), ck, keys={"own"})
    flip(path, chunk.byte_offset + 5)
    dests = [_piece(r, 2, 7.0) for r in range(2)]
    before = [snapshot(d) for d in dests]
    for options in (LoadOptions(), LoadOptions(atomic=False)):
        _, errs = run_ranks(2, lambda t: load_with(t, dests[t.rank], ck, options=options))
        assert all(isinstance(e, CheckpointError) and "own: checksum mismatch" in str(e) for e in errs), errs
        for b, d in zip(before, dests):
            assert_same(b, d)
    assert staged == []  # nothing was copied to be put back
    assert errs[0].written_keys == ()  # atomic=False: and nothing was written either


def test_staged_load_with_a_stateful_failing_still_rolls_back(tmp_path, staged):
    """A Stateful's load_state_dict runs after the tensors are written: there the undo copy stays."""
    ck = str(tmp_path / "ck")
    states = [{**_piece(r, 2, 1.0), f"c{r}": Counter(r)} for r in range(2)]
    _, errs = run_ranks(2, lambda t: save_with(t, states[t.rank], ck))
    assert errs == [None, None]
    counters = [Counter(50), Counter(51, fail=True)]
    dests = [{**_piece(r, 2, 7.0), f"c{r}": counters[r]} for r in range(2)]
    before = [snapshot({k: v for k, v in d.items() if k[0] != "c"}) for d in dests]
    _, errs = run_ranks(2, lambda t: load_with(t, dests[t.rank], ck))
    assert all(isinstance(e, CheckpointError) and "refusing the loaded state" in str(e) for e in errs), errs
    for b, d in zip(before, dests):
        assert_same(b, {k: v for k, v in d.items() if k[0] != "c"})
    assert len(staged) == 2  # one undo copy per rank
