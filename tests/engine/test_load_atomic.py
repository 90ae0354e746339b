"""A load that raises leaves the state dict as it was: tensors, plain values, Stateful objects,
Modules and optimizers, on every rank of a group; ``LoadOptions(atomic=False)`` names what it wrote."""
from __future__ import annotations

import copy
import os

import pytest
import torch

import raydcp
from raydcp import CheckpointError, LoadOptions, Shard
from raydcp.engine.load import load_with, transfer_with
from raydcp.engine.save import save_with
from raydcp.errors import CheckpointDamagedError, StateMismatchError

from .helpers import run_ranks


def flip(path, pos: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x01]))


def last_chunk(md, ck, keys=None):
    """(path, chunk) of the piece stored last: the one a load reads last."""
    chunks = [c for k, t in md.tensors.items() if keys is None or k in keys for c in t.chunks]
    c = max(chunks, key=lambda c: (c.file, c.byte_offset))
    return os.path.join(ck, c.file), c


def snapshot(sd):
    """A deep copy to compare against (tensors cloned, containers copied)."""
    return copy.deepcopy(sd)


def assert_same(before, after, where=""):
    if isinstance(before, torch.Tensor):
        assert isinstance(after, torch.Tensor) and torch.equal(before, after), f"{where} changed"
    elif isinstance(before, Shard):
        assert torch.equal(before.tensor, after.tensor), f"{where} changed"
    elif isinstance(before, dict):
        assert before.keys() == after.keys(), where
        for k in before:
            assert_same(before[k], after[k], f"{where}.{k}")
    elif isinstance(before, (list, tuple)):
        assert type(before) is type(after) and len(before) == len(after), where
        for i, (b, a) in enumerate(zip(before, after)):
            assert_same(b, a, f"{where}.{i}")
    else:
        assert before == after, f"{where}: {before!r} -> {after!r}"


def state(fill: float) -> dict:
    return {
        "layers": {f"w{i}": torch.full((64, 33), fill + i) for i in range(24)},
        "step": int(fill),
        "meta": {"lr": fill / 10, "name": f"run-{fill}", "sizes": [1, 2, int(fill)]},
        "pair": (torch.full((5,), fill), torch.full((3,), -fill)),
        "view": torch.full((33, 64), fill).t(),  # not contiguous: its undo copy is a tensor of its own
    }


@pytest.fixture
def damaged_last(tmp_path):
    """A checkpoint of ``state(1)`` whose last data piece has one flipped byte."""
    ck = str(tmp_path / "ck")
    md = raydcp.save(state(1.0), ck)
    path, chunk = last_chunk(md, ck)
    flip(path, chunk.byte_offset + chunk.nbytes - 1)
    return ck


def test_damaged_last_data_file_leaves_every_tensor_and_value_as_it_was(damaged_last):
    dest = state(5.0)
    before = snapshot(dest)
    pair = dest["pair"]
    with pytest.raises(CheckpointDamagedError, match="checksum mismatch"):
        raydcp.load(dest, damaged_last)
    assert_same(before, dest)
    assert dest["pair"] is pair  # a tuple is rebuilt only when values are set


@pytest.mark.parametrize("io", [raydcp.IOOptions(), raydcp.IOOptions(read_pool_min=1024, read_task_bytes=1 << 20)],
                         ids=["small-batches", "thread-pool"])
def test_every_read_path_is_undone(tmp_path, io):
    """Whole chunks read in batches, in the pool, and parts of chunks (a Shard), all put back."""
    ck = str(tmp_path / "ck")
    src = {"big": torch.arange(300_000, dtype=torch.float32).reshape(3000, 100),
           "small": {f"s{i}": torch.full((10,), float(i)) for i in range(10)}}
    md = raydcp.save(src, ck)
    path, chunk = last_chunk(md, ck)
    flip(path, chunk.byte_offset + chunk.nbytes - 1)
    dest = {"big": torch.zeros(3000, 100), "small": {f"s{i}": torch.full((10,), -1.0) for i in range(10)}}
    before = snapshot(dest)
    with pytest.raises(CheckpointDamagedError):
        raydcp.load(dest, ck, options=LoadOptions(io=io))
    assert_same(before, dest)
    part = {"big": Shard(torch.zeros(1000, 100), (2000, 0), (3000, 100))}  # rows the damage is in
    before = snapshot(part)
    flip(*_piece(ck, md, "big", 2999 * 100 * 4 + 7))
    with pytest.raises(CheckpointDamagedError):
        raydcp.load(part, ck, strict=False, options=LoadOptions(io=io))
    assert_same(before, part)


def _piece(ck, md, key, at):
    c = md.tensors[key].chunks[0]
    return os.path.join(ck, c.file), c.byte_offset + at


def test_opt_out_names_the_keys_already_written(damaged_last):
    dest = state(5.0)
    before = snapshot(dest)
    with pytest.raises(CheckpointDamagedError) as info:
        raydcp.load(dest, damaged_last, options=LoadOptions(atomic=False))
    err = info.value
    changed = {f"layers.{k}" for k, v in dest["layers"].items() if not torch.equal(v, before["layers"][k])}
    changed |= {f"pair.{i}" for i in range(2) if not torch.equal(dest["pair"][i], before["pair"][i])}
    assert changed, "the damaged piece is read last: others were written before it"
    assert changed <= set(err.written_keys) and len(err.written_keys) < 27
    assert "atomic=False" in str(err) and sorted(err.written_keys)[0] in str(err)
    assert dest["step"] == 5 and dest["meta"] == before["meta"]  # plain values are set only at the end


def test_load_options_atomic_is_checked():
    with pytest.raises(CheckpointError, match="LoadOptions.atomic must be True or False"):
        LoadOptions(atomic="no")


class Counter:
    """A Stateful whose state_dict() hands out copies: only load_state_dict changes it."""

    def __init__(self, n: int, fail: bool = False):
        self.n, self.weights, self.fail, self.loads = n, torch.full((4,), float(n)), fail, 0

    def state_dict(self):
        return {"n": self.n, "weights": self.weights.clone()}

    def load_state_dict(self, sd):
        self.loads += 1
        self.n, self.weights = sd["n"], sd["weights"].clone()
        if self.fail and self.loads == 1:
            raise RuntimeError("refusing the loaded state")


def _trained(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(seed):
        model(torch.randn(3, 6)).sum().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def _module_state(model, optim):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(optim.state_dict())


def test_statefuls_modules_and_optimizers_are_given_their_state_back(tmp_path):
    """The last Stateful refuses its state after the Module, the optimizer and another Stateful
    took theirs: every one of them is given its earlier state back."""
    ck = str(tmp_path / "ck")
    model, optim = _trained(3)
    raydcp.save({"model": model, "optim": optim, "a": Counter(1), "z": Counter(2), "step": 3}, ck)
    model2, optim2 = _trained(2)
    before = _module_state(model2, optim2)
    a, z = Counter(10), Counter(20, fail=True)
    dest = {"model": model2, "optim": optim2, "a": a, "z": z, "step": 2}
    with pytest.raises(CheckpointError, match="refusing the loaded state"):
        raydcp.load(dest, ck)
    assert_same(before, _module_state(model2, optim2))
    assert (a.n, z.n, dest["step"]) == (10, 20, 2) and a.loads == 2  # loaded, then given its own back
    assert torch.equal(a.weights, torch.full((4,), 10.0)) and torch.equal(z.weights, torch.full((4,), 20.0))


def test_damage_leaves_modules_and_optimizers_untouched(tmp_path):
    ck = str(tmp_path / "ck")
    model, optim = _trained(3)
    md = raydcp.save({"model": model, "optim": optim}, ck)
    path, chunk = last_chunk(md, ck)
    flip(path, chunk.byte_offset)
    model2, optim2 = _trained(1)
    before = _module_state(model2, optim2)
    with pytest.raises(CheckpointDamagedError):
        raydcp.load({"model": model2, "optim": optim2}, ck)
    assert_same(before, _module_state(model2, optim2))


def test_strict_key_errors_leave_a_fresh_optimizer_fresh(tmp_path):
    ck = str(tmp_path / "ck")
    model, optim = _trained(2)
    raydcp.save({"model": model, "optim": optim}, ck)
    model2, optim2 = _trained(0)  # fresh: no step taken, no state
    before = _module_state(model2, optim2)
    c = Counter(7)
    dest = {"model": model2, "optim": optim2, "extra": torch.ones(3), "c": c}
    with pytest.raises(StateMismatchError, match="extra"):
        raydcp.load(dest, ck)
    assert not optim2.state  # flattening initialised it to be filled; the failed load cleared it again
    assert_same(before, _module_state(model2, optim2))
    assert c.n == 7 and c.loads == 0 and torch.equal(dest["extra"], torch.ones(3))
    raydcp.load({"model": model2, "optim": optim2}, ck)  # and a good load still restores it fully
    assert_same(_module_state(model, optim), _module_state(model2, optim2))


# -- several ranks (threads of this process) ---------------------------------------------------
def _rank_state(rank: int, fill: float) -> dict:
    """Rank ``rank``'s piece of "w" (rows split two ways), its own tensor and a value."""
    rows = torch.full((4, 8), fill + rank)
    return {"w": Shard(rows, (4 * rank, 0), (8, 8)), f"own{rank}": torch.full((100,), fill * 10 + rank),
            "step": int(fill)}


def _group_save(ck):
    _, errs = run_ranks(2, lambda t: save_with(t, _rank_state(t.rank, 1.0), ck))
    assert errs == [None, None]
    return raydcp.read_metadata(ck)


def test_group_load_one_rank_damaged_leaves_every_rank_untouched(tmp_path):
    """Rank 1's data is damaged; rank 0's reads succeed, and rank 0 writes nothing either."""
    ck = str(tmp_path / "ck")
    md = _group_save(ck)
    path, chunk = last_chunk(md, ck, keys={"own1"})
    flip(path, chunk.byte_offset + 3)
    dests = [_rank_state(r, 5.0) for r in range(2)]
    before = [snapshot(d) for d in dests]
    _, errs = run_ranks(2, lambda t: load_with(t, dests[t.rank], ck))
    assert all(isinstance(e, CheckpointError) and "own1: checksum mismatch" in str(e) for e in errs), errs
    for b, d in zip(before, dests):
        assert_same(b, d)
    _, errs = run_ranks(2, lambda t: load_with(t, dests[t.rank], ck, options=LoadOptions(atomic=False)))
    assert "own0" in errs[0].written_keys and "own0" in str(errs[0])  # rank 0 wrote its own, and says so
    assert not torch.equal(dests[0]["own0"], before[0]["own0"])


def test_group_load_a_stateful_failing_on_one_rank_rolls_back_every_rank(tmp_path):
    ck = str(tmp_path / "ck")
    states = [{**_rank_state(r, 1.0), f"c{r}": Counter(r)} for r in range(2)]
    _, errs = run_ranks(2, lambda t: save_with(t, states[t.rank], ck))
    assert errs == [None, None]
    counters = [Counter(50), Counter(51, fail=True)]
    dests = [{**_rank_state(r, 5.0), f"c{r}": counters[r]} for r in range(2)]
    before = [snapshot({k: v for k, v in d.items() if k[0] != "c"}) for d in dests]
    _, errs = run_ranks(2, lambda t: load_with(t, dests[t.rank], ck))
    assert all(isinstance(e, CheckpointError) for e in errs), errs
    assert "rank 1" in str(errs[0]) and "refusing the loaded state" in str(errs[0])
    for b, d in zip(before, dests):
        assert_same(b, {k: v for k, v in d.items() if k[0] != "c"})
    assert [c.n for c in counters] == [50, 51] and counters[0].loads == 2  # rank 0's own had succeeded


def test_transfer_that_fails_leaves_the_destination_as_it_was():
    src = {"w": torch.arange(12.0).reshape(3, 4), "n": 3, "z": Counter(2)}
    z = Counter(9, fail=True)
    dest = {"w": torch.zeros(3, 4), "n": 0, "z": z}
    _, errs = run_ranks(1, lambda t: transfer_with(t, src, dest))
    assert isinstance(errs[0], CheckpointError) and "refusing the loaded state" in str(errs[0])
    assert torch.equal(dest["w"], torch.zeros(3, 4)) and dest["n"] == 0
    assert (z.n, z.loads) == (9, 2) and torch.equal(z.weights, torch.full((4,), 9.0))
