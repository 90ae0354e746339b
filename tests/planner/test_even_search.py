"""The load planner's search of even row shards by arithmetic (``even_search``) against its
binary search of the line (``line_search``): the same plans, on shards as ``torch.chunk`` cuts
them (the last shorter, trailing ones empty), on uneven cuts (where it must step aside), and on
requests that start or stop on a shard's edge, inside one, or at the tensor's end."""
from __future__ import annotations

import random

import pytest

import raydcp.planner.load_arrays as load_arrays
from raydcp.metadata import ChunkMeta, Metadata, TensorMeta
from raydcp.metadata_format import decode_metadata, encode_metadata
from raydcp.planner import LocalLoadPlan, ReadItem, TensorSpec, plan_load
from raydcp.planner.load import untiled_sources

from .test_planner_columns import _flatten


def _chunk_rows(n: int, parts: int) -> list[tuple[int, int]]:
    """torch.chunk's row ranges: ceil(n / parts) each, the last shorter, then none."""
    step = -(-n // parts) if n else 1
    return [(lo, min(step, n - lo)) for lo in range(0, n, step)]


def _checkpoint(rng: random.Random, even: bool):
    tensors, chunks = {}, {}
    for t in range(rng.randint(1, 6)):
        shape = (rng.randint(1, 40), rng.randint(1, 4)) if rng.random() < 0.8 else (rng.randint(1, 40),)
        key = f"t{t}"
        tensors[key] = TensorSpec("float32", shape)
        if even:
            rows = _chunk_rows(shape[0], rng.randint(1, 9))
        else:
            cuts = sorted(rng.sample(range(1, shape[0]), min(shape[0] - 1, rng.randint(1, 5)))) if shape[0] > 1 else []
            bounds = [0, *cuts, shape[0]]
            rows = [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(len(bounds) - 1)]
        chunks[key] = tuple(ChunkMeta((lo, *(0 for _ in shape[1:])), (n, *shape[1:]), "f", 0, n * 4 * _rest(shape), 0)
                            for lo, n in rows)
    md = Metadata("s", 1, 0.0, {k: TensorMeta(s.dtype, s.shape, chunks[k]) for k, s in tensors.items()}, {})
    return decode_metadata(encode_metadata(md)), tensors


def _rest(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape[1:]:
        out *= s
    return out


def _loads(rng: random.Random, tensors: dict[str, TensorSpec]) -> list[LocalLoadPlan]:
    ranks = rng.randint(1, 4)
    out = []
    for r in range(ranks):
        items = []
        for k, s in tensors.items():
            n = s.shape[0]
            lo = rng.choice([0, rng.randint(0, n - 1), n - 1])
            hi = rng.choice([n, rng.randint(lo + 1, n)])
            items.append(ReadItem(k, (lo, *(0 for _ in s.shape[1:])), (hi - lo, *s.shape[1:])))
        out.append(LocalLoadPlan(r, tensors, tuple(items), (), strict=False))
    return out


@pytest.mark.parametrize("even", [True, False])
@pytest.mark.parametrize("seed", range(60))
def test_the_arithmetic_search_plans_what_the_binary_search_does(even, seed, monkeypatch):
    rng = random.Random(seed)
    md, tensors = _checkpoint(rng, even)
    loads = _loads(rng, tensors)
    itemsizes = {k: 4 for k in tensors}
    used = []
    search = load_arrays.even_search

    def spy(*args):
        found = search(*args)
        used.append(found is not None)
        return found

    monkeypatch.setattr(load_arrays, "even_search", spy)
    got = plan_load(untiled_sources(md), loads, {}, itemsizes, tiles=md.tensors)
    monkeypatch.setattr(load_arrays, "even_search", lambda *args: None)
    expected = plan_load(untiled_sources(md), loads, {}, itemsizes, tiles=md.tensors)
    assert _flatten(got) == _flatten(expected)
    if even:
        assert used == [True]  # torch.chunk's shards are always even
