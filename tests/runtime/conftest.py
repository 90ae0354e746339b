"""Fixtures of the ShardGroup tests: the reference state and one saved copy of it per module."""
from __future__ import annotations

import pytest

import raydcp

from ._shards import reference_state


@pytest.fixture(scope="module")
def full():
    """The reference state (a module may override this fixture with another seed)."""
    return reference_state()


@pytest.fixture(scope="module")
def src(tmp_path_factory, full):
    """``full`` saved once for the module, by one participant in-process."""
    path = str(tmp_path_factory.mktemp("src") / "src")
    raydcp.save(full, path)
    return path
