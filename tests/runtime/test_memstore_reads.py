"""raymem:// reads on the node holding the files: zero-copy views of the object store's copies,
found with one holder lookup and one get for all the files a read names."""
from __future__ import annotations

import pytest
import torch

import raydcp
from raydcp.runtime.memstore.layout import is_data_file

from ._raymem_state import COLS, ROWS, fresh_name, save_two_ranks
from ._raymem_state import raymem_fs as _fs


@pytest.fixture
def name(ray_session):
    yield from fresh_name(ray_session, "reads")


def test_the_files_of_a_read_come_in_one_get(name, monkeypatch):
    import ray

    url = f"raymem://{name}/ck"
    assert save_two_ranks(url, seed=3) == [None, None]
    files = [p for p in _fs().find(f"{name}/ck") if is_data_file(p)]
    assert len(files) == 2  # one per rank
    fs = _fs()
    gets: list = []
    real = ray.get

    def counting(refs, *args, **kwargs):
        gets.append(len(refs) if isinstance(refs, list) else 1)
        return real(refs, *args, **kwargs)

    monkeypatch.setattr(ray, "get", counting)
    heads = fs.cat_ranges(files, [0, 0], [16, 16])
    monkeypatch.setattr(ray, "get", real)
    assert [len(h) for h in heads] == [16, 16]
    assert gets == [1, 2]  # the holder's lookup, then both files at once
    whole = {"w": torch.zeros(ROWS, COLS), "seed": -1}
    raydcp.load(whole, url)
    assert torch.equal(whole["w"], torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(3)))


def test_a_load_verifies_every_rank_s_pieces_before_writing_any(name, monkeypatch):
    """From the object store a load is in two phases: a piece damaged on one rank's file fails
    every rank before any tensor is written, and no undo copy of the tensors is taken."""
    from raydcp.engine.load import load_with
    from raydcp.errors import CheckpointDamagedError
    from raydcp.state import FlatState

    from ..engine.helpers import run_ranks
    from ._raymem_state import two_rank_state

    url = f"raymem://{name}/ck"
    assert save_two_ranks(url, seed=4) == [None, None]
    fs = _fs()
    assert fs.memory_views and raydcp.storage.CheckpointStorage(url).memory_reads
    damaged = max(p for p in fs.find(f"{name}/ck") if is_data_file(p))
    data = bytearray(fs.cat_file(damaged))
    data[9] ^= 0x10
    fs.pipe_file(damaged, bytes(data))  # the file held anew with one bit flipped
    copies: list = []
    monkeypatch.setattr(FlatState, "undo_copy", lambda self, keys: copies.append(keys))
    dests = [two_rank_state(r, seed=11) for r in range(2)]
    before = [d["w"].tensor.clone() for d in dests]
    _, errs = run_ranks(2, lambda t: load_with(t, dests[t.rank], url), timeout_s=120)
    assert all(isinstance(e, CheckpointDamagedError) and damaged.rsplit("/", 1)[-1] in str(e) for e in errs), errs
    assert [torch.equal(b, d["w"].tensor) for b, d in zip(before, dests)] == [True, True]
    assert [d["seed"] for d in dests] == [11, 11] and copies == []
