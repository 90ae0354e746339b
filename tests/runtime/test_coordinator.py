"""The Coordinator as a plain class, driven from asyncio (no Ray)."""
from __future__ import annotations

import asyncio
import functools
import time

import pytest

from raydcp.errors import CheckpointError, CoordinatorLostError, RankFailedError, RankFailure, RanksTimedOutError
from raydcp.runtime.coordinator import Coordinator

from ._ranks import add_rank_sum, boom, buggy, gather_all, wrong_length


def run(coro):
    return asyncio.run(coro)


async def rs_all(c, seq, step, values, fn, ranks=None):
    ranks = range(len(values)) if ranks is None else ranks
    replies = await asyncio.gather(*(c.reduce_scatter(r, c.world_size, seq, step, values[r], fn) for r in ranks))
    return [v for _, v in replies]


def test_reduce_scatter_gives_each_rank_its_element():
    async def main():
        c = Coordinator("g", 0, 3, timeout_s=5, creator_rank=1)
        out = await rs_all(c, 1, "plan", [1, 2, 3], add_rank_sum)
        assert out == [7, 8, 9]
        out = await rs_all(c, 2, "commit", ["a", "b", "c"], functools.partial(gather_all))
        assert out == [["a", "b", "c"]] * 3
        assert [await c.close(r) for r in range(3)] == [False, False, True]

    run(main())


def test_reply_names_creator():
    async def main():
        c = Coordinator("g", 0, 1, timeout_s=5, creator_rank=0)
        assert await c.reduce_scatter(0, 1, 1, "s", 5, gather_all) == (0, [5])

    run(main())


@pytest.mark.parametrize(
    "values, fn, expect",
    [
        ([1, RankFailure(1, "disk full"), RankFailure(2, "no such key 'b'")], gather_all, "failed on 2 ranks"),
        ([1, 2, 3], boom, "key 'w' has two shapes"),
        ([1, 2, 3], buggy, "ZeroDivisionError"),
        ([1, 2, 3], wrong_length, "internal error"),
    ],
)
def test_failures_reach_every_rank(values, fn, expect):
    async def main():
        c = Coordinator("g", 0, 3, timeout_s=5)
        out = await rs_all(c, 1, "plan", values, fn)
        assert all(isinstance(e, CheckpointError) for e in out)
        assert len({str(e) for e in out}) == 1 and expect in str(out[0])
        if isinstance(values[1], RankFailure):
            assert {r: str(e) for r, e in out[0].failures.items()} == {1: "disk full", 2: "no such key 'b'"}
        if fn is buggy:  # an exception in the reduction names the coordinator and the frame that raised it
            assert isinstance(out[0], RankFailedError) and out[0].rank is None
            assert isinstance(out[0].exception, ZeroDivisionError) and "_ranks.py" in str(out[0])
            assert out[0].origin == "user"  # the reduction is this test's code, not raydcp's

    run(main())


def test_missing_rank_times_out_with_its_name_and_later_calls_fail_fast():
    async def main():
        c = Coordinator("trainer", 4, 3, timeout_s=0.3)
        t0 = time.monotonic()
        out = await rs_all(c, 1, "plan", [1, 2, 3], gather_all, ranks=[0, 1])
        assert time.monotonic() - t0 < 2
        for e in out:
            assert isinstance(e, CheckpointError)
            assert "ranks [2]" in str(e) and "'trainer'" in str(e) and "timeout_s" in str(e)
            assert set(e.failures) == {2}
            assert isinstance(e, RanksTimedOutError) and e.missing_ranks == (2,) and e.timeout_s == 0.3
        # the late rank learns at once that the operation failed
        _, late = await c.reduce_scatter(2, 3, 1, "plan", 3, gather_all)
        assert late is out[0]
        assert [await c.close(r) for r in range(3)] == [False, False, True]

    run(main())


def test_rank_that_closed_fails_the_others_at_once():
    async def main():
        c = Coordinator("g", 0, 3, timeout_s=30)
        await rs_all(c, 1, "plan", [1, 2, 3], gather_all)
        waiting = asyncio.ensure_future(rs_all(c, 2, "write", [1, 2, 3], gather_all, ranks=[0, 1]))
        await asyncio.sleep(0)  # let ranks 0 and 1 arrive
        t0 = time.monotonic()
        assert await c.close(2) is False
        out = await waiting
        assert time.monotonic() - t0 < 1
        assert all("rank 2" in str(e) and "left the operation after 'plan'" in str(e) for e in out)
        # failed, and every rank that took part closed: finished
        assert [await c.close(0), await c.close(1)] == [False, True]

    run(main())


def test_rank_closed_before_a_round_starts_fails_that_round():
    async def main():
        c = Coordinator("g", 0, 2, timeout_s=30)
        await c.close(1)
        _, err = await c.reduce_scatter(0, 2, 1, "plan", 0, gather_all)
        assert isinstance(err, CheckpointError) and "rank 1" in str(err)

    run(main())


def test_out_of_step_ranks_fail_together():
    async def main():
        c = Coordinator("g", 0, 2, timeout_s=5)
        replies = await asyncio.gather(
            c.reduce_scatter(0, 2, 1, "plan", 0, gather_all), c.exchange(1, 2, 1, "data", {})
        )
        errs = [v for _, v in replies]
        assert all(isinstance(e, CheckpointError) and "out of step" in str(e) for e in errs)
        assert "rank 1: exchange 'data'" in str(errs[0])

    run(main())


def test_wrong_world_size_or_duplicate_rank_fails_everyone():
    async def main():
        c = Coordinator("g", 0, 2, timeout_s=5)
        waiting = asyncio.ensure_future(c.reduce_scatter(0, 2, 1, "plan", 0, gather_all))
        await asyncio.sleep(0)
        _, err = await c.reduce_scatter(1, 3, 1, "plan", 0, gather_all)
        assert "world_size 3" in str(err)
        assert (await waiting)[1] is err

        c = Coordinator("g", 1, 2, timeout_s=5)
        waiting = asyncio.ensure_future(c.reduce_scatter(0, 2, 1, "plan", 0, gather_all))
        await asyncio.sleep(0)
        _, err = await c.reduce_scatter(0, 2, 1, "plan", 0, gather_all)
        assert "arrived twice" in str(err) and (await waiting)[1] is err

    run(main())


def test_exchange_routes_refs_by_destination_in_source_order():
    async def main():
        c = Coordinator("g", 0, 3, timeout_s=5)
        outgoing = [
            {0: [("a", "r0->0")], 2: [("b", "r0->2")]},
            {2: [("c", "r1->2"), ("d", "r1->2'")]},
            {0: [("e", "r2->0")], 2: [("f", None)]},
        ]
        replies = await asyncio.gather(*(c.exchange(r, 3, 1, "read", outgoing[r]) for r in (2, 0, 1)))
        by_rank = {r: v for r, (_, v) in zip((2, 0, 1), replies)}
        assert by_rank[0] == [(0, "a", "r0->0"), (2, "e", "r2->0")]
        assert by_rank[1] == []
        assert by_rank[2] == [(0, "b", "r0->2"), (1, "c", "r1->2"), (1, "d", "r1->2'"), (2, "f", None)]

    run(main())


def test_exchange_bad_destination_or_sender_failure_fails_everyone():
    async def main():
        c = Coordinator("g", 0, 2, timeout_s=5)
        replies = await asyncio.gather(c.exchange(0, 2, 1, "read", {5: [("a", 1)]}), c.exchange(1, 2, 1, "read", {}))
        assert all("rank 5" in str(v) and "outside group" in str(v) for _, v in replies)

        c = Coordinator("g", 1, 2, timeout_s=5)
        replies = await asyncio.gather(
            c.exchange(0, 2, 1, "read", RankFailure(0, "object store full")), c.exchange(1, 2, 1, "read", {})
        )
        assert all("object store full" in str(v) for _, v in replies)

    run(main())


def test_status_snapshot():
    async def main():
        c = Coordinator("g", 7, 2, timeout_s=5, creator_rank=0)
        waiting = asyncio.ensure_future(c.reduce_scatter(0, 2, 1, "plan", 0, gather_all))
        await asyncio.sleep(0)
        st = await c.status()
        assert st["open_rounds"] == [1] and st["op"] == 7 and st["failed"] is None
        await c.reduce_scatter(1, 2, 1, "plan", 0, gather_all)
        await waiting
        assert (await c.status())["open_rounds"] == []

    run(main())


def test_a_second_caller_for_a_rank_fails_the_operation_on_every_rank_even_after_its_round_completed():
    """Two unrelated saves share a Group name: X's rank 0 and Y's rank 1 complete call 1 together;
    when Y's rank 0 arrives at call 1 the operation fails on every rank, before anything mixes further."""
    async def main():
        c = Coordinator("shared", 0, 2, timeout_s=5)
        assert await rs_all(c, 1, "save: plan", ["x0", "y1"], gather_all) == [["x0", "y1"]] * 2
        _, err = await c.reduce_scatter(0, 2, 1, "save: plan", "y0", gather_all)
        assert isinstance(err, CheckpointError) and "arrived twice at call 1" in str(err)
        out = await rs_all(c, 2, "save: commit", ["x0", "y1"], gather_all)  # the first callers go on
        assert all(isinstance(e, CheckpointError) and "arrived twice" in str(e) for e in out)

    run(main())


def test_a_first_call_past_call_1_means_the_operation_was_lost_and_fails_every_rank():
    """A rank whose first call here is its call 2 made call 1 to a coordinator that is gone (its host
    died): the rank waiting at call 1 (a retry on the new host) fails at once, as does every later call."""
    async def main():
        c = Coordinator("g", 3, 2, timeout_s=30)
        waiting = asyncio.ensure_future(c.reduce_scatter(0, 2, 1, "save: plan", 0, gather_all))
        await asyncio.sleep(0)
        t0 = time.monotonic()
        _, err = await c.reduce_scatter(1, 2, 2, "save: commit", 1, gather_all)
        assert isinstance(err, CoordinatorLostError) and "rank 1's first call to it is its call 2" in str(err)
        assert "operation 3" in str(err) and "'g'" in str(err)
        assert (await waiting)[1] is err and time.monotonic() - t0 < 1
        _, later = await c.reduce_scatter(0, 2, 2, "save: commit", 0, gather_all)
        assert later is err

    run(main())


def test_a_slow_reduction_runs_in_a_thread_and_no_waiting_rank_times_out_for_it():
    """Every rank arrived: the reduction may outlast timeout_s (the ranks wait for it, not for a peer),
    and it runs off the event loop, which meanwhile serves other calls."""
    import threading

    release = threading.Event()
    started = threading.Event()

    def slow(values):
        started.set()
        release.wait(30)
        return [sum(values)] * len(values)

    async def main():
        c = Coordinator("g", 0, 2, timeout_s=0.2)
        both = asyncio.ensure_future(rs_all(c, 1, "plan", [1, 2], slow))
        other = Coordinator("h", 0, 1, timeout_s=5)
        assert await asyncio.to_thread(started.wait, 30)
        # the loop is free while the reduction runs: another operation completes now
        assert await other.reduce_scatter(0, 1, 1, "plan", 7, gather_all) == (None, [7])
        await asyncio.sleep(0.4)  # past timeout_s of the waiting ranks
        release.set()
        assert await both == [3, 3]

    run(main())


def test_a_groups_repeated_saves_of_one_layout_reuse_the_plan_and_a_changed_layout_does_not():
    import uuid

    from raydcp.engine.protocol import reduce_plan
    from raydcp.planner import LocalSavePlan, SavePlanOptions, TensorSpec, WriteItem
    from raydcp.transport import Reusing, decode, encode

    def plans(rows_of_rank3=2):
        out = []
        for r in range(4):
            rows = rows_of_rank3 if r == 3 else 2
            specs = {"w": TensorSpec("float32", (6 + rows_of_rank3, 3))}
            out.append(decode(encode(LocalSavePlan(r, specs, (WriteItem("w", (2 * r, 0), (rows, 3), rows * 12, r),),
                                                   {}))))
        return out

    group = f"train-{uuid.uuid4().hex[:8]}"

    async def save(op, values):
        c = Coordinator(group, op, 4, timeout_s=5)
        out = await rs_all(c, 1, "save: plan", values, Reusing(reduce_plan, SavePlanOptions()))
        assert not any(isinstance(v, BaseException) for v in out), out
        return [rp for rp, _ in out], Coordinator._plan_caches[group]

    async def main():
        first, cache = await save(0, plans())
        assert (cache.hits, cache.misses) == (0, 1)
        again, cache = await save(1, plans())  # the next operation of the group: the plan reused
        assert (cache.hits, cache.misses) == (1, 1)
        assert [(tuple(f.items), tuple(f.byte_offsets)) for f in (rp.files for rp in again)] == \
               [(tuple(f.items), tuple(f.byte_offsets)) for f in (rp.files for rp in first)]
        assert first[0].save_id != again[0].save_id and all(n.startswith(f"data/{again[0].save_id}/")
                                                            for rp in again for n in rp.files.names)
        _, cache = await save(2, plans(rows_of_rank3=3))  # rank 3 holds another shape: planned anew
        assert (cache.hits, cache.misses) == (1, 2)
        other = Coordinator(f"other-{group}", 0, 4, timeout_s=5)
        await rs_all(other, 1, "save: plan", plans(), Reusing(reduce_plan, SavePlanOptions()))
        assert Coordinator._plan_caches[f"other-{group}"] is not cache  # each group its own

    run(main())
