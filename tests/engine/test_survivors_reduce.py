"""The survivors save's reductions (raydcp.engine.survivors), in one process: the plan is built from
the surviving ranks' local plans with the lost ranks standing in empty; a commit records the lost
ranks; a writer lost after the plan, or state only lost ranks held, commits nothing."""
from __future__ import annotations

import pytest
import torch

import raydcp
from raydcp.engine.save import local_save_plan, plan_options, write_rank_files
from raydcp.engine.survivors import (lost_ranks, reduce_commit_survivors, reduce_plan_survivors,
                                     uncovered_keys)
from raydcp.errors import RankLost, RanksLostError, StateNotCoveredError
from raydcp.options import SaveOptions
from raydcp.state import flatten_state
from raydcp.storage import CheckpointStorage, capacity


def replicated(rank: int) -> dict:
    return {"a": torch.arange(6.0), "b": torch.ones(2, 3), "step": 4}


def sharded(rank: int) -> dict:
    return {"w": raydcp.Shard(torch.full((2,), float(rank)), (2 * rank,), (8,)), "step": 4}


def plan_values(path: str, states: dict, required=()) -> tuple[list, dict]:
    """Each rank's plan-step value (a RankLost for the ranks ``states`` maps to None)."""
    storage = CheckpointStorage(path)
    values, staged = [], {}
    for r, state in states.items():
        if state is None:
            values.append(RankLost(r, "its process died"))
            continue
        staged[r] = local_save_plan(r, flatten_state(state), compare_replicas=True)
        values.append((storage.url, staged[r].plan, capacity.writer_site(storage), required))
    return values, staged


def survivors_save(path: str, states: dict, lost_after_plan=()) -> list:
    """Plan, write and commit as the coordinator and the surviving ranks of a survivors save would."""
    values, staged = plan_values(path, states)
    replies = reduce_plan_survivors(plan_options(SaveOptions()), (path, None), values)
    written = []
    for r, reply in enumerate(replies):
        if r not in staged or r in lost_after_plan:
            written.append(RankLost(r, "its process died"))
            continue
        plan, header, writers, lost = reply
        written.append((write_rank_files(CheckpointStorage(path), plan, staged[r]), header, writers, lost))
    return reduce_commit_survivors(path, None, written)


def test_replicated_state_commits_without_the_lost_rank(tmp_path):
    path = str(tmp_path / "ckpt")
    out = survivors_save(path, {0: replicated(0), 1: None, 2: replicated(2)})
    assert len(out) == 3 and lost_ranks(out[0]) == [1] and out[0].world_size == 3
    md = raydcp.read_metadata(path)
    assert lost_ranks(md) == [1] and md.values["step"] == 4
    state = {"a": torch.zeros(6), "b": torch.zeros(2, 3), "step": None}
    raydcp.load(state, path)
    assert torch.equal(state["a"], torch.arange(6.0)) and torch.equal(state["b"], torch.ones(2, 3))
    raydcp.save(replicated(0), str(tmp_path / "plain"))  # an ordinary save records no lost ranks
    assert lost_ranks(raydcp.read_metadata(str(tmp_path / "plain"))) == []


def test_pieces_only_the_lost_ranks_held_are_named_and_nothing_is_planned(tmp_path):
    path = str(tmp_path / "ckpt")
    values, _ = plan_values(path, {0: sharded(0), 1: sharded(1), 2: None, 3: sharded(3)})
    with pytest.raises(StateNotCoveredError) as info:
        reduce_plan_survivors(plan_options(SaveOptions()), (path, None), values)
    err = info.value
    assert err.keys == ("w",) and err.lost_ranks == (2,)
    assert "w: the surviving ranks hold 6 of its 8 elements" in str(err) and "rank 2 (its process died)" in str(err)
    assert not CheckpointStorage(path).is_committed()


def test_a_writer_lost_after_the_plan_commits_nothing_and_says_what_was_planned(tmp_path):
    path = str(tmp_path / "ckpt")
    states = {0: replicated(0), 1: replicated(1), 2: replicated(2)}
    values, _ = plan_values(path, states)
    writers = reduce_plan_survivors(plan_options(SaveOptions()), (path, None), values)[0][2]
    victim = max(writers)
    with pytest.raises(RanksLostError) as info:
        survivors_save(path, states, lost_after_plan=(victim,))
    assert not isinstance(info.value, StateNotCoveredError)
    assert info.value.lost_ranks == (victim,) and set(info.value.required) == {"a", "b", "step"}
    assert not CheckpointStorage(path).is_committed()
    # the next attempt checks the survivors' plans against what was planned: a key only the lost rank held
    only = {r: {**replicated(r), **({"mine": torch.ones(1)} if r == victim else {})} for r in states}
    assert uncovered_keys([local_save_plan(r, flatten_state(s), compare_replicas=True).plan
                           for r, s in only.items() if r != victim], ("a", "mine", "step")) == {
        "mine": "held by no surviving rank"}


def test_a_lost_rank_that_had_nothing_to_write_does_not_stop_the_commit(tmp_path):
    path = str(tmp_path / "ckpt")
    states = {0: replicated(0), 1: replicated(1), 2: replicated(2), 3: replicated(3)}
    values, _ = plan_values(path, states)
    writers = reduce_plan_survivors(plan_options(SaveOptions()), (path, None), values)[0][2]
    idle = sorted(set(states) - writers)
    assert idle, writers  # two tensors, four replicas: some rank writes nothing
    out = survivors_save(path, states, lost_after_plan=(idle[0],))
    assert lost_ranks(out[0]) == [idle[0]]


def test_ranks_announced_to_go_are_given_nothing_to_write_where_the_others_hold_their_pieces(tmp_path):
    path = str(tmp_path / "ckpt")
    many = {r: {**replicated(r), **{f"t{i}": torch.full((4,), float(i)) for i in range(6)}} for r in range(4)}
    values, _ = plan_values(path, many)
    opts = plan_options(SaveOptions())
    assert reduce_plan_survivors(opts, (path, None), values)[0][2] & {2, 3}  # unannounced, they would write
    replies = reduce_plan_survivors(opts, (path, None), values, leaving=(2, 3))
    assert replies[0][2] and not replies[0][2] & {2, 3} and replies[0][3] == ()
    # sharded: ranks 2 and 3 alone hold rows 4-7, so they still write them
    values, _ = plan_values(path, {r: sharded(r) for r in range(4)})
    assert {2, 3} <= reduce_plan_survivors(opts, (path, None), values, leaving=(2, 3))[0][2]


def test_of_two_ranks_announced_to_go_only_the_one_holding_what_no_other_rank_has_writes(tmp_path):
    path = str(tmp_path / "ckpt")
    states = {r: {**replicated(r), **{f"t{i}": torch.full((4,), float(i)) for i in range(6)},
                  **({"only3": torch.ones(3)} if r == 3 else {})} for r in range(4)}
    values, _ = plan_values(path, states)
    assert 2 in reduce_plan_survivors(plan_options(SaveOptions()), (path, None), values)[0][2]
    plans = reduce_plan_survivors(plan_options(SaveOptions()), (path, None), values, leaving=(2, 3))
    writers = plans[0][2]
    assert 3 in writers and 2 not in writers
    assert [name for name, _ in plans[3][0].files] and not list(plans[2][0].files)
