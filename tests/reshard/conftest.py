"""Fixtures of the reshard tests: the reference state and one copy of it saved by 2 ranks, per module."""
from __future__ import annotations

import pytest

from tests.reshard.test_reshard import reference_state, save_as_ranks


@pytest.fixture(scope="module")
def full():
    return reference_state()


@pytest.fixture(scope="module")
def src(tmp_path_factory, full):
    path = str(tmp_path_factory.mktemp("reshard") / "src")
    save_as_ranks(full, path, 2)
    return path
