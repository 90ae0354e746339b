"""The coordinator host's survivors operations as a plain class, driven from asyncio (no Ray): a
round told which ranks it need not wait for completes without them (a late one gets its reply), and
ranks announced to go are found lost once their node is gone, whether or not they ever called."""
from __future__ import annotations

import asyncio

from raydcp.errors import RankLost
from raydcp.runtime.coordinator_host import CoordinatorHost
from raydcp.transport import decode

from ._ranks import gather_all


def call(host, key, rank, seq, value, **kw):
    return asyncio.ensure_future(host.reduce_scatter(key, 60.0, rank, 3, seq, "save: step", value, gather_all,
                                                     survivors=True, **kw))


def test_a_round_completes_without_its_optional_rank_which_gets_its_reply_later():
    async def main():
        host = CoordinatorHost()
        key = ("g", "g", 0)
        assert [decode(v) for v in await asyncio.gather(*(call(host, key, r, 1, r) for r in range(3)))] == [[0, 1, 2]] * 3
        # rank 2 need not come to round 2: ranks 0 and 1 get their replies without it
        out = [decode(v) for v in await asyncio.gather(*(call(host, key, r, 2, 10 + r, optional=(2,)) for r in (0, 1)))]
        assert out[0] == out[1] and out[0][:2] == [10, 11] and isinstance(out[0][2], RankLost)
        assert [await host.close(key, r) for r in (0, 1)] == [False, False]  # ends once rank 2 closes or is gone
        late = decode(await call(host, key, 2, 2, 12, optional=(2,)))
        assert late == out[0]  # the round's reply, not a second round
        assert await host.close(key, 2) is True
        assert (await host.status())["live"] == 0

    asyncio.run(main())


def test_a_rank_announced_to_go_is_lost_once_its_node_is_gone_though_it_never_called():
    class Nodes(CoordinatorHost):
        watch_every_s = 0.01
        dead: set = set()
        looks = 0
        looked_twice = asyncio.Event()

        async def _dead_nodes(self, nodes):
            self.looks += 1
            if self.looks == 2:
                self.looked_twice.set()
            return nodes & self.dead

    async def main():
        Nodes.looked_twice = asyncio.Event()  # of this test's loop
        host = Nodes()
        key = ("g", "g", 0)
        leaving = {"node-b": (2,)}
        waiting = [call(host, key, r, 1, r, leaving=leaving) for r in (0, 1)]
        await host.looked_twice.wait()  # rank 2's node lives: the ranks wait for it
        assert not any(f.done() for f in waiting)
        host.dead = {"node-b"}
        out = [decode(v) for v in await asyncio.wait_for(asyncio.gather(*waiting), 30)]
        assert out[0][:2] == [0, 1] and isinstance(out[0][2], RankLost) and "node-b" in out[0][2].reason
        assert [await host.close(key, r) for r in (0, 1)] == [False, True]

    asyncio.run(main())
