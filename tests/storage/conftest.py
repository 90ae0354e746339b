"""Fixtures of the storage conformance suite: every test runs on each backend of
``storage_backend`` (tests/fixtures_s3.py): memory://, file://, a plain local path, s3:// (moto)."""
from __future__ import annotations

import pytest
from fsspec.implementations.local import LocalFileSystem

from raydcp.storage import CheckpointStorage


@pytest.fixture
def backend(storage_backend):
    """``(url, storage_options)`` of a fresh directory, usable as a checkpoint or a root."""
    return storage_backend


@pytest.fixture
def storage(backend) -> CheckpointStorage:
    url, options = backend
    return CheckpointStorage(url, options)


@pytest.fixture
def read_meter(monkeypatch):
    """Counts the bytes a CheckpointStorage fetches from its filesystem while reading ranges."""

    def attach(storage: CheckpointStorage) -> list[int]:
        fetched: list[int] = []
        if isinstance(storage.fs, LocalFileSystem):
            import raydcp.storage.fs as fs_module  # binds pread_into by name

            real = fs_module.pread_into

            def counting_pread(fd, view, offset):
                n = real(fd, view, offset)
                fetched.append(n)
                return n

            monkeypatch.setattr(fs_module, "pread_into", counting_pread)
        else:
            real = storage.fs.cat_ranges

            def counting_cat_ranges(paths, starts, ends, **kwargs):
                out = real(paths, starts, ends, **kwargs)
                fetched.extend(len(b) for b in out)
                return out

            monkeypatch.setattr(storage.fs, "cat_ranges", counting_cat_ranges)
        return fetched

    return attach
