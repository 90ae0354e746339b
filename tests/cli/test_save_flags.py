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


def compressible() -> dict:
    return {f"layer{i}.w": torch.arange(64 * 64, dtype=torch.int32).reshape(64, 64) % (i + 2) for i in range(4)} | {
        "step": 5}


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_reshard_compresses_and_reads_compressed_sources(tmp_path, capsys, codec):
    sd = compressible()
    raydcp.save(sd, tmp_path / "src")
    code, _, err = run(capsys, "reshard", tmp_path / "src", tmp_path / "packed", "-M", 2, "--no-progress", "-q",
                       "--compression", codec)
    assert code == 0, err
    md = raydcp.read_metadata(tmp_path / "packed")
    assert md.compressions == {codec: 8} and md.version == (2, 0) and md.world_size == 2
    same(tmp_path / "packed", sd)
    # and back: a compressed source, resharded N -> M into raw pieces
    code, _, err = run(capsys, "reshard", tmp_path / "packed", tmp_path / "raw", "-M", 3, "--no-progress", "-q",
                       "--compression", "none")
    assert code == 0, err
    md = raydcp.read_metadata(tmp_path / "raw")
    assert md.compressions == {} and md.version == (1, 0)
    same(tmp_path / "raw", sd)
    code, out, err = run(capsys, "verify", tmp_path / "packed")
    assert code == 0 and "intact" in out, err
    code, out, err = run(capsys, "inspect", tmp_path / "packed")
    assert code == 0 and f"compressed: 8 pieces {codec}" in " ".join(out.split()), err


def test_convert_compresses_what_it_imports_and_exports_compressed_checkpoints(tmp_path, capsys):
    sd = compressible()
    torch.save(sd, tmp_path / "sd.pt")
    code, _, err = run(capsys, "convert", tmp_path / "sd.pt", tmp_path / "ck", "--from", "torch-save",
                       "--no-progress", "--compression", "zstd")
    assert code == 0, err
    assert raydcp.read_metadata(tmp_path / "ck").compressions == {"zstd": 4}
    same(tmp_path / "ck", sd)
    code, _, err = run(capsys, "convert", tmp_path / "ck", tmp_path / "out.pt", "--to", "torch-save", "--no-progress")
    assert code == 0, err
    back = torch.load(tmp_path / "out.pt", weights_only=True)
    assert all(torch.equal(back[k], v) for k, v in sd.items() if isinstance(v, torch.Tensor))
    code, _, err = run(capsys, "convert", tmp_path / "ck", tmp_path / "out2", "--to", "safetensors",
                       "--compression", "lz4")
    assert code == 2 and "--compression applies only to --from" in err


def test_verify_exits_non_zero_on_a_damaged_compressed_piece(tmp_path, capsys):
    raydcp.save(compressible(), tmp_path / "ck", options=raydcp.SaveOptions(compression="lz4"))
    c = raydcp.read_metadata(tmp_path / "ck").tensors["layer2.w"].chunks[0]
    assert c.compression == "lz4"
    with open(tmp_path / "ck" / c.file, "r+b") as f:
        f.seek(c.byte_offset + c.stored_length - 1)
        b = f.read(1)
        f.seek(c.byte_offset + c.stored_length - 1)
        f.write(bytes([b[0] ^ 0x01]))
    code, out, err = run(capsys, "verify", tmp_path / "ck")
    assert code != 0 and "layer2.w" in out + err and c.file in out + err


def test_the_compression_flag_is_in_the_help(capfd):
    for command in ("reshard", "convert"):
        assert main([command, "--help"]) == 0
        assert "--compression {none,zstd,lz4}" in " ".join(capfd.readouterr().out.split())
