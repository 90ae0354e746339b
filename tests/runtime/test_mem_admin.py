"""Operating the memory tier (raydcp.memory: what `raydcp mem ls|rm|usage|stop` runs) on the session's Ray.

Listing by NAME with step, size and commit time; removal of a checkpoint, a NAME, and of the room
reserved by saves under it, refusing what matches nothing or would damage a committed
checkpoint; bytes held and reserved per node; stopping the holders and the coordinator hosts,
refused while checkpoints are held, after which the next raymem:// operation starts new holders.
"""
from __future__ import annotations

import uuid

import fsspec
import pytest
import torch

import raydcp
import raydcp.memory as mem
from raydcp.errors import CheckpointNotFoundError
from raydcp.runtime import actors
from raydcp.runtime.memstore import placement


def _node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _state(step: int) -> dict:
    return {"w": torch.arange(256, dtype=torch.float32) + step, "step": step}


def _save(url: str, step: int) -> None:
    raydcp.save(_state(step), url, storage_options={"keep_last": 0})


def _loads(url: str, step: int) -> bool:
    got = {"w": torch.zeros(256), "step": -1}
    raydcp.load(got, url)
    return got["step"] == step and torch.equal(got["w"], _state(step)["w"])


def _mine(name: str) -> list:
    return [c for c in mem.checkpoints(name) if c.name == name]


@pytest.fixture
def name(ray_session):
    name = f"adm-{uuid.uuid4().hex[:8]}"
    yield name
    fsspec.filesystem("raymem").rm(name, recursive=True)


def test_checkpoints_lists_each_checkpoint_of_a_name_with_step_size_and_commit_time(name):
    _save(f"raymem://{name}/a", 7)
    _save(f"raymem://{name}/run/step-20", 20)
    raydcp.save({"w": torch.ones(4), "train": {"progress": {"step": 40}}}, f"raymem://{name}/run/step-99",
                storage_options={"keep_last": 0})  # a TrainState's step, not the digits of the name
    raydcp.save({"w": torch.ones(4)}, f"raymem://{name}/run/step-30", storage_options={"keep_last": 0})
    stray = f"{name}/crashed/data/g0-0123456789ab/r00000-f000.bin"  # a save that never committed
    fsspec.filesystem("raymem").pipe_file(stray, b"x" * 100)
    rows = _mine(name)
    assert [r.url for r in rows] == [f"raymem://{name}/a", f"raymem://{name}/run/step-20",
                                     f"raymem://{name}/run/step-99", f"raymem://{name}/run/step-30",
                                     f"raymem://{name}/crashed"]  # committed ones oldest first, then the others
    a, b, train, unknown, crashed = rows
    assert (a.step, b.step, train.step, unknown.step) == (7, 20, 40, None)  # what was saved, never a name's digits
    assert a.committed_at is not None and b.committed_at is not None and a.committed_at <= b.committed_at
    assert a.world_size == 1 and a.error is None
    files = fsspec.filesystem("raymem").find(f"{name}/a", detail=True)
    assert a.files == len(files) and a.bytes == sum(i["size"] for i in files.values())
    assert a.bytes > 256 * 4 and a.held_bytes == a.bytes and a.nodes == (_node(),)  # one node: one copy
    assert crashed.committed_at is None and crashed.files == 1 and crashed.bytes == 100 and crashed.step is None
    assert [r.url for r in mem.checkpoints(f"raymem://{name}/run")] == [f"raymem://{name}/run/step-{n}"
                                                                        for n in (20, 99, 30)]
    assert mem.checkpoints(f"{name}-none") == []


def test_remove_a_checkpoint_then_a_whole_name_and_refuse_what_matches_nothing(name):
    _save(f"raymem://{name}/a", 1)
    _save(f"raymem://{name}/b", 2)
    before = fsspec.filesystem("raymem").find(f"{name}/a", detail=True)
    gone = mem.remove(f"raymem://{name}/a")
    assert gone.checkpoints == [f"raymem://{name}/a"]
    assert gone.files == len(before) and gone.bytes == sum(i["size"] for i in before.values())
    assert [r.url for r in _mine(name)] == [f"raymem://{name}/b"]
    assert _loads(f"raymem://{name}/b", 2)  # the other checkpoint is untouched
    with pytest.raises(CheckpointNotFoundError, match=f"raymem://{name}/a: nothing is held there.*mem ls"):
        mem.remove(f"raymem://{name}/a")
    with pytest.raises(CheckpointNotFoundError, match=f"raymem://{name}/b2: nothing is held"):
        mem.remove(f"raymem://{name}/b2")  # a prefix of no path: not b's files
    with pytest.raises(raydcp.CheckpointError, match="not a memory-tier URL"):
        mem.remove(f"/tmp/{name}")
    with pytest.raises(raydcp.CheckpointError, match="name what to remove"):
        mem.remove("raymem://")
    gone = mem.remove(f"raymem://{name}")
    assert gone.checkpoints == [f"raymem://{name}/b"] and _mine(name) == []
    assert fsspec.filesystem("raymem").find(name) == []


def test_remove_refuses_a_part_of_a_committed_checkpoint(name):
    _save(f"raymem://{name}/a", 3)
    data = next(p for p in fsspec.filesystem("raymem").find(f"{name}/a") if "/data/" in p)
    with pytest.raises(mem.MemoryInUseError, match=f"part of the committed checkpoint raymem://{name}/a") as info:
        mem.remove(f"raymem://{data}")
    assert info.value.held == [f"raymem://{name}/a"]
    assert _loads(f"raymem://{name}/a", 3)  # nothing was removed


def test_remove_releases_the_room_reserved_by_saves_under_it_and_usage_shows_it(name):
    fs = fsspec.filesystem("raymem")
    _save(f"raymem://{name}/a", 4)
    h = placement.holder(_node())
    h_usage = {r.node: r for r in mem.usage()}[_node()]
    assert h_usage.state == "running" and h_usage.object_store_bytes > 0
    held_here = sum(i["size"] for i in fs.find("", detail=True).values() if _node() in i["held_on"])
    assert h_usage.held == held_here and h_usage.files == len(fs.find(""))
    # a save in flight under the NAME whose processes died: its room stays reserved
    import ray

    assert ray.get(h.reserve_save.remote(f"{name}/dead/data/g0-0123456789ab", 5000, None, 1)) is None
    assert {r.node: r for r in mem.usage()}[_node()].reserved == h_usage.reserved + 5000
    gone = mem.remove(f"raymem://{name}/dead")  # no file there, but a reservation
    assert gone.files == 0 and gone.reservations == 1
    assert {r.node: r for r in mem.usage()}[_node()].reserved == h_usage.reserved
    assert _loads(f"raymem://{name}/a", 4)


def test_stop_refuses_while_checkpoints_are_held_then_stops_and_the_next_save_starts_new_holders(name):
    import ray

    _save(f"raymem://{name}/a", 5)
    first = placement.holder(_node())
    ray.get(first.ping.remote())
    first_id = first._actor_id
    ray.get(actors.coordinator_host().ready.remote())  # a coordinator host runs
    with pytest.raises(mem.MemoryInUseError, match=f"raymem://{name}/a \\(committed\\).*--force") as info:
        mem.stop()
    assert f"raymem://{name}/a" in info.value.held
    assert _loads(f"raymem://{name}/a", 5)  # nothing was stopped
    assert placement.holder(_node())._actor_id == first_id

    stopped = mem.stop(force=True)
    _save(f"raymem://{name}/b", 6)  # the next raymem:// operation starts a new holder
    assert f"holder-{_node()}" in stopped.holders and actors.host_name() in stopped.hosts
    assert f"raymem://{name}/a" in stopped.dropped
    assert placement.holder(_node())._actor_id != first_id
    assert _loads(f"raymem://{name}/b", 6)
    assert [r.url for r in _mine(name)] == [f"raymem://{name}/b"]  # a went with its holder

    stopped = mem.stop(force=True)
    names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    assert f"holder-{_node()}" in stopped.holders and not names & set(stopped.holders)
    assert mem.checkpoints(name) == []
    assert {r.node: r for r in mem.usage()}[_node()].state == "none"
    with pytest.raises(CheckpointNotFoundError):
        mem.remove(f"raymem://{name}")
    again = mem.stop()  # nothing left to stop
    assert again.holders == [] and again.hosts == [] and again.dropped == []


class _SilentHolder:
    """Stands for a holder that does not answer (a node under memory pressure, a wedged process)."""

    def __init__(self):
        import threading

        self._never = threading.Event()

    def _wait(self, *args):
        self._never.wait()

    ping = usage = listing = reservations = _wait


def test_a_holder_that_does_not_answer_is_reported_and_stop_force_stops_it(ray_session):
    ray = ray_session
    mem.stop(force=True)  # no holder runs on this node now
    node = _node()
    silent = ray.remote(_SilentHolder).options(
        name=f"holder-{node}", namespace=placement.NAMESPACE, lifetime="detached", num_cpus=0,
        max_concurrency=8).remote()
    ray.get(silent.__ray_ready__.remote())
    assert {r.node: r for r in mem.usage(timeout_s=1)}[node].state == "no answer"  # not "holds nothing"
    with pytest.raises(raydcp.CheckpointError, match=f"holders on nodes \\['{node}'\\] did not answer"):
        mem.checkpoints(timeout_s=1)
    with pytest.raises(raydcp.CheckpointError, match="did not answer.*--force"):
        mem.stop(timeout_s=1)
    # the timeout bounds both the wait for the silent holder (all of it) and the wait for the killed
    # actors to be gone (a moment)
    assert mem.stop(force=True, timeout_s=8).holders == [f"holder-{node}"]
    _save("raymem://adm-after-silent/a", 1)  # a real holder again
    try:
        assert _loads("raymem://adm-after-silent/a", 1)
    finally:
        mem.remove("raymem://adm-after-silent")
