"""The public API's type hints pass a type checker (mypy on pyproject's [tool.mypy] files)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_public_modules_pass_mypy():
    pytest.importorskip("mypy")
    out = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary", "--cache-dir", "/dev/null"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_package_says_it_is_typed():
    assert (ROOT / "raydcp" / "py.typed").is_file()
