"""Single-participant and threaded multi-rank save/load through real storage backends."""
from __future__ import annotations

import pytest
import torch

import raydcp
from raydcp import CheckpointError, Shard
from raydcp.codec import DTYPES, tensor_bytes
from raydcp.engine.load import load_with
from raydcp.engine.save import save_with
from tests.planner.layouts import blocks, chunk_bounds, cols, piece, replicated, rows

from .helpers import run_ranks


def every_dtype_state():
    g = torch.Generator().manual_seed(0)
    sd = {"dtypes": {}}
    for name, dt in DTYPES.items():
        raw = torch.randint(0, 256, (2, 3, 4), dtype=torch.uint8, generator=g)
        if dt == torch.bool:
            raw = raw % 2
        sd["dtypes"][name] = raw.view(dt) if raw.element_size() == dt.itemsize else \
            torch.randint(0, 256, (2, 3, 4 * dt.itemsize), dtype=torch.uint8, generator=g).view(dt)
    sd["special"] = {
        "noncontig": torch.arange(20.0).reshape(4, 5).t(),
        "empty": torch.empty(0, 7),
        "zero_d": torch.tensor(2.5, dtype=torch.float64),
        "int64": torch.tensor([torch.iinfo(torch.int64).min, -1, torch.iinfo(torch.int64).max]),
    }
    sd["plain"] = {"step": 11, "lr": 3e-4, "name": "run", "blob": b"\x00\x01", "nested": [1, (2, None)]}
    return sd


def zeros_like_state(sd):
    if isinstance(sd, dict):
        return {k: zeros_like_state(v) for k, v in sd.items()}
    if isinstance(sd, torch.Tensor):
        return torch.zeros(sd.shape, dtype=torch.uint8).view(sd.dtype) if sd.element_size() == 1 else \
            torch.zeros(sd.shape[:-1] + (sd.shape[-1] * sd.element_size(),) if sd.dim() else (sd.element_size(),),
                        dtype=torch.uint8).view(sd.dtype).reshape(sd.shape)
    return None


def assert_bit_equal(a, b, path=""):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_bit_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(tensor_bytes(a), tensor_bytes(b)), path
    else:
        assert a == b and type(a) is type(b), path


def test_every_dtype_and_shape_round_trips_on_every_backend(storage_backend):
    url, opts = storage_backend
    sd = every_dtype_state()
    md = raydcp.save(sd, url, storage_options=opts)
    assert md.world_size == 1 and "dtypes.bfloat16" in md.tensors
    target = zeros_like_state(sd)
    ptrs = {k: v.data_ptr() for k, v in target["dtypes"].items()}
    stats = raydcp.load(target, url, storage_options=opts)
    assert_bit_equal(sd, target)
    assert {k: v.data_ptr() for k, v in target["dtypes"].items()} == ptrs  # filled in place
    assert stats.bytes_read == stats.bytes_needed
    assert raydcp.read_metadata(url, storage_options=opts).tensors.keys() == md.tensors.keys()


def test_model_and_optimizer_round_trip(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    raydcp.save({"model": model, "optim": opt}, tmp_path / "ck")
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1.0)
    model2(torch.randn(3, 4)).sum().backward()
    opt2.step()  # materialise optimizer state so there is something to fill
    raydcp.load({"model": model2, "optim": opt2}, tmp_path / "ck")
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    assert opt2.param_groups[0]["lr"] == 1e-2
    for s, s2 in zip(opt.state.values(), opt2.state.values()):
        assert torch.equal(s["exp_avg"], s2["exp_avg"]) and torch.equal(s["step"], s2["step"])


def layout_state(world, rank, layout, shapes, fill=True):
    sd = {}
    for key, shape in shapes.items():
        full = torch.arange(float(torch.tensor(shape).prod())).reshape(shape) * (1 + len(key))
        lay = layout if len(shape) >= 2 or layout in (rows, replicated) else replicated
        off, size = lay(shape, world, rank)
        local = piece(full, off, size).clone() if fill else torch.full(size, -1.0)
        sd[key] = Shard(local, off, shape) if lay is not replicated else local
    return sd


SHAPES = {"w": (9, 6), "v": (7,), "m": (4, 5, 3)}


@pytest.mark.parametrize("n,save_layout,m,load_layout", [
    (4, rows, 3, rows), (3, rows, 5, cols), (4, blocks((2, 2)), 2, rows), (2, replicated, 3, rows), (3, cols, 1, replicated),
])
def test_threaded_ranks_n_to_m_bit_exact(tmp_path, n, save_layout, m, load_layout):
    ck = str(tmp_path / "ck")
    _, errs = run_ranks(n, lambda tp: save_with(tp, {**layout_state(n, tp.rank, save_layout, SHAPES), "step": 5}, ck))
    assert errs == [None] * n
    md = raydcp.read_metadata(ck)
    assert md.world_size == n and md.values == {"step": 5}

    def load(tp):
        sd = {**layout_state(m, tp.rank, load_layout, SHAPES, fill=False), "step": 0}
        stats = load_with(tp, sd, ck)
        return sd, stats

    out, errs = run_ranks(m, load)
    assert errs == [None] * m
    for r, (sd, _) in enumerate(out):
        want = layout_state(m, r, load_layout, SHAPES)
        for key in SHAPES:
            got = sd[key].tensor if isinstance(sd[key], Shard) else sd[key]
            exp = want[key].tensor if isinstance(want[key], Shard) else want[key]
            assert torch.equal(got, exp), (r, key)
        assert sd["step"] == 5
    read = sum(s.bytes_read for _, s in out)
    assert read <= md.total_bytes  # every stored byte read at most once across ranks


def test_rank_failure_fails_every_rank_and_commits_nothing(tmp_path):
    ck = str(tmp_path / "ck")
    raydcp.save({"w": torch.ones(4)}, ck)

    def save(tp):
        bad = {"w": torch.full((4,), 2.0), "x": {1, 2}} if tp.rank == 1 else {"w": torch.full((4,), 2.0)}
        return save_with(tp, bad, ck)

    _, errs = run_ranks(3, save)
    assert all(isinstance(e, CheckpointError) and "rank 1" in str(e) and "x: cannot checkpoint" in str(e) for e in errs)
    target = {"w": torch.zeros(4)}
    raydcp.load(target, ck)
    assert torch.equal(target["w"], torch.ones(4))  # the previous checkpoint is intact


def test_diverging_replicas_are_named(tmp_path):
    _, errs = run_ranks(2, lambda tp: save_with(tp, {"w": torch.full((3,), float(tp.rank))}, str(tmp_path / "ck")))
    assert all(isinstance(e, CheckpointError) and "w: replicas on ranks [0, 1] differ" in str(e) for e in errs)


def test_missing_rank_times_out_naming_it(tmp_path):
    def save(tp):
        if tp.rank == 2:
            return None
        return save_with(tp, {"w": Shard(torch.ones(1), (tp.rank,), (3,))}, str(tmp_path / "ck"))

    _, errs = run_ranks(3, save, timeout_s=1.0)
    assert errs[2] is None
    assert all(isinstance(e, CheckpointError) and "ranks [2] did not arrive" in str(e) for e in errs[:2])


def test_strict_load_names_missing_and_unexpected_keys_on_every_rank(tmp_path):
    ck = str(tmp_path / "ck")
    raydcp.save({"a": torch.ones(2), "b": torch.ones(2), "n": 1}, ck)

    def load(tp):
        return load_with(tp, {"a": torch.zeros(2), "c": torch.zeros(2), "n": 0}, ck)

    _, errs = run_ranks(2, load)
    for e in errs:
        assert isinstance(e, CheckpointError)
        assert "missing from the checkpoint (1): c" in str(e) and "not in the state dict (1): b" in str(e)
    sd = {"a": torch.zeros(2), "c": torch.zeros(2)}
    raydcp.load(sd, ck, strict=False)
    assert torch.equal(sd["a"], torch.ones(2)) and torch.equal(sd["c"], torch.zeros(2))


def test_shape_and_dtype_mismatch_are_named(tmp_path):
    ck = tmp_path / "ck"
    raydcp.save({"a": torch.ones(2), "b": torch.ones(2)}, ck)
    with pytest.raises(CheckpointError, match=r"a: checkpoint has shape \[2\], rank 0 wants \[3\][\s\S]*b: checkpoint has dtype float32"):
        raydcp.load({"a": torch.zeros(3), "b": torch.zeros(2, dtype=torch.float16)}, ck)


def test_chunk_bounds_matches_torch_chunk():
    for n in range(0, 12):
        for parts in range(1, 6):
            pieces = torch.arange(n).chunk(parts)
            for i in range(parts):
                lo, size = chunk_bounds(n, parts, i)
                want = pieces[i] if i < len(pieces) else torch.arange(0)
                assert size == len(want) and (size == 0 or lo == int(want[0]))


def test_thread_transport_fails_every_rank_on_a_bad_destination():
    def go(tp):
        return tp.exchange("x", {5: [("t", torch.zeros(1, dtype=torch.uint8))]} if tp.rank == 0 else {})

    _, errs = run_ranks(3, go, timeout_s=5.0)
    assert all(isinstance(e, CheckpointError) and "rank 0 addressed rank 5" in str(e) for e in errs)
