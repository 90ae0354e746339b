"""The `raydcp` command line: inspect, verify and diff on good and damaged checkpoints.

Commands run in-process through raydcp.cli.main (fast); one test runs the installed console script.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
import torch

import raydcp
from raydcp.cli import main
from raydcp.cli._registry import Command, _COMMANDS
from raydcp.storage import METADATA_NAME
from raydcp.verify import verify_checkpoint


def state(scale: float = 1.0) -> dict:
    return {
        "model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4) * scale,
                  "b": torch.linspace(-1, 1, 5, dtype=torch.bfloat16)},
        "ids": torch.arange(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 3),
        "step": 42,
        "name": "run-a",
        "lrs": [0.1, 0.01],
    }


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "ck"
    md = raydcp.save(state(), path)
    return str(path), md


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def data_path(path: str, md, key: str):
    chunk = md.tensors[key].chunks[0]
    return os.path.join(path, chunk.file), chunk


def flip_byte(path, md, key="model.w"):
    file, chunk = data_path(path, md, key)
    with open(file, "r+b") as f:
        f.seek(chunk.byte_offset + 5)
        b = f.read(1)
        f.seek(chunk.byte_offset + 5)
        f.write(bytes([b[0] ^ 0x01]))
    return chunk.file


def truncate(path, md, key="ids"):
    file, chunk = data_path(path, md, key)
    with open(file, "r+b") as f:
        f.truncate(chunk.byte_offset + 3)
    return chunk.file


def delete(path, md):
    file, chunk = data_path(path, md, "ids")
    os.remove(file)
    return chunk.file


def garbage_metadata(path, md):
    with open(os.path.join(path, METADATA_NAME), "wb") as f:
        f.write(b"this is not metadata at all, just some garbage bytes" * 3)
    return METADATA_NAME


def unknown_version(path, md):
    meta = os.path.join(path, METADATA_NAME)
    data = bytearray(open(meta, "rb").read())
    struct.pack_into("<I", data, 8, 99)  # the major version, right after the 8-byte magic
    open(meta, "wb").write(bytes(data))
    return "version 99"


def missing_metadata(path, md):
    os.remove(os.path.join(path, METADATA_NAME))
    return METADATA_NAME


DAMAGE = [flip_byte, truncate, delete, garbage_metadata, unknown_version, missing_metadata]


def test_inspect_table(ckpt, capsys):
    path, md = ckpt
    code, out, err = run(capsys, "inspect", path)
    assert code == 0 and err == ""
    for text in ("model.w", "[3, 4]", "float32", "model.b", "bfloat16", "mask", "bool", "empty", "[0, 3]",
                 "step", "42", "'run-a'", "format version 1.0", md.save_id, "saved by world size 1",
                 f"{md.total_bytes:,}", "total (5 tensors)"):
        assert text in out, text


def test_inspect_json(ckpt, capsys):
    path, md = ckpt
    code, out, _ = run(capsys, "inspect", path, "--json")
    doc = json.loads(out)
    assert code == 0
    assert doc["format_version"] == "1.0" and doc["save_id"] == md.save_id and doc["world_size"] == 1
    assert doc["total_bytes"] == md.total_bytes == sum(t["bytes"] for t in doc["tensors"].values())
    assert doc["tensors"]["model.w"] == {"shape": [3, 4], "dtype": "float32", "pieces": 1, "bytes": 48,
                                         "files": [md.tensors["model.w"].chunks[0].file]}
    assert doc["values"] == {"lrs": [0.1, 0.01], "name": "run-a", "step": 42}


def test_verify_intact(ckpt, capsys):
    code, out, err = run(capsys, "verify", ckpt[0])
    assert code == 0 and out.startswith("OK: ") and "intact" in out and err == ""
    code, out, _ = run(capsys, "verify", ckpt[0], "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and doc["problems"] == [] and doc["pieces_checked"] == 4  # "empty": no bytes


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__)
def test_verify_names_the_damage(ckpt, capsys, damage):
    path, md = ckpt
    named = damage(path, md)
    code, out, err = run(capsys, "verify", path)
    assert code == 1 and out == ""
    assert "DAMAGED" in err and named in err
    assert "Traceback" not in err
    code, out, _ = run(capsys, "verify", path, "--json")
    doc = json.loads(out)
    assert code == 1 and not doc["ok"] and doc["problems"]


@pytest.mark.parametrize("damage", [garbage_metadata, unknown_version, missing_metadata], ids=lambda f: f.__name__)
def test_unreadable_metadata_is_one_line_error_for_other_commands(ckpt, tmp_path, capsys, damage):
    path, md = ckpt
    named = damage(path, md)
    for argv in (["inspect", path], ["diff", path, path], ["convert", path, tmp_path / "out", "--to", "torch-save"]):
        code, out, err = run(capsys, *argv)
        assert code == 2, argv
        assert err.startswith("raydcp: error: ") and err.count("\n") == 1 and named in err
        assert "Traceback" not in err


def test_verify_collects_every_problem(ckpt):
    path, md = ckpt
    # one data file holds ids, mask, model.b, model.w in that order: flip ids, cut into model.b
    flip_byte(path, md, "ids")
    truncate(path, md, "model.b")
    report = verify_checkpoint(path)
    chunk = md.tensors["ids"].chunks[0]
    assert [(p.kind, p.key) for p in report.problems] == [
        ("checksum", "ids"), ("truncated", "model.b"), ("truncated", "model.w")]
    assert report.problems[0].file == chunk.file
    assert report.problems[0].byte_range == (chunk.byte_offset, chunk.byte_offset + chunk.nbytes)
    assert report.damaged_keys == ["ids", "model.b", "model.w"] and not report.ok


def test_verify_streams_large_pieces_in_blocks(tmp_path):
    path = tmp_path / "big"
    md = raydcp.save({"x": torch.randn(1000), "y": torch.randn(10)}, path)
    assert verify_checkpoint(path, block_bytes=128).ok  # 4000-byte piece read in 128-byte blocks
    flip_byte_at = md.tensors["x"].chunks[0]
    with open(path / flip_byte_at.file, "r+b") as f:
        f.seek(flip_byte_at.byte_offset + 3001)
        f.write(b"\x00\x00")
    report = verify_checkpoint(path, block_bytes=128)
    assert [(p.kind, p.key) for p in report.problems] == [("checksum", "x")]


def test_pieces_that_leave_a_gap(ckpt, tmp_path, capsys):
    """Metadata whose pieces do not cover a tensor: verify names it, exports refuse it."""
    import dataclasses

    from raydcp.metadata import TensorMeta
    from raydcp.metadata_format import encode_metadata
    from raydcp.storage import CheckpointStorage

    path, md = ckpt
    w = md.tensors["model.w"]
    half = dataclasses.replace(w.chunks[0], sizes=(1, 4), nbytes=16)
    CheckpointStorage(path).commit(encode_metadata(dataclasses.replace(
        md, tensors={**md.tensors, "model.w": TensorMeta(w.dtype, w.shape, (half,))})))
    code, _, err = run(capsys, "verify", path)
    assert code == 1 and "model.w: pieces cover 4 of 12 elements" in err
    code, _, err = run(capsys, "convert", path, tmp_path / "st", "--to", "safetensors")
    assert code == 2 and "model.w" in err and "raydcp verify" in err


def test_diff(tmp_path, capsys):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    raydcp.save(state(), a)
    raydcp.save(state(), b)
    changed = state(scale=1.001)
    changed["step"] = 43
    changed["extra"] = torch.ones(2)
    del changed["mask"]
    raydcp.save(changed, c)
    code, out, _ = run(capsys, "diff", a, b)
    assert code == 0 and "identical" in out
    code, out, _ = run(capsys, "diff", a, c)
    assert code == 1
    assert "only in" in out and "mask" in out and "extra" in out and "model.w" in out and "step" in out
    code, out, _ = run(capsys, "diff", a, c, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["only_in_a"] == ["mask"] and doc["only_in_b"] == ["extra"]
    assert set(doc["different"]) == {"model.w", "step"}
    assert doc["different"]["model.w"]["max_abs_diff"] == pytest.approx(0.011, rel=1e-3)
    # within tolerance the tensors agree; the keys and the plain value still differ
    code, out, _ = run(capsys, "diff", a, c, "--rtol", "0.01", "--json")
    assert code == 1 and set(json.loads(out)["different"]) == {"step"}


def test_diff_nan_and_signed_zero(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    raydcp.save({"x": torch.tensor([float("nan"), 0.0, 1.0])}, a)
    raydcp.save({"x": torch.tensor([float("nan"), -0.0, 1.0])}, b)
    code, out, _ = run(capsys, "diff", a, a)
    assert code == 0  # NaN with the same bits is the same
    code, out, _ = run(capsys, "diff", a, b, "--json")
    assert code == 1 and json.loads(out)["different"]["x"]["max_abs_diff"] == 0.0  # bits differ
    code, _, _ = run(capsys, "diff", a, b, "--atol", "1e-12")
    assert code == 0


def test_errors_are_one_line_with_status_2(tmp_path, capsys):
    missing = tmp_path / "nope"
    for argv in (["inspect", missing], ["diff", missing, missing],
                 ["convert", missing, tmp_path / "x", "--to", "safetensors"],
                 ["inspect", tmp_path, "--storage-options", "{not json"]):
        code, out, err = run(capsys, *argv)
        assert code == 2, argv
        assert err.startswith("raydcp: error: ") and err.count("\n") == 1 and "Traceback" not in err
    code, _, err = run(capsys, "convert", "a", "b")  # neither --to nor --from: argparse usage error
    assert code == 2 and "usage" in err


def test_unexpected_errors_are_one_line_too(capsys, monkeypatch):
    def boom(args):
        raise RuntimeError("kaput")

    monkeypatch.setitem(_COMMANDS, "boom", Command("boom", "fails", lambda p: None, boom))
    code, _, err = run(capsys, "boom")
    assert code == 3 and "RuntimeError" in err and "kaput" in err and "--debug" in err and err.count("\n") == 1
    with pytest.raises(RuntimeError):
        main(["--debug", "boom"])


def test_help_lists_the_registered_commands(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for name in ("inspect", "verify", "convert", "diff"):
        assert name in out


def test_console_script(ckpt, tmp_path):
    """The installed `raydcp` entry point, as users run it."""
    script = os.path.join(os.path.dirname(sys.executable), "raydcp")
    assert os.path.exists(script), "raydcp is not installed in this environment (pip install -e .)"
    path, md = ckpt
    good = subprocess.run([script, "inspect", path, "--json"], capture_output=True, text=True, timeout=120)
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout)["save_id"] == md.save_id
    named = flip_byte(path, md)
    bad = subprocess.run([script, "verify", path], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and named in bad.stderr and "checksum mismatch" in bad.stderr
    assert "Traceback" not in bad.stderr
