"""The cluster's one coordinator host, with Ray: many groups at once, a stalled group beside a
working one, and the host killed during an operation. Ranks are threads of the driver (each a
``raydcp.save`` or a transport of its own), so many ranks cost no actor start."""
from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

import raydcp
from raydcp.api import resolve_group
from raydcp.errors import CoordinatorLostError
from raydcp.runtime import actors

from ._ranks import gather_all

pytestmark = pytest.mark.ray


def uname(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def pair(name: str, timeout_s: float = 120.0) -> list:
    """Ranks 0 and 1 of a group of two named ``name``."""
    return [raydcp.Group(name, r, 2, timeout_s=timeout_s) for r in range(2)]


def the_host(ray):
    return ray.get_actor(actors.host_name(), namespace=actors.NAMESPACE)


def state_of(group: str, rank: int) -> dict:
    """Rank ``rank``'s half of a group's tensor, with values that differ by group."""
    seed = sum(group.encode()) % 97
    full = torch.arange(16.0).reshape(8, 2) + seed
    return {"w": raydcp.Shard(full[4 * rank:4 * rank + 4].clone(), (4 * rank, 0), (8, 2)),
            "step": seed}


def run_threads(targets: list, within_s: float = 120.0) -> list:
    """Run every callable in a thread of its own; their results (or the exceptions they raised)."""
    out: list = [None] * len(targets)

    def call(i, fn):
        try:
            out[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            out[i] = exc

    threads = [threading.Thread(target=call, args=(i, fn)) for i, fn in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(within_s)
    assert not any(t.is_alive() for t in threads), "a rank hangs"
    return out


def save_fn(group: raydcp.Group, path: str):
    return lambda: raydcp.save(state_of(group.name, group.rank), path, group=group)


def check_saved(path: str, group_name: str) -> None:
    got = {"w": torch.zeros(8, 2), "step": None}
    raydcp.load(got, path)
    seed = sum(group_name.encode()) % 97
    assert torch.equal(got["w"], torch.arange(16.0).reshape(8, 2) + seed) and got["step"] == seed


class _Async:
    """``fn()`` in a thread of its own, with a result to wait for."""

    def __init__(self, fn):
        self._result = None
        self._done = threading.Event()

        def run():
            try:
                self._result = fn()
            except BaseException as exc:  # noqa: BLE001 - reported to the test
                self._result = exc
            self._done.set()

        threading.Thread(target=run, daemon=True).start()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float):
        assert self._done.wait(timeout), "still running"
        return self._result


def wait_for(cond, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def waiting_in(ray, group: str, op: int = 0):
    """Whether a round of the group's operation ``op`` is open in the host (a rank waits there)."""
    def check():
        st = ray.get(the_host(ray).status.remote((group, group, op)))
        return st is not None and bool(st.get("open_rounds"))
    return check


def test_eight_groups_of_two_ranks_save_at_once_through_one_host(ray_session, tmp_path):
    groups = [pair(uname(f"many{i}")) for i in range(8)]
    paths = [str(tmp_path / f"ck{i}") for i in range(8)]
    out = run_threads([save_fn(g, paths[i]) for i, ranks in enumerate(groups) for g in ranks])
    assert all(isinstance(md, raydcp.Metadata) for md in out), out
    for i, ranks in enumerate(groups):
        check_saved(paths[i], ranks[0].name)
    host = the_host(ray_session)
    names = [a["name"] for a in ray_session.util.list_named_actors(all_namespaces=True)]
    assert [n for n in names if n.startswith("raydcp-coordinator-")] == [actors.host_name()]  # one host for all
    mine = {p[0].name for p in groups}

    def every_coordinator_dropped() -> bool:
        # a rank's close is sent without waiting for its answer, so the host may drop the
        # operation just after the save returned: wait for it, within a bound
        running = ray_session.get(host.status.remote())["ops"]
        return not [op for op in running if op[0] in mine]

    wait_for(every_coordinator_dropped, within_s=30)
    for ranks in groups:
        assert ray_session.get(host.owner_status.remote(ranks[0].name))["ops"] == []


def test_a_stalled_group_does_not_hold_up_another_groups_save(ray_session, tmp_path):
    stalled, other = pair(uname("stalled")), pair(uname("other"))
    first = _Async(save_fn(stalled[0], str(tmp_path / "stalled")))
    wait_for(waiting_in(ray_session, stalled[0].name))  # rank 0 waits for rank 1, which does not come
    out = run_threads([save_fn(g, str(tmp_path / "other")) for g in other], within_s=60)
    assert all(isinstance(md, raydcp.Metadata) for md in out), out
    check_saved(str(tmp_path / "other"), other[0].name)
    assert not first.done()  # still waiting: the other group went past it
    assert isinstance(run_threads([save_fn(stalled[1], str(tmp_path / "stalled"))])[0], raydcp.Metadata)
    assert isinstance(first.result(60), raydcp.Metadata)
    check_saved(str(tmp_path / "stalled"), stalled[0].name)


def kill_host(ray) -> str:
    """Kill the cluster's host (as a lost node or an operator would) and wait until it is dead."""
    host = the_host(ray)
    ray.kill(host)
    wait_for(lambda: _dead(ray, host))
    return host._actor_id.hex()


def _dead(ray, handle) -> bool:
    try:
        ray.get(handle.ready.remote(), timeout=10)
    except ray.exceptions.RayActorError:
        return True
    return False


def test_host_killed_during_an_operation_fails_it_on_every_rank_and_the_next_one_works(ray_session, tmp_path):
    name = uname("killed")
    groups = pair(name)
    transports = [resolve_group(g).open_transport() for g in groups]
    assert run_threads([lambda r=r: transports[r].reduce_scatter("plan", r, gather_all) for r in range(2)]) \
        == [[0, 1], [0, 1]]
    # rank 0 enters the next step and waits there for rank 1, which is still busy (say, writing)
    in_flight = _Async(lambda: transports[0].reduce_scatter("commit", 0, gather_all))
    wait_for(waiting_in(ray_session, name))
    t0 = time.monotonic()
    old = kill_host(ray_session)
    err0 = in_flight.result(30)
    assert isinstance(err0, CoordinatorLostError), err0
    assert "died" in str(err0) and f"'{name}'" in str(err0) and "operation 0" in str(err0)
    # rank 1 comes to the step afterwards: it fails at once too, instead of waiting for rank 0
    with pytest.raises(CoordinatorLostError, match="died"):
        transports[1].reduce_scatter("commit", 1, gather_all)
    assert time.monotonic() - t0 < groups[0].timeout_s  # within the timeout, on every rank
    for t in transports:
        t.close()
    # the group's next operation starts a new host and works
    out = run_threads([save_fn(g, str(tmp_path / "after")) for g in groups])
    assert all(isinstance(md, raydcp.Metadata) for md in out), out
    check_saved(str(tmp_path / "after"), name)
    assert the_host(ray_session)._actor_id.hex() != old


def test_host_killed_between_operations_the_next_one_works_with_a_stale_handle(ray_session, tmp_path):
    groups = pair(uname("between"))
    assert all(isinstance(md, raydcp.Metadata) for md in run_threads([save_fn(g, str(tmp_path / "a"))
                                                                      for g in groups]))
    stale = actors.coordinator_host()
    old = kill_host(ray_session)
    assert actors.coordinator_host() is stale  # this process still holds the dead host's handle
    # the ranks' first call finds it dead: they retry it on a new host, where the operation runs
    out = run_threads([save_fn(g, str(tmp_path / "b")) for g in groups])
    assert all(isinstance(md, raydcp.Metadata) for md in out), out
    check_saved(str(tmp_path / "b"), groups[0].name)
    assert actors.coordinator_host()._actor_id.hex() == the_host(ray_session)._actor_id.hex() != old


class _OldHost:
    """Stands for a coordinator host that another version of raydcp's code started."""

    def ready(self) -> bool:
        return True


def test_stop_hosts_stops_this_versions_host_then_every_version_and_the_next_save_starts_one(ray_session, tmp_path):
    ray = ray_session
    old_name = "raydcp-coordinator-0ld0ld0ld0"
    old = ray.remote(_OldHost).options(name=old_name, namespace=actors.NAMESPACE, lifetime="detached",
                                        num_cpus=0).remote()
    assert ray.get(old.ready.remote(), timeout=120)
    first = pair(uname("stop1"))
    assert all(isinstance(md, raydcp.Metadata) for md in run_threads([save_fn(g, str(tmp_path / "a")) for g in first]))

    def hosts() -> set:
        return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a.get("namespace") == actors.NAMESPACE and a["name"].startswith("raydcp-coordinator-")}

    assert hosts() == {actors.host_name(), old_name}
    assert actors.stop_hosts() == [actors.host_name()]
    wait_for(lambda: hosts() == {old_name})  # this version's host is gone, the other version's is not
    again = pair(uname("stop2"))  # the next save starts a new host
    assert all(isinstance(md, raydcp.Metadata) for md in run_threads([save_fn(g, str(tmp_path / "b")) for g in again]))
    check_saved(str(tmp_path / "b"), again[0].name)
    assert hosts() == {actors.host_name(), old_name}
    assert sorted(actors.stop_hosts(every_version=True)) == sorted([actors.host_name(), old_name])
    wait_for(lambda: not hosts())
    assert actors.stop_hosts(every_version=True) == []  # nothing left to stop
