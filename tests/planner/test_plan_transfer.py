"""Transfer planning (in-memory reshard), in one process: who sends which part to whom."""
from __future__ import annotations

import pytest
import torch

from raydcp import CheckpointError, Shard
from raydcp.engine.load import local_load_plan
from raydcp.engine.save import local_save_plan
from raydcp.planner import plan_transfer
from raydcp.state import flatten_state


def _src(rank: int, sd: dict):
    return local_save_plan(rank, flatten_state(sd), compare_replicas=False).plan


def _dst(rank: int, sd: dict):
    return local_load_plan(rank, flatten_state(sd, for_load=True), True)


def _rows(lo: int, n: int, total: int = 6):
    return Shard(torch.zeros(n, 2), (lo, 0), (total, 2))


def test_two_holders_to_three_wanting_ranks():
    pairs = [(_src(0, {"w": _rows(0, 3)}), _dst(0, {"w": _rows(0, 2)})),
             (_src(1, {"w": _rows(3, 3)}), _dst(1, {"w": _rows(2, 2)})),
             (None, _dst(2, {"w": _rows(4, 2)}))]
    plans = plan_transfer(pairs)
    assert [p.rank for p in plans] == [0, 1, 2]
    assert [p.bytes_needed for p in plans] == [16, 16, 16]
    assert plans[2].bytes_read == 0  # holds nothing: only receives
    senders = {p.rank for p in plans if p.bytes_read}
    assert senders == {0, 1}
    # rank 1's rows 2-3 come from both holders; rank 2's rows 4-5 from rank 1
    assert plans[1].incoming == 1 and plans[2].incoming == 1


def test_pieces_that_do_not_form_whole_tensors_are_refused():
    pairs = [(_src(0, {"w": _rows(0, 3)}), _dst(0, {"w": _rows(0, 3)})),
             (_src(1, {"w": _rows(2, 3)}), _dst(1, {"w": _rows(3, 3)}))]
    with pytest.raises(CheckpointError, match="source group's pieces do not form whole tensors"):
        plan_transfer(pairs)
