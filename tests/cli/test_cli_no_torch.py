"""inspect, verify, ls and diff read raydcp checkpoints without torch: the installed console script
runs them with torch made unimportable, and diff's numpy decoding of every stored dtype agrees
with torch's."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import raydcp
from raydcp.cli._arrays import compare_arrays, numeric
from raydcp.codec import DTYPES, itemsize

SCRIPT = os.path.join(os.path.dirname(sys.executable), "raydcp")

# Imported by Python at start-up (a directory on PYTHONPATH wins over site-packages): any import
# of torch in the process fails, and pandas (which pyarrow imports for some conversions, a second
# of start-up) is reported at exit.
_BLOCKER = '''
import atexit
import sys

class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ImportError(f"{name} imported by a command that should not need torch")

sys.meta_path.insert(0, _NoTorch())
atexit.register(lambda: "pandas" in sys.modules and sys.stderr.write("pandas was imported\\n"))
'''


def _state(scale: float) -> dict:
    return {
        "model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4) * scale,
                  "b": torch.linspace(-1, 1, 5, dtype=torch.bfloat16) * scale},
        "f8": (torch.linspace(-4, 4, 9) * scale).to(torch.float8_e4m3fn),
        "c": torch.tensor([1 + 2j, -3j], dtype=torch.complex64) * scale,
        "ids": torch.arange(7, dtype=torch.int64),
        "scalar": torch.tensor(3.5),
        "step": 3,
    }


def _no_torch(tmp_path, *argv) -> subprocess.CompletedProcess:
    site = tmp_path / "no-torch-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([SCRIPT, *map(str, argv)], capture_output=True, text=True, timeout=120, env=env)


def test_the_blocker_blocks(tmp_path):
    """The set-up itself: a command that does need torch fails under it."""
    raydcp.save(_state(1.0), tmp_path / "a")
    proc = _no_torch(tmp_path, "convert", tmp_path / "a", tmp_path / "out", "--to", "torch-save", "--no-progress")
    assert proc.returncode != 0 and "should not need torch" in proc.stderr


def test_inspect_verify_ls_diff_need_no_torch(tmp_path):
    a, b = tmp_path / "run" / "a", tmp_path / "run" / "b"
    raydcp.save(_state(1.0), a)
    raydcp.save(_state(1.001), b)
    md = raydcp.read_metadata(a)

    proc = _no_torch(tmp_path, "inspect", a, "--json")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert json.loads(proc.stdout)["save_id"] == md.save_id

    proc = _no_torch(tmp_path, "verify", a)
    assert proc.returncode == 0 and "every checksum matches" in proc.stdout and proc.stderr == "", proc.stderr

    proc = _no_torch(tmp_path, "ls", tmp_path, "--json")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    rows = json.loads(proc.stdout)["checkpoints"]
    assert sorted(r["name"] for r in rows) == ["run/a", "run/b"] and {r["step"] for r in rows} == {3}

    proc = _no_torch(tmp_path, "diff", a, a, "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["identical"], proc.stderr

    proc = _no_torch(tmp_path, "diff", a, b, "--json")
    assert proc.returncode == 1, proc.stderr
    different = json.loads(proc.stdout)["different"]
    assert set(different) == {"model.w", "c"}  # bfloat16 and float8 round x1.001 back to the same values
    assert different["model.w"]["max_abs_diff"] == pytest.approx(0.011, rel=1e-3)
    raydcp.save(_state(2.0), tmp_path / "twice")
    proc = _no_torch(tmp_path, "diff", a, tmp_path / "twice", "--json")
    different = json.loads(proc.stdout)["different"]
    assert proc.returncode == 1 and set(different) == {"model.w", "model.b", "f8", "c"}, proc.stderr
    assert different["model.b"]["max_abs_diff"] == 1.0 and different["f8"]["max_abs_diff"] == 4.0

    proc = _no_torch(tmp_path, "diff", a, b, "--rtol", "0.01", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["identical"] and proc.stderr == "", proc.stderr

    # damage is still found, and named, without torch
    chunk = md.tensors["model.w"].chunks[0]
    with open(os.path.join(a, chunk.file), "r+b") as f:
        f.seek(chunk.byte_offset + 1)
        f.write(b"\xee")
    proc = _no_torch(tmp_path, "verify", a)
    assert proc.returncode == 1 and "model.w" in proc.stderr and "checksum mismatch" in proc.stderr
    proc = _no_torch(tmp_path, "diff", a, b)
    assert proc.returncode == 2 and "model.w" in proc.stderr and "fails its checksum" in proc.stderr


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_numpy_decoding_matches_torch(name):
    """Every byte pattern of the float8 kinds, random bytes of the other dtypes."""
    dtype = DTYPES[name]
    size = itemsize(name)
    if size == 1:
        raw = np.arange(256, dtype=np.uint8)
    else:
        raw = np.random.default_rng(0).integers(0, 256, size=64 * size, dtype=np.uint8)
    t = torch.from_numpy(raw.copy()).view(dtype)
    got = numeric(raw.reshape(-1, size), name)
    if dtype.is_complex:
        want = t.to(torch.complex128).numpy()
    elif dtype == torch.float64:
        want = t.numpy()
    elif dtype.is_floating_point:
        want = t.to(torch.float32).numpy()
    else:
        want = t.to(torch.float64).numpy()
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)  # NaNs in the same places, every other value exact


def test_compare_arrays_bits_and_tolerances():
    def raw(values, dtype=torch.float32):
        t = torch.tensor(values, dtype=dtype)
        return t.view(torch.uint8).numpy().reshape(*t.shape, t.element_size())

    nan = float("nan")
    assert compare_arrays(raw([1.0, nan]), raw([1.0, nan]), "float32", 0, 0) == (True, 0.0)
    assert compare_arrays(raw([0.0]), raw([-0.0]), "float32", 0, 0) == (False, 0.0)  # the bits differ
    assert compare_arrays(raw([0.0]), raw([-0.0]), "float32", 0, 1e-12) == (True, 0.0)
    assert compare_arrays(raw([1.0]), raw([nan]), "float32", 0.1, 0.1) == (False, float("inf"))
    equal, diff = compare_arrays(raw([100.0], torch.bfloat16), raw([101.0], torch.bfloat16), "bfloat16", 0.01, 0)
    assert equal and diff == 1.0
    assert compare_arrays(raw([100.0], torch.bfloat16), raw([102.0], torch.bfloat16), "bfloat16", 0.01, 0)[0] is False
