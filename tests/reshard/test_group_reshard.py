"""ShardGroup.reshard in memory: the driver's plan from two layouts, and both transports, bit-exact.

The plan (``plan_layout_transfer``) must cover every byte of every new piece exactly once, from
the old rank holding it, and keep in an actor only what that actor already holds. The reshard
itself runs N -> M with odd sizes and several dtypes (bf16 included) through the object store and
through Ray Direct Transport's gloo backend (CPU actors), and every new piece is compared bit for
bit with the source state.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import raydcp
from raydcp.errors import CheckpointError
from raydcp.planner.layouts import piece_box, reuse_ranks
from raydcp.planner.transfer import plan_layout_transfer
from raydcp.state import Shard
from tests.reshard.test_reshard import save_as_ranks
from tests.runtime._shards import check_pieces, same_bits

SHAPES = {
    "w.f32": ((13, 7), torch.float32),
    "w.bf16": ((11, 5), torch.bfloat16),
    "w.f16": ((5, 3, 2), torch.float16),
    "w.f64": ((9,), torch.float64),
    "w.i8": ((7, 3), torch.int8),
    "w.wide": ((3, 1001), torch.float32),
    "w.empty": ((0, 3), torch.float32),
    "s.step": ((), torch.int64),
}


def odd_state(seed: int = 3) -> dict:
    """Tensors of random bit patterns (NaN payloads included: only a bit-exact copy compares equal)."""
    g = torch.Generator().manual_seed(seed)
    out: dict = {}
    for key, (shape, dtype) in SHAPES.items():
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out[key] = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)
    out["w.flags"] = torch.randint(0, 2, (6, 4), generator=g).to(torch.bool)
    out.update({"epoch": 7, "cfg.lr": 0.1, "cfg.names": ["enc", "dec"]})
    return out


def _specs(state: dict) -> dict:
    return {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()
            if isinstance(v, torch.Tensor)}


# ----------------------------------------------------------------------------- the plan (pure)

@pytest.mark.parametrize("old, n, new, m", [
    ("dim0", 4, "dim0", 6), ("dim0", 3, "dim1", 5), ("dim1", 5, "dim0", 2), ("replicated", 2, "dim0", 3),
    ("dim0", 3, "replicated", 4), ("dim0", 1, "dim0", 7), ("dim1", 4, "dim1", 4)])
def test_layout_transfer_covers_every_new_byte_once_from_its_holder(old, n, new, m):
    specs = _specs(odd_state())
    reuse = reuse_ranks(specs, old, n, new, m)
    plan = plan_layout_transfer(specs, old, n, new, m, reuse)
    moves_to = {j: [(reuse[j], mv) for mv in plan.local[j]] + [(i, mv) for i, mvs in plan.incoming(j) for mv in mvs]
                for j in range(m)}
    for key, (shape, _) in specs.items():
        for j in range(m):
            off, size = piece_box(shape, new, j, m) or ((0,) * len(shape), shape)
            hits = np.zeros(size, dtype=np.int64)
            for i, mv in moves_to[j]:
                if mv.key != key:
                    continue
                src_off, src_size = piece_box(shape, old, i, n) or ((0,) * len(shape), shape)
                assert all(so <= o and o + s <= so + ss for o, s, so, ss in zip(mv.offsets, mv.sizes, src_off, src_size))
                hits[tuple(slice(o - b, o - b + s) for o, s, b in zip(mv.offsets, mv.sizes, off))] += 1
            assert (hits == 1).all(), (key, j)
    assert plan.local_bytes + plan.remote_bytes == sum(
        torch.Size(piece_box(s, new, j, m)[1] if piece_box(s, new, j, m) else s).numel()
        * torch.empty((), dtype=getattr(torch, d)).element_size() for s, d in specs.values() for j in range(m))
    assert all(not plan.local[j] for j in range(m) if reuse[j] is None)


def test_layout_transfer_keeps_the_most_bytes_local():
    specs = {f"l{i}": ((2048, 64), "float32") for i in range(4)}
    reuse = reuse_ranks(specs, "dim0", 4, "dim0", 6)
    plan = plan_layout_transfer(specs, "dim0", 4, "dim0", 6, reuse)
    assert plan.local_bytes > 2 * plan.remote_bytes * 0.95  # 4 -> 6 by rows: 2/3 stay in their actor
    assert len(plan.remote) == 5  # one message per pair that exchanges bytes, not per tensor


def test_layout_transfer_refuses_a_bad_reuse_map():
    specs = {"w": ((8, 2), "float32")}
    for reuse in ([0, 0], [0], [5, None]):
        with pytest.raises(CheckpointError, match="reuse"):
            plan_layout_transfer(specs, "dim0", 2, "dim0", 2, reuse)


# ----------------------------------------------------------------------------- on Ray actors

@pytest.fixture(scope="module")
def odd():
    return odd_state()


@pytest.fixture(scope="module")
def odd_src(tmp_path_factory, odd):
    path = str(tmp_path_factory.mktemp("group-reshard") / "src")
    save_as_ranks(odd, path, 3)
    return path


def _holds(ray, group, full: dict, layout: str) -> None:
    problems = ray.get([group.apply_remote(r, check_pieces, full, layout, r, group.world_size)
                        for r in range(group.world_size)])
    assert problems == [[]] * group.world_size


@pytest.mark.parametrize("transport", ["object_store", "rdt"])
def test_reshard_is_bit_exact_n_to_m(ray_session, odd_src, odd, transport):
    g = raydcp.ShardGroup(3, num_gpus_per_actor=0, timeout_s=60).load(odd_src, layout="dim0")
    made = []
    try:
        big = g.prepare_reshard(5, transport=transport).reshard(5, transport=transport)  # 3 -> 5, prepared
        made.append(big)
        _holds(ray_session, big, odd, "dim0")
        assert big.last_transfer["transport"] == ("object_store" if transport == "object_store" else "rdt (gloo)")
        wide = big.reshard(2, layout="dim1", transport=transport)  # 5 -> 2 along another dimension
        made.append(wide)
        _holds(ray_session, wide, odd, "dim1")
        every = wide.reshard(4, layout="replicated", transport=transport)  # 2 -> 4, adding actors
        made.append(every)
        _holds(ray_session, every, odd, "replicated")
        _holds(ray_session, g, odd, "dim0")  # the source group keeps its own state
        got = every.full_state_dict()
        assert all(same_bits(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v for k, v in odd.items())
    finally:
        for x in made:
            x.shutdown()
        g.shutdown()


@pytest.mark.parametrize("transport", ["object_store", "rdt"])
def test_reshard_onto_ranks_with_empty_pieces_still_gives_them_the_values(ray_session, tmp_path, transport):
    tiny = {"a": torch.arange(2, dtype=torch.int32), "b": torch.ones(1, 3, dtype=torch.bfloat16), "step": 4,
            "names": ["x"]}
    save_as_ranks(tiny, str(tmp_path / "tiny"), 1)
    g = raydcp.ShardGroup(1, num_gpus_per_actor=0, timeout_s=60).load(str(tmp_path / "tiny"), layout="dim0")
    try:
        big = g.reshard(4, transport=transport)  # ranks 2 and 3 hold empty pieces: only the values reach them
        _holds(ray_session, big, tiny, "dim0")
        big.shutdown()
    finally:
        g.shutdown()


def _replace_piece(state: dict, key: str) -> None:
    s = state[key]
    state[key] = Shard(s.tensor.to(torch.float64), s.offsets, s.global_shape)


@pytest.mark.parametrize("transport", ["object_store", "rdt"])
def test_reshard_of_a_state_changed_behind_the_group_fails_naming_key_and_rank(ray_session, odd_src, odd, transport):
    g = raydcp.ShardGroup(3, num_gpus_per_actor=0, timeout_s=60).load(odd_src, layout="dim0")
    try:
        ray_session.get(g.apply_remote(1, _replace_piece, "w.f32"))
        with pytest.raises(CheckpointError, match=r"w\.f32: rank 1 of ShardGroup .* holds a float64 piece"):
            g.reshard(2, transport=transport)
        ray_session.get(g.apply_remote(1, _replace_piece_back, "w.f32"))
        ok = g.reshard(2, transport=transport)  # the failure left nothing behind: the next reshard works
        _holds(ray_session, ok, odd, "dim0")
        ok.shutdown()
    finally:
        g.shutdown()


def _replace_piece_back(state: dict, key: str) -> None:
    s = state[key]
    state[key] = Shard(s.tensor.to(torch.float32), s.offsets, s.global_shape)


def test_reshard_refuses_an_unknown_transport(ray_session, odd_src):
    g = raydcp.ShardGroup(2, num_gpus_per_actor=0, timeout_s=60).load(odd_src, layout="dim0")
    try:
        with pytest.raises(CheckpointError, match="object_store, rdt"):
            g.reshard(3, transport="tcp")
        with pytest.raises(CheckpointError, match="object_store, rdt"):
            g.prepare_reshard(3, transport="nccl")
    finally:
        g.shutdown()
