"""A Group name's incarnations in the coordinator host, driven from asyncio (no Ray): ranks restarted
in new processes reuse the name from operation 0, while a second live caller for a rank, a caller
of an earlier incarnation and a partial restart are refused with errors naming group, rank and
operation. Each process is a ``Caller`` whose liveness the test decides (Ray's part, the object a
process owns, is exercised in test_group_restart.py)."""
from __future__ import annotations

import asyncio

from raydcp.errors import CheckpointError, CoordinatorLostError
from raydcp.runtime.coordinator_host import CoordinatorHost
from raydcp.runtime.operations import Caller
from raydcp.transport import decode

from ._ranks import add_rank_sum, gather_all

GUARD_S = 30.0  # bounds every wait of a test that would otherwise hang; never reached when it passes


class Process:
    """A rank's process: its Caller, whose ``alive`` object fails once ``kill()`` was called."""

    def __init__(self, name: str):
        self.dead = False
        self.caller = Caller(name, self)

    def kill(self) -> "Process":
        self.dead = True
        return self

    def __await__(self):
        if self.dead:
            raise RuntimeError(f"the owner of {self.caller.id}'s object died")
        return asyncio.sleep(0, True).__await__()


def call(host, key, proc, rank, world_size, seq, value, fn=gather_all, step="plan", timeout_s=GUARD_S):
    return host.reduce_scatter(key, timeout_s, rank, world_size, seq, step, value, fn, proc.caller)


async def operation(host, group, number, procs, values=None, fn=add_rank_sum):
    """One round of operation ``number`` with rank r in ``procs[r]``, then every close: the replies."""
    key = (group, group, number)
    values = values or list(range(len(procs)))
    out = await asyncio.wait_for(asyncio.gather(*(call(host, key, p, r, len(procs), 1, values[r], fn)
                                                    for r, p in enumerate(procs))), GUARD_S)
    for r, p in enumerate(procs):
        await host.close(key, r, p.caller)
    return [decode(v) for v in out]


def started(coro):
    """``coro`` running in the background, past its first steps."""
    async def go():
        task = asyncio.ensure_future(coro)
        for _ in range(5):
            await asyncio.sleep(0)
        assert not task.done()
        return task
    return go()


def run(coro):
    return asyncio.run(coro)


def test_ranks_restarted_in_new_processes_save_again_and_the_old_processes_are_refused():
    async def main():
        host = CoordinatorHost()
        old = [Process("old0"), Process("old1")]
        for number in range(3):
            assert await operation(host, "ckpt", number, old) == [1, 2]
        old[0].kill()  # rank 0's process is gone; rank 1's lives on, finished (say, it is being stopped)
        new = [Process("new0"), Process("new1")]
        # the restarted ranks number from 0 again: a new incarnation of the group, not a second caller
        assert await operation(host, "ckpt", 0, new, [10, 20]) == [40, 50]
        assert (await host.incarnation("ckpt", "ckpt"))["gen"] == 1
        assert await operation(host, "ckpt", 1, new, [1, 1]) == [3, 3]  # the same processes go on
        # the old process of rank 1 calls again: refused (its rank runs in another process now)
        late = await call(host, ("ckpt", "ckpt", 3), old[1], 1, 2, 1, 0)
        assert isinstance(late, CheckpointError) and "rank 1 of group 'ckpt' (operation 3)" in str(late)
        assert "runs in another process now" in str(late)
        assert await operation(host, "ckpt", 2, new) == [1, 2]  # and the new incarnation is untouched
        assert (await host.status())["live"] == 0

    run(main())


def test_two_live_callers_for_one_rank_of_one_operation_are_refused_and_the_operation_fails():
    async def main():
        host = CoordinatorHost()
        first, second = Process("job-a.rank0"), Process("job-b.rank0")
        key = ("shared", "shared", 0)
        waiting = await started(call(host, key, first, 0, 2, 1, "a"))
        refused = await asyncio.wait_for(call(host, key, second, 0, 2, 1, "b"), GUARD_S)
        assert isinstance(refused, CheckpointError)
        assert "rank 0 of group 'shared' (operation 0 of this process) is refused" in str(refused)
        assert "operation 0 runs with ranks [0] in live processes" in str(refused)
        assert list(refused.failures) == [0]
        # the running operation fails on every rank: the two callers are never mixed
        err = await asyncio.wait_for(waiting, GUARD_S)
        assert isinstance(err, CheckpointError) and "group 'shared' (operation 0)" in str(err)
        assert "rank 0 arrived from another process" in str(err)
        late = await call(host, key, first, 1, 2, 1, "a1")  # its other rank learns it at once
        assert isinstance(late, CoordinatorLostError) and "already ended the operation" in str(late)

    run(main())


def test_a_restart_after_processes_were_killed_mid_operation_goes_on_at_once():
    async def main():
        host = CoordinatorHost()
        old = [Process("old0"), Process("old1")]
        key = ("run", "run", 4)
        for number in range(4):
            await operation(host, "run", number, old)
        # operation 4: rank 0 waits in its second round, rank 1 took part in the first and is writing
        first = await asyncio.wait_for(asyncio.gather(*(call(host, key, p, r, 2, 1, r) for r, p in enumerate(old))),
                                       GUARD_S)
        assert [decode(v) for v in first] == [[0, 1], [0, 1]]
        waiting = await started(call(host, key, old[0], 0, 2, 2, "commit", step="commit"))
        old[0].kill(), old[1].kill()  # both killed (kill -9) in the middle of operation 4
        new = [Process("new0"), Process("new1")]
        # the new ranks do not wait for operation 4 to time out: its processes are found gone
        assert await operation(host, "run", 0, new) == [1, 2]
        err = await asyncio.wait_for(waiting, GUARD_S)
        assert isinstance(err, CoordinatorLostError) and "operation 4 of group 'run' cannot complete" in str(err)
        assert "rank 0 restarted in a new process" in str(err)

    run(main())


def test_a_partial_restart_fails_promptly_on_both_sides():
    """Only rank 1 restarted; rank 0's process lives on. Whichever comes first, both sides get an
    error at once saying that only some ranks restarted, instead of waiting for the timeout."""
    async def main():
        host = CoordinatorHost()
        # (a) the old rank 0 is idle when the new rank 1 arrives, and calls afterwards
        old = [Process("a.old0"), Process("a.old1")]
        await operation(host, "a", 0, old)
        old[1].kill()
        new1 = Process("a.new1")
        waiting = await started(call(host, ("a", "a", 0), new1, 1, 2, 1, 1))
        refused = await asyncio.wait_for(call(host, ("a", "a", 1), old[0], 0, 2, 1, 0), GUARD_S)
        err = await asyncio.wait_for(waiting, GUARD_S)
        for e in (refused, err):
            assert isinstance(e, CheckpointError), e
            assert "group 'a': rank 0 still runs in a live process of the group's earlier incarnation" in str(e)
            assert "(it called its operation 1) while ranks [1] restarted" in str(e)
        # (b) the old rank 0 already waits in an operation when the new rank 1 arrives
        old = [Process("b.old0"), Process("b.old1")]
        await operation(host, "b", 0, old)
        old[1].kill()
        waiting = await started(call(host, ("b", "b", 1), old[0], 0, 2, 1, 0))
        refused = await asyncio.wait_for(call(host, ("b", "b", 0), Process("b.new1"), 1, 2, 1, 1), GUARD_S)
        assert isinstance(refused, CheckpointError)
        assert "rank 1 of group 'b' (operation 0 of this process) is refused" in str(refused)
        assert "operation 1 runs with ranks [0] in live processes" in str(refused)
        err = await asyncio.wait_for(waiting, GUARD_S)
        assert isinstance(err, CheckpointError) and "rank 1 arrived from another process" in str(err)

    run(main())


def test_a_restart_on_another_world_size_begins_a_new_incarnation_whichever_rank_comes_first():
    async def main():
        host = CoordinatorHost()
        await operation(host, "elastic", 0, [Process("o0"), Process("o1")])
        new = [Process("n0"), Process("n1"), Process("n2")]
        # rank 2 never took part in the group: it comes first, as a rank of the new incarnation
        key = ("elastic", "elastic", 0)
        calls = [await started(call(host, key, new[2], 2, 3, 1, 2, add_rank_sum))]
        calls += [asyncio.ensure_future(call(host, key, new[r], r, 3, 1, r, add_rank_sum)) for r in range(2)]
        assert sorted(decode(v) for v in await asyncio.wait_for(asyncio.gather(*calls), GUARD_S)) == [3, 4, 5]
        assert (await host.incarnation("elastic", "elastic"))["gen"] == 1

    run(main())


def test_a_groups_incarnations_are_forgotten_with_its_last_record():
    class Clock:
        now = 1000.0

        def __call__(self):
            return self.now

    async def main():
        clock = Clock()
        host = CoordinatorHost(clock=clock)
        await operation(host, "gone", 0, [Process("p0"), Process("p1")])
        assert (await host.incarnation("gone", "gone"))["ranks"] == [0, 1]
        clock.now += GUARD_S + host.sweep_every_s  # past the record's lifetime
        await operation(host, "other", 0, [Process("q0"), Process("q1")])
        assert await host.incarnation("gone", "gone") is None

    run(main())


def test_a_rank_of_another_world_size_beside_live_ranks_is_named_as_such():
    """Not a restart (the group's ranks live, in the operation): a misconfigured rank, which fails the
    operation on every rank with the coordinator's world_size message."""
    async def main():
        host = CoordinatorHost()
        key = ("sizes", "sizes", 0)
        waiting = await started(call(host, key, Process("r0"), 0, 2, 1, 0))
        wrong = await asyncio.wait_for(call(host, key, Process("r1"), 1, 3, 1, 1), GUARD_S)
        assert await asyncio.wait_for(waiting, GUARD_S) is wrong
        assert isinstance(wrong, CheckpointError) and "rank 1 uses world_size 3" in str(wrong)
        assert "has world_size 2" in str(wrong)

    run(main())
