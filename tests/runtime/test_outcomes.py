"""The one error a collective operation's driver raises from every rank's outcome (pure: no Ray started)."""
from __future__ import annotations

from raydcp import CheckpointError
from raydcp.runtime.outcomes import Outcomes, combined_error


def test_ranks_with_one_message_are_named_together_with_dead_and_stuck_ranks():
    errors = {2: CheckpointError("disk full"), 0: CheckpointError("disk full"), 3: CheckpointError("bad key", {3: "x"})}
    err = combined_error("ShardGroup 'g' save('p')", errors, [1], [4], note="rank 4: the driver")
    assert str(err).splitlines() == [
        "ShardGroup 'g' save('p') failed (rank 4: the driver):",
        "  on ranks [0, 2]: disk full",
        "  on ranks [3]: bad key",
        "  the actors of ranks [1] died",
        "  ranks [4] did not finish",
    ]
    assert {r: str(e) for r, e in err.failures.items()} == {
        0: "disk full", 2: "disk full", 3: "x", 1: "its actor died", 4: "did not finish"}
    assert all(isinstance(e, CheckpointError) for e in err.failures.values())


def test_the_error_has_the_type_of_the_lowest_failed_ranks_error():
    from raydcp import RanksTimedOutError, StorageError

    errors = {2: CheckpointError("bad key"), 1: StorageError("disk full", retriable=False)}
    assert type(combined_error("save", errors, [], [])) is StorageError
    stuck = combined_error("save", {}, [], [3])
    assert isinstance(stuck, RanksTimedOutError) and tuple(stuck.missing_ranks) == (3,)


def test_one_kind_of_failure_is_one_line_with_what_to_do():
    err = Outcomes(dead=[1], pending={"ref": 2}).error("reshard round 3", sep="; ", then="; rerun the job")
    assert str(err) == "reshard round 3 failed the actors of ranks [1] died; ranks [2] did not finish; rerun the job"
    err = Outcomes(errors={0: CheckpointError("boom")}).error("reshard round 1", sep="; ", then="; rerun")
    assert str(err) == "reshard round 1 failed on ranks [0]: boom; rerun" and str(err.failures[0]) == "boom"
    assert Outcomes(results={0: 1}).ok and not Outcomes(dead=[0]).ok
