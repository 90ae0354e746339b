"""The typed errors: attributes, pickling (as Ray carries them), failures per rank, whose fault."""
from __future__ import annotations

import pickle
import threading

import pytest

import raydcp
from raydcp import errors
from raydcp.errors import (CheckpointDamagedError, CheckpointError, CheckpointNotFoundError, CheckpointReplacedError,
                           CoordinatorLostError, RankFailedError, RanksTimedOutError, RankFailure, RemoteException,
                           StateMismatchError, StorageError)

TYPED = {
    "CheckpointNotFoundError": lambda: CheckpointNotFoundError("nothing at /x", path="/x"),
    "CheckpointDamagedError": lambda: CheckpointDamagedError("bad crc", file="/x/data/a.bin", key="w",
                                                             byte_range=(8, 16), failures={1: "bad crc"}),
    "CheckpointReplacedError": lambda: CheckpointReplacedError("replaced", path="/x", read_save="a",
                                                               committed_save="b"),
    "StateMismatchError": lambda: StateMismatchError("cannot load", missing_keys=["a"], unexpected_keys=["b"],
                                                     shapes={"c": ((2,), (3,))}, dtypes={"d": ("float32", "int64")}),
    "RanksTimedOutError": lambda: RanksTimedOutError("late", missing_ranks=[3, 1], timeout_s=2.5),
    "RankFailedError": lambda: RankFailedError("rank 2 failed", rank=2, exception=KeyError("k"), origin="user",
                                               traceback="Traceback ..."),
    "CoordinatorLostError": lambda: CoordinatorLostError("gone", dead_rank=4),
    "StorageError": lambda: StorageError("throttled", retriable=True, path="s3://b/x"),
}


def _attrs(e: BaseException) -> dict:
    return {k: (str(v) if isinstance(v, BaseException) else v) for k, v in vars(e).items() if k != "failures"}


@pytest.mark.parametrize("name", sorted(TYPED))
def test_every_type_is_exported_and_a_checkpoint_error(name):
    assert name in raydcp.__all__ and getattr(raydcp, name) is getattr(errors, name)
    assert isinstance(TYPED[name](), CheckpointError)


@pytest.mark.parametrize("name", sorted(TYPED))
def test_every_type_survives_a_pickle_round_trip_with_its_attributes(name):
    err = TYPED[name]()
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err)
    assert _attrs(back) == _attrs(err) and _attrs(err)  # every type has attributes of its own
    assert {r: (type(e), str(e)) for r, e in back.failures.items()} == \
        {r: (type(e), str(e)) for r, e in err.failures.items()}


def test_attributes_are_normalised():
    assert TYPED["RanksTimedOutError"]().missing_ranks == (1, 3)
    mismatch = TYPED["StateMismatchError"]()
    assert mismatch.keys == ("a", "b", "c", "d")
    assert TYPED["RankFailedError"]().failures[2].args == ("k",)  # the rank's own exception, not a string
    damaged = CheckpointDamagedError("x", byte_range=[1, 2])
    assert damaged.byte_range == (1, 2) and damaged.file is None and damaged.key is None


def test_failures_map_ranks_to_exceptions_and_strings_become_errors():
    err = CheckpointError("save failed", {1: "disk full", "2": ValueError("v")})
    assert set(err.failures) == {1, 2}
    assert isinstance(err.failures[1], CheckpointError) and str(err.failures[1]) == "disk full"
    assert isinstance(err.failures[2], ValueError)


def test_copy_keeps_type_and_attributes_and_is_a_new_object():
    err = TYPED["CheckpointDamagedError"]()
    c = err.copy("w: bad crc", key="w2")
    assert type(c) is CheckpointDamagedError and c is not err and str(c) == "w: bad crc"
    assert (c.file, c.key, c.byte_range) == ("/x/data/a.bin", "w2", (8, 16)) and err.key == "w"


def test_a_rank_failure_of_a_typed_error_fails_every_rank_with_that_type():
    damaged = TYPED["CheckpointDamagedError"]()
    other = RankFailure.from_exception(3, StorageError("slow", retriable=True))
    err = errors.failures_error("load: read", [other, RankFailure.from_exception(1, damaged)])
    assert type(err) is CheckpointDamagedError and err.file == damaged.file  # the lowest failed rank's type
    assert "failed on 2 ranks" in str(err) and "rank 1: bad crc" in str(err) and "rank 3: slow" in str(err)
    assert set(err.failures) == {1, 3} and isinstance(err.failures[3], StorageError) and err.failures[3].retriable


class _Unpicklable(Exception):
    def __init__(self, msg):
        super().__init__(msg)
        self.lock = threading.Lock()


def _raise(exc):
    raise exc


def test_a_users_exception_keeps_its_type_and_message_and_is_labelled_as_the_users():
    try:
        _raise(KeyError("lr"))  # this test module is user code: not raydcp, not an installed library
    except KeyError as exc:
        failure = RankFailure.from_exception(2, exc)
    err = pickle.loads(pickle.dumps(errors.failures_error("save: plan", [failure])))
    assert type(err) is RankFailedError and err.rank == 2 and err.origin == "user"
    assert type(err.exception) is KeyError and err.exception.args == ("lr",)
    assert "raised by your code on rank 2" in str(err) and "test_types.py" in str(err)
    assert "please report" not in str(err) and "_raise" in err.traceback


def test_an_unpicklable_exception_travels_as_its_type_name_and_message():
    failure = RankFailure.from_exception(0, _Unpicklable("no pickle"))
    back = pickle.loads(pickle.dumps(failure))
    assert isinstance(back.error, RemoteException) and back.error.type_name.endswith("_Unpicklable")
    assert back.error.message == "no pickle" and "no pickle" in str(back.error)


def test_an_exception_raised_inside_raydcp_is_labelled_a_raydcp_bug():
    from raydcp.planner import plan_save

    try:
        plan_save(None, None)  # a misuse only raydcp itself could make: its own internal error
    except CheckpointError:
        pytest.fail("expected a plain Python error from inside raydcp")
    except Exception as exc:
        failure = RankFailure.from_exception(0, exc)
    err = errors.failures_error("save: plan", [failure])
    assert isinstance(err, RankFailedError) and err.origin == "raydcp"
    assert "internal error in raydcp" in str(err) and "please report" in str(err)
    assert "raised by your code" not in str(err)


def test_user_code_marks_a_library_exception_as_the_users():
    def library_state_dict():  # stands for a state_dict() of an installed package, marked by raydcp
        raise RuntimeError("scheduler not stepped")

    with pytest.raises(RuntimeError) as info:
        with errors.user_code("sched: LambdaLR.state_dict()"):
            library_state_dict()
    origin, where = errors.classify(info.value)
    assert origin == "user" and where.startswith("sched: LambdaLR.state_dict()")


def test_memory_and_os_errors_outside_user_code_are_the_environments():
    assert errors.classify(MemoryError())[0] == "environment"
    assert errors.classify(OSError(28, "No space left on device"))[0] == "environment"
