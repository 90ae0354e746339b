"""The coordinator's process keeps the memory a plan frees for the next plan
(``raydcp.runtime.coordinator.keep_planning_memory``, called by ``planning_pages`` where the
coordinator's host starts); other processes are left as they are."""
from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's mallopt")

_FREED = """
import sys
import numpy as np
from raydcp.runtime.coordinator import planning_pages

def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

if sys.argv[1] == "coordinator":
    planning_pages()  # what the coordinator's host runs where it starts
block = np.ones(4 << 20)  # 32 MiB, every page touched, as a plan's arrays are
before = resident()
del block
print(before - resident())
"""


def _returned_bytes(kind: str) -> int:
    out = subprocess.run([sys.executable, "-c", _FREED, kind], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def test_freed_planning_arrays_stay_with_the_coordinator_and_go_back_elsewhere():
    assert _returned_bytes("default") >= 24 << 20  # an ordinary process unmaps a freed 32 MiB array
    assert _returned_bytes("coordinator") < 4 << 20  # the coordinator's keeps it for its next plan
