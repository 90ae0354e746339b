"""ShardGroup with real actors: N -> M through storage and in memory, over layouts, bit-exact.

One pool of groups (sizes 1-6) serves every test of this module; each test
loads the state it needs with the layout it needs.
"""
from __future__ import annotations

import pytest
import torch

import raydcp
from raydcp.errors import CheckpointError

from ._shards import assert_holds, bump, check_pieces, piece_ptrs, same_bits

pytestmark = pytest.mark.ray

GPU_SHARE = 0.05  # fractional logical GPUs: the whole pool fits on the session's 4


@pytest.fixture(scope="module")
def pool(ray_session):
    groups = {n: raydcp.ShardGroup(n, num_gpus_per_actor=GPU_SHARE, timeout_s=60) for n in (1, 2, 3, 4, 5, 6)}
    yield groups
    for g in groups.values():
        g.shutdown()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, pool, src):
    """Checkpoints saved by a group of N in layout L, made on first use: (N, L) -> path."""
    root = tmp_path_factory.mktemp("saved")
    cache: dict = {}

    def get(n: int, layout: str) -> str:
        if (n, layout) not in cache:
            path = str(root / f"n{n}-{layout}")
            md = pool[n].load(src, layout=layout).save(path)
            assert md.world_size == n
            cache[n, layout] = path
        return cache[n, layout]

    return get


# Every N of {1,2,3,4,6} and every M of {1,2,3,5,6}, every layout on both sides, uneven and
# empty pieces (7 rows over 4-6 ranks, 3 columns over 5); six saves serve eleven loads.
STORAGE_CASES = [
    (1, "dim0", 6, "dim1"),
    (1, "dim0", 5, "dim0"),
    (2, "dim1", 3, "dim0"),
    (2, "dim1", 1, "replicated"),
    (3, "replicated", 5, "dim1"),
    (3, "replicated", 2, "dim0"),
    (4, "dim0", 3, "dim1"),
    (4, "dim0", 6, "dim0"),
    (6, "dim0", 5, "dim0"),
    (6, "dim0", 1, "dim1"),
    (6, "dim1", 2, "replicated"),
]


@pytest.mark.parametrize("n, n_layout, m, m_layout", STORAGE_CASES, ids=[f"{a}{b}-{c}{d}" for a, b, c, d in STORAGE_CASES])
def test_reshard_through_storage(ray_session, pool, saved, full, n, n_layout, m, m_layout):
    path = saved(n, n_layout)
    md = raydcp.read_metadata(path)
    for key, t in md.tensors.items():  # every element stored once: pieces tile, replicas written once
        assert sum(torch.Size(c.sizes).numel() for c in t.chunks) == torch.Size(t.shape).numel(), key
    assert len(md.tensors["model.w"].chunks) == {"replicated": 1, "dim0": min(n, 4), "dim1": min(n, 5)}[n_layout]
    pool[m].load(path, layout=m_layout)
    assert_holds(ray_session, pool[m], full, m_layout)


MEMORY_CASES = [(4, "dim0", 5, "dim1"), (6, "dim1", 2, "replicated")]


@pytest.mark.parametrize("n, n_layout, m, m_layout", MEMORY_CASES, ids=[f"{a}{b}-{c}{d}" for a, b, c, d in MEMORY_CASES])
def test_reshard_in_memory(ray_session, pool, src, full, tmp_path, n, n_layout, m, m_layout):
    pool[n].load(src, layout=n_layout)
    new = pool[n].reshard(m, layout=m_layout)
    try:
        assert (new.world_size, new.layout) == (m, m_layout)
        assert_holds(ray_session, new, full, m_layout)
        got = new.full_state_dict()  # and the new group gathers to the driver
        assert all(same_bits(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v for k, v in full.items())
        assert not (tmp_path / "anything").exists()
    finally:
        new.shutdown()
    assert_holds(ray_session, pool[n], full, n_layout)  # the source group keeps its state


def test_large_chunks_shared_by_ranks_are_read_in_shares(ray_session, pool, tmp_path):
    """Chunks of a few MiB that several ranks need in parts: each rank reads its own rows and the
    straddled checksum blocks are verified from the ranks' shares, through the coordinator."""
    g = torch.Generator().manual_seed(3)
    big = {"big": torch.randint(0, 256, (480 * 4096 * 4,), dtype=torch.uint8, generator=g).view(torch.float32)
           .reshape(480, 4096), "step": 3}
    raydcp.save(big, tmp_path / "one")  # one 7.5 MiB chunk, needed by 4 ranks in rows
    pool[4].load(tmp_path / "one", layout="dim0")
    assert_holds(ray_session, pool[4], big, "dim0")
    pool[4].save(tmp_path / "four")  # four chunks of 1.875 MiB: 4 -> 3 splits two of them
    pool[3].load(tmp_path / "four", layout="dim0")
    assert_holds(ray_session, pool[3], big, "dim0")


def test_full_state_dict(pool, src, full):
    got = pool[4].load(src, layout="dim1").full_state_dict()
    assert set(got) == set(full)
    for k, v in full.items():
        assert same_bits(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k


def test_load_in_place_after_save(ray_session, pool, src, full, tmp_path):
    g = pool[3].load(src, layout="dim0")
    before = ray_session.get([a.apply.remote(piece_ptrs) for a in g.actors])
    ray_session.get([a.apply.remote(bump) for a in g.actors])
    g.save(tmp_path / "bumped")
    g.load(src)  # in place, same layout
    assert_holds(ray_session, g, full, "dim0")
    assert ray_session.get([a.apply.remote(piece_ptrs) for a in g.actors]) == before  # same storage
    g.load(tmp_path / "bumped")
    assert ray_session.get([a.apply.remote(check_pieces, full, "dim0", r, 3) for r, a in enumerate(g.actors)]) != [[]] * 3


def test_devices_and_gpu_placement(ray_session, pool):
    info = pool[2].info
    for r in range(2):
        assert info[r]["device"] == ("cuda:0" if info[r]["cuda_available"] else "cpu")
    g = raydcp.ShardGroup(2)  # num_gpus_per_actor=1: one logical GPU each
    try:
        visible = [g.info[r]["cuda_visible_devices"] for r in range(2)]
        assert all(v is not None and len(v.split(",")) == 1 for v in visible) and len(set(visible)) == 2
    finally:
        g.shutdown()


def test_too_many_gpus_fails_at_once(ray_session):
    with pytest.raises(CheckpointError, match=r"needs 5 GPUs but the Ray cluster has 4"):
        raydcp.ShardGroup(5)


def test_options_checked_at_construction(ray_session):
    for kwargs, match in [
        ({"world_size": 0}, "world_size"),
        ({"world_size": 2, "layout": "rows"}, "unknown layout"),
        ({"world_size": 2, "num_gpus_per_actor": -1}, "num_gpus_per_actor"),
        ({"world_size": 2, "timeout_s": 0}, "timeout_s"),
    ]:
        with pytest.raises(CheckpointError, match=match):
            raydcp.ShardGroup(**kwargs)


def test_operations_need_state(ray_session, pool):
    g = raydcp.ShardGroup(1, num_gpus_per_actor=0)
    try:
        with pytest.raises(CheckpointError, match="holds no state"):
            g.save("/tmp/never-written")
    finally:
        g.shutdown()
    with pytest.raises(CheckpointError, match="shut down"):
        g.full_state_dict()


def test_operations_run_in_the_clusters_one_host_and_leave_no_state_behind(ray_session, tmp_path):
    import raydcp as _raydcp
    from raydcp.runtime import actors

    _raydcp.save({"w": torch.arange(12.0).reshape(6, 2)}, tmp_path / "ck")
    sg = _raydcp.ShardGroup(2, num_gpus_per_actor=0)
    host = ray_session.get_actor(actors.host_name(), namespace=actors.NAMESPACE)
    try:
        sg.load(tmp_path / "ck")
        other = sg.reshard(3)
        other.shutdown()
        names = [a["name"] for a in ray_session.util.list_named_actors(all_namespaces=True)]
        assert not [n for n in names if sg.name in n], names  # no host per group or operation
        assert [n for n in names if n.startswith("raydcp-coordinator-")] == [actors.host_name()]
        state = ray_session.get(host.owner_status.remote(sg.name))  # the operations' records, under the group
        assert state["ops"] == [] and state["records"] >= 1  # the load (reshard plans in the driver, no host)
    finally:
        sg.shutdown()
    ray_session.get(host.ready.remote())  # after the release, sent before it
    assert ray_session.get(host.owner_status.remote(sg.name)) is None

def test_group_deltas_reshard_onto_another_world_size(ray_session, pool, src, full, tmp_path):
    """A ShardGroup's delta saves (base="previous": the ShardGroup is the writer) write what changed
    only, and a delta loads onto another world size in another layout, bit-exact."""
    from raydcp import SaveOptions

    from ._shards import bump_key

    two, three = pool[2], pool[3]
    two.load(src, layout="dim0")
    two.save(str(tmp_path / "step-1"), options=SaveOptions(base="previous"))
    two.apply(bump_key, "model.w")
    md = two.save(str(tmp_path / "step-2"), options=SaveOptions(base="previous"))
    assert set(md.references) == {"../step-1"}
    assert md.owned_bytes == full["model.w"].nbytes  # only the trained tensor was written
    w = full["model.w"].clone()
    w.reshape(-1).view(torch.uint8).add_(1)
    three.load(str(tmp_path / "step-2"), layout="dim1")
    assert_holds(ray_session, three, {**full, "model.w": w}, "dim1")
