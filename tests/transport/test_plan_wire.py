"""Control-plane values on the wire: local plans travel as their columns, and decode to equal plans."""
from __future__ import annotations

import pickle

import torch

import raydcp
from raydcp.engine.load import local_load_plan
from raydcp.engine.protocol import reduce_plan
from raydcp.engine.save import local_save_plan
from raydcp.planner import LocalSavePlan, SavePlanOptions, TensorSpec, WriteItem, plan_save
from raydcp.state import flatten_state
from raydcp.transport import Wire, decode, encode


def _state(rank: int, n: int = 50, world: int = 4) -> dict:
    out = {f"w{i}": raydcp.Shard(torch.full((4, 3), float(i)), (4 * rank, 0), (4 * world, 3)) for i in range(n)}
    out["scalar"] = torch.tensor(1.5)  # a replica on every rank, 0-d
    out["step"] = 7
    return out


def _save_plans(world: int = 4) -> list:
    return [local_save_plan(r, flatten_state(_state(r, world=world)), compare_replicas=True).plan for r in range(world)]


def test_save_plan_travels_as_columns_and_decodes_equal():
    plans = _save_plans()
    wires = [encode(p) for p in plans]
    assert all(isinstance(w, Wire) for w in wires)
    # no per-piece objects inside: the pickle names neither WriteItem nor TensorSpec
    assert b"WriteItem" not in wires[0].data and b"TensorSpec" not in wires[0].data
    got = [decode(pickle.loads(pickle.dumps(w))) for w in wires]
    for p, g in zip(plans, got):
        assert type(g) is LocalSavePlan and g.rank == p.rank and g.values == p.values
        assert len(g.items) == len(p.items)
    # the planner's array path never builds the items or the specs of ranks other than 0
    out = reduce_plan(SavePlanOptions(save_id="s"), got)
    assert all(g.items._objs is None for g in got) and all(g.tensors._dict is None for g in got[1:])
    assert out == reduce_plan(SavePlanOptions(save_id="s"), plans)
    # built on demand, they equal the originals
    for p, g in zip(plans, got):
        assert g.items == p.items and tuple(g.items) == tuple(p.items) and dict(g.tensors) == dict(p.tensors)
        assert g == p


def test_load_plan_round_trip():
    flat = flatten_state(_state(1), for_load=True)
    lp = local_load_plan(1, flat, strict=False)
    got = decode(encode(lp))
    assert got == lp and got.strict is False and list(got.tensors) == list(lp.tensors)
    assert got.items[3] == lp.items[3]


def test_plans_without_usable_columns_travel_whole():
    # boxes whose offsets and sizes differ in length cannot be columns: the plan travels as it is
    odd = LocalSavePlan(0, {"t": TensorSpec("float32", (4, 4))}, (WriteItem("t", (0, 0), (4,), 16),), {})
    got = decode(encode(odd))
    assert got.items == odd.items and isinstance(got.items, tuple)


def test_replies_and_other_values():
    plans = _save_plans(2)
    gp = plan_save(plans, SavePlanOptions(save_id="x"))
    for value in (None, 3, "s", (gp.ranks[0], ("x", 2, dict(gp.tensors), {})), gp.ranks[1], {"a": [1, 2]}):
        assert decode(encode(value)) == value
    assert decode(42) == 42  # anything not a Wire passes through
