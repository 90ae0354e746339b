"""Fixtures of the pipeline tests."""
from __future__ import annotations

import pytest


@pytest.fixture
def tiers(tmp_path, s3_server):
    """Two storage tiers (a local directory, then a fresh s3:// prefix) and the S3 options."""
    return [str(tmp_path / "local"), s3_server.new_url()], s3_server.storage_options
