"""The cluster's coordinator host as a plain class, driven from asyncio (no Ray): many groups in
one host, records of ended operations, and how its per-group state is bounded and released."""
from __future__ import annotations

import asyncio
import threading

from raydcp.errors import CheckpointError, CoordinatorLostError
from raydcp.runtime.coordinator_host import CoordinatorHost
from raydcp.transport import Wire, decode, encode

from ._ranks import add_rank_sum, gather_all


def run(coro):
    return asyncio.run(coro)


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


async def rs(host, key, seq, step, values, fn, timeout_s=5.0, ranks=None):
    ranks = range(len(values)) if ranks is None else ranks
    return await asyncio.gather(*(host.reduce_scatter(key, timeout_s, r, len(values), seq, step, values[r], fn)
                                  for r in ranks))


async def one_operation(host, key, world_size, value=1):
    """One round and every rank's close: the replies."""
    out = await rs(host, key, 1, "plan", [value + r for r in range(world_size)], add_rank_sum)
    assert [await host.close(key, r) for r in range(world_size)][-1] is True
    return [decode(v) for v in out]


def test_host_decodes_wire_values_and_encodes_a_shared_reply_once():
    def shared(values):  # one object for every rank, as the commit step's metadata
        out = list(values)
        return [out] * len(values)

    async def main():
        host = CoordinatorHost()
        key = ("g", "g", 0)
        wires = await rs(host, key, 1, "commit", [encode({"rank": r}) for r in range(3)], shared)
        assert all(isinstance(w, Wire) for w in wires)
        assert wires[0] is wires[1] is wires[2]  # one object for every rank: pickled once
        assert decode(wires[0]) == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
        # plain values (a rank that could not encode) and per-rank replies
        replies = await rs(host, key, 2, "plan", [0, 1, 2], add_rank_sum)
        assert [decode(v) for v in replies] == [3, 4, 5]
        assert [await host.close(key, r) for r in range(3)] == [False, False, True]
        assert (await host.status())["live"] == 0
        # a value the host cannot decode fails every rank, naming the rank
        errs = await rs(host, ("g", "g", 1), 1, "plan", [encode(0), Wire(b"not a pickle")], gather_all)
        assert all(isinstance(e, CheckpointError) and "rank 1" in str(e) and "decoded" in str(e) for e in errs)

    run(main())


def test_host_refuses_a_late_caller_of_an_operation_that_already_completed():
    async def main():
        host = CoordinatorHost()
        key = ("shared", "shared", 1)
        assert await one_operation(host, key, 2) == [4, 5]
        # the other save's callers of operation 1 come late: refused, not run as operation 1 again
        errs = await rs(host, key, 1, "save: plan", [0, 1], gather_all)
        assert all(isinstance(e, CheckpointError) and "already completed" in str(e) for e in errs)
        assert (await host.status())["live"] == 0

    run(main())


def test_a_late_rank_of_a_failed_operation_learns_it_at_once_and_its_ranks_get_the_same_error():
    async def main():
        host = CoordinatorHost()
        key = ("g", "g", 0)
        out = await rs(host, key, 1, "plan", [0, 1, 2], gather_all, timeout_s=0.2, ranks=[0, 1])
        assert all(isinstance(e, CheckpointError) and "ranks [2]" in str(e) for e in out)
        assert (await host.status(key))["ended"] is True  # dropped at once, its end recorded
        late = await host.reduce_scatter(key, 0.2, 2, 3, 1, "plan", 2, gather_all)
        assert isinstance(late, CoordinatorLostError) and "already ended the operation" in str(late)
        again = await host.reduce_scatter(key, 0.2, 0, 3, 2, "commit", 0, gather_all)
        assert type(again) is type(out[0]) and str(again) == str(out[0])  # a rank of it: the same error

    run(main())


def test_an_operation_the_host_never_saw_from_its_start_fails_on_every_rank():
    """A new host (the old one died) gets call 2 of a rank: the operation fails there at once, also for
    a rank that retried its call 1 on the new host."""
    async def main():
        host = CoordinatorHost()
        key = ("g", "g", 5)
        retried = asyncio.ensure_future(host.reduce_scatter(key, 30.0, 0, 2, 1, "save: plan", 0, gather_all))
        await asyncio.sleep(0)
        lost = await host.reduce_scatter(key, 30.0, 1, 2, 2, "save: write", 1, gather_all)
        assert isinstance(lost, CoordinatorLostError) and "its call 2" in str(lost)
        assert isinstance(await asyncio.wait_for(retried, 5), CoordinatorLostError)

    run(main())


def test_many_groups_at_once_and_a_stalled_group_blocks_none_of_the_others():
    async def main():
        host = CoordinatorHost()
        stalled = ("stalled", "stalled", 0)
        waiting = asyncio.ensure_future(host.reduce_scatter(stalled, 30.0, 0, 2, 1, "plan", 0, gather_all))
        await asyncio.sleep(0)
        # 8 groups of 2 ranks, two operations each, all at once, while rank 1 of 'stalled' never comes
        keys = [(f"g{i}", f"g{i}", op) for i in range(8) for op in range(2)]
        outs = await asyncio.gather(*(one_operation(host, k, 2, value=10 * int(k[0][1:])) for k in keys))
        for k, out in zip(keys, outs):
            v = 10 * int(k[0][1:])
            assert out == [v + (2 * v + 1), v + 1 + (2 * v + 1)]  # each group sums only its own ranks
        assert not waiting.done()
        st = await host.status()
        assert st["live"] == 1 and st["ops"] == [("stalled", "stalled", 0)]
        await host.reduce_scatter(stalled, 30.0, 1, 2, 1, "plan", 1, gather_all)
        assert decode(await waiting) == [0, 1]

    run(main())


def test_long_plannings_of_other_groups_do_not_hold_up_another():
    """Eight groups plan at once, longer than the default executor has threads for on a small
    machine; a ninth group's operation still completes meanwhile."""
    release = threading.Event()
    started = threading.Semaphore(0)

    def slow(values):
        started.release()
        release.wait(30)
        return list(values)

    async def main():
        host = CoordinatorHost()
        slow_ops = [asyncio.ensure_future(rs(host, (f"big{i}", f"big{i}", 0), 1, "plan", [0, 1], slow))
                    for i in range(8)]
        for _ in range(8):  # every one of them is planning, in a thread of its own
            assert await asyncio.to_thread(started.acquire, True, 30)
        assert await one_operation(host, ("small", "small", 0), 2) == [4, 5]  # while the big ones plan
        release.set()
        for op in slow_ops:
            assert [decode(v) for v in await op] == [0, 1]

    run(main())


def test_records_expire_and_an_owner_with_nothing_left_is_released():
    async def main():
        clock = Clock()
        host = CoordinatorHost(clock=clock)
        for i in range(50):  # 50 single-use groups (a ShardGroup's operations, a job's rounds)
            await one_operation(host, (f"job-{i}", f"job-{i}", 0), 2)
        st = await host.status()
        assert st["live"] == 0 and st["owners"] == 50 and st["records"] == 50  # each end recorded
        clock.now += 6.0  # past the operations' timeout_s (5 s), and the sweep's period
        await one_operation(host, ("next", "next", 0), 2)
        st = await host.status()
        assert st["owners"] == 1 and st["records"] == 1  # only the newest group's record is left
        assert await host.owner_status("job-0") is None

    run(main())


def test_records_and_idle_owners_are_bounded():
    async def main():
        host = CoordinatorHost(clock=Clock())  # the clock stands still: nothing expires
        host.max_records, host.max_idle_owners = 4, 8
        for op in range(10):  # one long-lived group: its records stay bounded
            await one_operation(host, ("run", "run", op), 2)
        assert (await host.owner_status("run"))["records"] == 4
        # the oldest records went first: a late second caller of the newest is still refused
        errs = await rs(host, ("run", "run", 9), 1, "plan", [0, 1], gather_all)
        assert all("already completed" in str(e) for e in errs)
        for i in range(30):
            await one_operation(host, (f"g{i}", f"g{i}", 0), 2)
        st = await host.status()
        assert st["owners"] <= 8 + 1 and st["live"] == 0
        assert await host.owner_status("g29") is not None and await host.owner_status("run") is None  # LRU

    run(main())


def test_release_drops_an_owners_state_now_or_with_its_last_running_operation():
    async def main():
        host = CoordinatorHost()
        # a ShardGroup's operations run under names of their own, its state under the ShardGroup's
        for n in range(3):
            await one_operation(host, ("sg", f"sg.{n}", 0), 2)
        assert (await host.owner_status("sg"))["records"] == 3
        assert await host.release("sg") is True
        assert await host.owner_status("sg") is None and await host.release("sg") is False
        # released while an operation runs: dropped when it ends
        key = ("sg2", "sg2.0", 0)
        first = asyncio.ensure_future(host.reduce_scatter(key, 5.0, 0, 2, 1, "plan", 0, gather_all))
        await asyncio.sleep(0)
        await host.release("sg2")
        assert (await host.owner_status("sg2"))["released"] is True
        await host.reduce_scatter(key, 5.0, 1, 2, 1, "plan", 1, gather_all)
        await first
        assert [await host.close(key, r) for r in range(2)] == [False, True]
        assert await host.owner_status("sg2") is None
        assert (await host.status())["owners"] == 0

    run(main())
