"""The save options of the commands that write a raydcp checkpoint: ``raydcp reshard`` and
``raydcp convert --from`` take ``--max-file-bytes`` (and refuse it where nothing raydcp is written)."""
from __future__ import annotations

import pytest
import torch

import raydcp
from raydcp.cli import main

KIB = 1 << 10


def state() -> dict:
    return {f"layer{i}.w": torch.full((64, 64), float(i)) for i in range(6)} | {"step": 3}  # 16 KiB each


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def same(path, sd) -> None:
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}
    raydcp.load(out, path)
    assert all(torch.equal(out[k], v) if isinstance(v, torch.Tensor) else out[k] == v for k, v in sd.items())


def test_reshard_max_file_bytes_caps_the_files(tmp_path, capsys):
    sd = state()
    raydcp.save(sd, tmp_path / "src")
    code, _, err = run(capsys, "reshard", tmp_path / "src", tmp_path / "one", "-M", 1, "--no-progress", "-q")
    assert code == 0, err
    assert len(raydcp.read_metadata(tmp_path / "one").files) == 1
    code, _, err = run(capsys, "reshard", tmp_path / "src", tmp_path / "six", "-M", 1, "--no-progress", "-q",
                       "--max-file-bytes", "20KiB")
    assert code == 0, err
    assert len(raydcp.read_metadata(tmp_path / "six").files) == 6
    same(tmp_path / "six", sd)
    # the earlier spelling still works
    code, _, err = run(capsys, "reshard", tmp_path / "src", tmp_path / "old", "-M", 1, "--no-progress", "-q",
                       "--max-file-size", "40KiB")
    assert code == 0, err
    assert len(raydcp.read_metadata(tmp_path / "old").files) == 3


def test_reshard_refuses_a_tiny_file_cap(tmp_path, capsys):
    raydcp.save(state(), tmp_path / "src")
    code, _, err = run(capsys, "reshard", tmp_path / "src", tmp_path / "dst", "-M", 1, "--max-file-bytes", "10")
    assert code == 2 and "max-file-bytes must be at least 64 bytes" in err


def test_convert_from_writes_with_the_file_cap(tmp_path, capsys):
    sd = state()
    torch.save(sd, tmp_path / "sd.pt")
    code, _, err = run(capsys, "convert", tmp_path / "sd.pt", tmp_path / "ck", "--from", "torch-save",
                       "--no-progress", "--max-file-bytes", "20KiB")
    assert code == 0, err
    assert len(raydcp.read_metadata(tmp_path / "ck").files) == 6
    same(tmp_path / "ck", sd)


def test_convert_to_a_foreign_format_refuses_raydcp_save_flags(tmp_path, capsys):
    raydcp.save(state(), tmp_path / "ck")
    code, _, err = run(capsys, "convert", tmp_path / "ck", tmp_path / "out", "--to", "torch-save",
                       "--max-file-bytes", "1MiB")
    assert code == 2 and "--max-file-bytes applies only to --from" in err


@pytest.mark.parametrize("flag", ["--max-file-bytes"])
def test_the_flags_are_in_the_help(capfd, flag):
    for command in ("reshard", "convert"):
        assert main([command, "--help"]) == 0
        out, err = capfd.readouterr()
        assert flag in out
