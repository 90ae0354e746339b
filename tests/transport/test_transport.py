"""RayTransport with real actors: each rank is a Ray actor driving its own transport."""
from __future__ import annotations

import dataclasses
import sys
import time
import uuid

import pyarrow as pa
import pytest
import torch

from raydcp.api import prepare_group, resolve_group
from raydcp.errors import CheckpointError
from raydcp.group import Group

from tests.runtime._ranks import RankActor, add_rank_sum, boom, gather_all, shm_mapping

pytestmark = pytest.mark.ray

FAST_TIMEOUT_S = 3.0
ON_LINUX = sys.platform.startswith("linux")  # where /proc/self/maps tells which file backs a buffer


@pytest.fixture(scope="module")
def remote_rank(ray_session):
    return ray_session.remote(num_cpus=0, max_concurrency=2)(RankActor)


@pytest.fixture(scope="module")
def all_actors(ray_session, remote_rank):
    actors = [remote_rank.remote() for _ in range(6)]  # started together: their startup overlaps
    ray_session.get([a.pid.remote() for a in actors])
    return actors


@pytest.fixture(scope="module")
def pool(all_actors):
    """Four rank actors reused by the tests that do not kill them."""
    return all_actors[:4]


@pytest.fixture(scope="module")
def victims(all_actors):
    """Two actors for the tests that kill one: each such test takes one."""
    return list(all_actors[4:])


def uname(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def start(ray, actors, name, timeout_s=30.0, creator=0):
    """Open every rank's transport; ``creator`` opens first, so it creates (owns) the coordinator."""
    n = len(actors)
    coord = ray.get(actors[creator].open.remote(name, creator, n, timeout_s))
    ray.get([a.open.remote(name, r, n, timeout_s) for r, a in enumerate(actors) if r != creator])
    # the coordinator host starts asynchronously; timing tests measure from when it is up
    ray.get(ray.get_actor(coord, namespace="raydcp").status.remote())
    return coord


def run_all(ray, actors, ops_by_rank):
    return ray.get([a.run.remote(ops) for a, ops in zip(actors, ops_by_rank)])


def the_host(ray):
    """The cluster's coordinator host."""
    from raydcp.runtime import actors

    return ray.get_actor(actors.host_name(), namespace=actors.NAMESPACE)


def wait_ended(ray, group_name, op=0, within_s=10.0):
    """True once the host dropped operation ``op`` of the group (every rank closed it)."""
    host = the_host(ray)
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        status = ray.get(host.status.remote((group_name, group_name, op)))
        if status is None or status.get("ended"):
            return True
        time.sleep(0.05)
    return False


def test_reduce_scatter_by_rank_and_operation_ended_after_close(ray_session, pool):
    name = uname("rs")
    coord = start(ray_session, pool, name)
    assert coord.startswith("raydcp-coordinator-")  # the cluster's one host, not one per group
    assert ray_session.get_actor(coord, namespace="raydcp")._actor_id == the_host(ray_session)._actor_id
    ops = [[("rs", "plan", 10 * r, add_rank_sum), ("rs", "commit", r, gather_all), ("close",)] for r in range(4)]
    out = run_all(ray_session, pool, ops)
    for r, res in enumerate(out):
        assert res[0] == ("ok", 10 * r + 60)
        assert res[1] == ("ok", [0, 1, 2, 3])
    assert wait_ended(ray_session, name)


def test_exchange_routes_bit_exact_including_to_self(ray_session, pool):
    name = uname("ex")
    start(ray_session, pool, name)
    gen = torch.Generator().manual_seed(0)

    def payload(src, dest, k):
        size = [0, 1, 1000, 300_000][(src + dest + k) % 4]  # empty, tiny, inline-sized and large
        return bytes(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen).numpy())

    sent = {src: {dest: [(f"{src}->{dest}#{k}", payload(src, dest, k)) for k in range(2)] for dest in range(4) if (src + dest) % 3}
            for src in range(4)}
    ops = [[("ex", "read", sent[r]), ("rs", "done", 0, gather_all), ("close",)] for r in range(4)]
    out = run_all(ray_session, pool, ops)
    for dest, res in enumerate(out):
        status, got = res[0]
        assert status == "ok", res
        expected = [(tag, data) for src in range(4) for tag, data in sent[src].get(dest, [])]
        assert [(tag, data) for tag, data, _ in got] == expected  # source-rank order, bit-exact
        for tag, data, info in got:
            assert info["mutable"] is False or tag.startswith(f"{dest}->")
            if ON_LINUX and len(data) >= 1000 and not tag.startswith(f"{dest}->"):
                # a read-only view of Ray's shared-memory object store, not a private copy
                assert "plasma" in (info["mapping"] or "") or "/dev/shm" in (info["mapping"] or ""), info
    assert any(tag.startswith("0->0") for tag, _, _ in out[0][0][1]) is False  # (0+0)%3 == 0: nothing to self
    assert any(tag.startswith("1->1") for tag, _, _ in out[1][0][1])


def test_get_returns_shared_memory_without_copy(ray_session):
    """What exchange relies on: ray.get of a list of Arrow buffers (one object per destination) maps
    the stored object, no copy."""
    from raydcp.runtime.ray_transport import _as_buffer

    data = torch.arange(1 << 16, dtype=torch.int32).view(torch.uint8)
    ref = ray_session.put([_as_buffer(data), _as_buffer(data[:100])])

    @ray_session.remote(num_cpus=0)
    def fetch_twice(refs):
        (a, a2), (b, _) = ray_session.get(refs[0]), ray_session.get(refs[0])
        return type(a).__name__, a.address == b.address, a.is_mutable, shm_mapping(a.address), bytes(a), bytes(a2)

    kind, same, mutable, mapping, content, second = ray_session.get(fetch_twice.remote([ref]))
    assert kind == "Buffer" and same and not mutable
    assert not ON_LINUX or mapping and ("plasma" in mapping or "/dev/shm" in mapping), mapping
    assert content == bytes(data.numpy()) and second == bytes(data[:100].numpy())


def test_rank_failure_raises_same_error_on_every_rank(ray_session, pool):
    name = uname("fail")
    start(ray_session, pool, name)
    ops = [[("rs", "plan", r, gather_all), ("rs", "write", r, gather_all)] for r in range(4)]
    ops[2][1] = ("fail", "write", "disk full on /ckpt")
    out = run_all(ray_session, pool, ops)
    errs = [res[1] for res in out]
    assert all(e[0] == "err" for e in errs)
    assert len({e[1] for e in errs}) == 1
    assert "rank 2" in errs[0][1] and "disk full on /ckpt" in errs[0][1]
    assert all(e[2] == {2: "disk full on /ckpt"} for e in errs)
    assert wait_ended(ray_session, name)


def test_reduce_fn_that_raises_fails_every_rank(ray_session, pool):
    name = uname("boom")
    start(ray_session, pool, name)
    out = run_all(ray_session, pool, [[("rs", "plan", r, boom)] for r in range(4)])
    assert {res[0][0] for res in out} == {"err"}
    assert all("key 'w' has two shapes" in res[0][1] for res in out)


def test_rank_that_never_arrives_is_named_within_timeout(ray_session, pool):
    name = uname("late")
    actors = pool[:3]
    start(ray_session, actors, name, timeout_s=FAST_TIMEOUT_S)
    t0 = time.monotonic()
    out = ray_session.get([a.run.remote([("rs", "plan", 0, gather_all)]) for a in actors[:2]])
    elapsed = time.monotonic() - t0
    assert elapsed < FAST_TIMEOUT_S + 2
    for res in out:
        status, msg, failures, waited = res[0]
        assert status == "err" and "ranks [2]" in msg and f"'{name}'" in msg and "timeout_s" in msg
        assert failures.keys() == {2}
        assert waited >= FAST_TIMEOUT_S - 0.5
    # every rank that took part closed: the coordinator ends, and the straggler learns at once
    assert wait_ended(ray_session, name)
    late = ray_session.get(actors[2].run.remote([("rs", "plan", 0, gather_all)]))
    assert late[0][0] == "err" and late[0][3] < 1.0 and "already ended the operation" in late[0][1]


@pytest.mark.parametrize("victim", [1, 0], ids=["peer", "creator"])
def test_killed_rank_fails_the_others_within_timeout(ray_session, pool, victims, victim):
    actors = list(pool[:2])
    actors.insert(victim, victims.pop())
    name = uname("kill")
    start(ray_session, actors, name, timeout_s=FAST_TIMEOUT_S, creator=0)
    ops = [[("rs", "plan", r, gather_all), ("rs", "write", r, gather_all)] for r in range(3)]
    ops[victim] = [("rs", "plan", victim, gather_all), ("hang",)]
    refs = [a.run.remote(o) for a, o in zip(actors, ops)]
    survivors = [r for r in range(3) if r != victim]
    # once the victim passed "plan" it hangs, and the others wait for it in "write"
    assert ray_session.get(actors[victim].wait_hanging.remote(30.0))
    ray_session.kill(actors[victim])
    t0 = time.monotonic()
    out = ray_session.get([refs[r] for r in survivors], timeout=FAST_TIMEOUT_S + 10)
    assert time.monotonic() - t0 < FAST_TIMEOUT_S + 2
    for res in out:
        assert res[0][0] == "ok"
        status, msg, failures = res[1][:3]
        assert status == "err" and f"rank {victim}" in msg.replace("ranks [", "rank ").replace("]", ""), msg
        assert victim in failures


def test_two_groups_run_concurrently(ray_session, pool):
    a_name, b_name = uname("ga"), uname("gb")
    start(ray_session, pool[:2], a_name)
    start(ray_session, pool[2:], b_name)
    ops = [[("rs", "plan", r, add_rank_sum), ("ex", "read", {1 - r: [(f"x{r}", bytes([r]) * 5)]}), ("rs", "done", 0, gather_all), ("close",)]
           for r in range(2)]
    out = ray_session.get([a.run.remote(o) for a, o in zip(pool, ops + ops)])
    for i, res in enumerate(out):
        r = i % 2
        assert res[0] == ("ok", r + 1)  # each group sums only its own ranks
        assert [(t, d) for t, d, _ in res[1][1]] == [(f"x{1 - r}", bytes([1 - r]) * 5)]
    assert wait_ended(ray_session, a_name) and wait_ended(ray_session, b_name)


def test_operations_of_groups_share_one_host_with_fresh_coordinators(ray_session, pool):
    actors = pool[:2]
    hosts = set()
    for name in (uname("ops"), uname("ops")):
        for op in range(3):
            coord = ray_session.get([a.open.remote(name, r, 2, 30.0) for r, a in enumerate(actors)])
            hosts.add(coord[0])
            hosts.add(ray_session.get_actor(coord[0], namespace="raydcp")._actor_id)
            out = run_all(ray_session, actors, [[("rs", "s", r + op, gather_all), ("close",)] for r in range(2)])
            assert out[0][0] == ("ok", [op, op + 1])
            assert wait_ended(ray_session, name, op)
    assert len(hosts) == 2  # one name and one actor for every operation of every group: no actor start


def test_group_counts_operations(ray_session):
    g = Group(uname("count"), 0, 1)
    t0, t1 = resolve_group(g).open_transport(), resolve_group(g).open_transport()
    assert (t0.op, t1.op) == (0, 1)
    # the numbering is the runtime's, per process and by name and rank: an equal Group value continues it
    t2 = resolve_group(Group(g.name, 0, 1)).open_transport()
    assert t2.op == 2
    t2.close()
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.rank = 1  # a Group is a plain immutable value
    # one rank: no coordinator actor, everything in-process
    assert t0.reduce_scatter("s", 3, add_rank_sum) == 6
    got = t0.exchange("x", {0: [("a", torch.tensor([1, 2], dtype=torch.uint8))]})
    assert [(tag, bytes(b)) for tag, b in got] == [("a", b"\x01\x02")] and isinstance(got[0][1], pa.Buffer)
    with pytest.raises(CheckpointError, match="destination ranks"):
        t0.exchange("x", {1: []})
    t0.close()
    with pytest.raises(CheckpointError, match="closed"):
        t0.reduce_scatter("s", 3, add_rank_sum)
    t1.close()


def test_driver_ranks_in_threads(ray_session):
    """Ranks need not be actors: here three threads of the driver, with an unpicklable value on one."""
    import threading

    name = uname("threads")
    groups = [Group(name, r, 3, timeout_s=FAST_TIMEOUT_S) for r in range(3)]
    transports = [None] * 3
    results = [None] * 3

    def rank(r):
        t = transports[r] = resolve_group(groups[r]).open_transport()
        try:
            first = t.reduce_scatter("plan", r, add_rank_sum)
            value = threading.Lock() if r == 1 else r  # cannot be pickled
            results[r] = (first, t.reduce_scatter("write", value, gather_all))
        except CheckpointError as exc:
            results[r] = (first, exc)
        finally:
            t.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(FAST_TIMEOUT_S + 10)
    assert [res[0] for res in results] == [3, 4, 5]
    for _, err in results:
        assert isinstance(err, CheckpointError) and "rank 1" in str(err) and "could not send" in str(err)


def test_prepare_starts_the_host_that_the_first_operation_then_uses(ray_session):
    import threading

    from raydcp.runtime import actors

    name = uname("prepare")
    groups = [Group(name, r, 2, timeout_s=30.0) for r in range(2)]
    prepare_group(Group(uname("solo"), 0, 1))  # one rank: nothing to start, nothing raised
    prepare_group(groups[0])
    host = the_host(ray_session)  # exists right after the call
    assert ray_session.get(host.ready.remote()) is True
    results = [None] * 2

    def rank(r):
        t = resolve_group(groups[r]).open_transport()
        results[r] = t.reduce_scatter("s", r + 1, gather_all)
        t.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert results == [[1, 2], [1, 2]]
    assert actors.coordinator_host()._actor_id == host._actor_id  # the prepared host ran the operation


def test_thread_transport_second_caller_for_a_rank_fails_every_rank():
    import threading

    from raydcp.transport import ThreadTransport

    x0, y1 = ThreadTransport.group(2, timeout_s=10)
    y0 = ThreadTransport(x0._hub, 0)  # a second caller for rank 0 on the same group
    out: dict[str, object] = {}

    def call(name, t, value, seq_steps):
        try:
            for step in seq_steps:
                out[name] = t.reduce_scatter(step, value, gather_all)
        except CheckpointError as exc:
            out[name] = exc

    # X0 and Y1 complete the plan step together; Y0 then arrives at the same call
    a = threading.Thread(target=call, args=("x0", x0, "x0", ["plan"]))
    b = threading.Thread(target=call, args=("y1", y1, "y1", ["plan"]))
    a.start(), b.start(), a.join(), b.join()
    assert out["x0"] == out["y1"] == ["x0", "y1"]
    call("y0", y0, "y0", ["plan"])
    assert isinstance(out["y0"], CheckpointError) and "arrived twice" in str(out["y0"])
    # the first callers' next step fails on every rank instead of committing a mix
    a = threading.Thread(target=call, args=("x0", x0, "x0", ["commit"]))
    b = threading.Thread(target=call, args=("y1", y1, "y1", ["commit"]))
    a.start(), b.start(), a.join(), b.join()
    assert all(isinstance(out[k], CheckpointError) and "arrived twice" in str(out[k]) for k in ("x0", "y1"))


def test_ranks_of_one_save_naming_different_checkpoints_fail_together(tmp_path):
    import threading

    from raydcp.engine.save import save_with
    from raydcp.transport import ThreadTransport

    transports = ThreadTransport.group(2, timeout_s=30)
    errors: list = [None, None]

    def rank(r):
        try:
            save_with(transports[r], {"w": torch.full((2,), float(r))}, str(tmp_path / f"ck{r}"))
        except CheckpointError as exc:
            errors[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(e is not None and "name different checkpoints" in str(e) for e in errors)
    assert not any((tmp_path / f"ck{r}").exists() and any((tmp_path / f"ck{r}").rglob("*.bin")) for r in range(2))
