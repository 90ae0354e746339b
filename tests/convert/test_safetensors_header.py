"""`convert --from safetensors` checks a file's header as strictly as the safetensors library does:
every file the library refuses is refused with one line naming the file and the problem (exit
status 2 on the command line), and the files it reads are read alike."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
import safetensors.torch as st
import torch

import raydcp
from raydcp.cli import main
from raydcp.convert import from_safetensors
from raydcp.errors import CheckpointDamagedError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def file_of(header: str, body: bytes = b"") -> bytes:
    raw = header.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw + body


def entry(dtype="F32", shape="[2]", offsets="[0, 8]") -> str:
    return f'{{"dtype": "{dtype}", "shape": {shape}, "data_offsets": {offsets}}}'


# name -> (file content, words of the message); the library refuses each of these files
REFUSED = {
    "duplicate key": (file_of(f'{{"a": {entry()}, "a": {entry(shape="[1]", offsets="[8, 12]")}}}', bytes(12)),
                      "'a' appears twice"),
    "duplicate key, same entry": (file_of(f'{{"a": {entry()}, "b": {entry(offsets="[8, 16]")}, '
                                          f'"a": {entry(offsets="[8, 16]")}}}', bytes(16)), "'a' appears twice"),
    "overlapping offsets": (file_of(f'{{"a": {entry()}, "b": {entry(offsets="[4, 12]")}}}', bytes(12)),
                            "'b': data_offsets [4, 12] overlaps"),
    "gap between tensors": (file_of(f'{{"a": {entry(shape="[1]", offsets="[0, 4]")}, '
                                    f'"b": {entry(shape="[1]", offsets="[8, 12]")}}}', bytes(12)), "'b'"),
    "data after the last tensor": (file_of(f'{{"a": {entry(shape="[1]", offsets="[0, 4]")}}}', bytes(8)),
                                   "file holds 8 bytes of data"),
    "float dimension 4.7": (file_of(f'{{"a": {entry(shape="[4.7]", offsets="[0, 16]")}}}', bytes(16)),
                            "shape [4.7]"),
    "float dimension 2.0": (file_of(f'{{"a": {entry(shape="[2.0]")}}}', bytes(8)), "shape [2.0]"),
    "bool dimension": (file_of(f'{{"a": {entry(shape="[true]", offsets="[0, 4]")}}}', bytes(4)), "shape [true]"),
    "negative zero offset": (file_of(f'{{"a": {entry(shape="[0]", offsets="[-0, 0]")}}}'), "data_offsets"),
    "float offset": (file_of(f'{{"a": {entry(offsets="[0, 8.0]")}}}', bytes(8)), "data_offsets [0, 8.0]"),
    "three offsets": (file_of(f'{{"a": {entry(offsets="[0, 8, 8]")}}}', bytes(8)), "data_offsets [0, 8, 8]"),
    "lone surrogate key": (file_of(f'{{"\\ud800": {entry(shape="[1]", offsets="[0, 4]")}}}', bytes(4)),
                           "surrogate"),
    "deep nesting": (file_of('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"), "nested more than 128"),
    "nesting past 128 in an ignored member": (
        file_of('{"a": {"dtype": "F32", "shape": [], "data_offsets": [0, 4], "x": ' + "[" * 130 + "]" * 130
                + "}}", bytes(4)), "nested more than 128"),
    "Infinity offset": (file_of(f'{{"a": {entry(offsets="[0, Infinity]")}}}', bytes(8)), "Infinity"),
    "NaN dimension": (file_of(f'{{"a": {entry(shape="[NaN]")}}}', bytes(8)), "NaN"),
    "1e30 dimension": (file_of(f'{{"a": {entry(shape="[0, 1e30]", offsets="[0, 0]")}}}'), "shape [0, 1e+30]"),
    "2**64 dimension": (file_of(f'{{"a": {entry(shape=f"[0, {2**64}]", offsets="[0, 0]")}}}'), "shape [0, "),
    "unknown dtype": (file_of(f'{{"a": {entry(dtype="F33")}}}', bytes(8)), "unknown dtype 'F33'"),
    "missing shape": (file_of('{"a": {"dtype": "F32", "data_offsets": [0, 4]}}', bytes(4)), "no shape"),
    "metadata not strings": (file_of(f'{{"__metadata__": {{"x": 1}}, "a": {entry()}}}', bytes(8)), "__metadata__"),
    "not an object": (file_of("[1, 2]"), "JSON list"),
    "trailing characters": (file_of(f'{{"a": {entry()}}} x', bytes(8)), "not valid JSON"),
    "not UTF-8": (struct.pack("<Q", 3) + b"{\xff}", "not UTF-8"),
    "header past the end": (struct.pack("<Q", 1000) + b"{}", "past the end"),
    "too short": (b"\x01\x00", "shorter than the 8-byte"),
    "shape overflowing 64 bits": (file_of(f'{{"a": {entry(shape=f"[{2**40}, {2**40}, 0]", offsets="[0, 0]")}}}'),
                                  "spans more than 2**63 bytes"),
    "bytes the shape does not need": (file_of(f'{{"a": {entry(shape="[1]", offsets="[0, 8]")}}}', bytes(8)),
                                      "needs 4 bytes"),
}

# files the library refuses when it builds numpy arrays of them (larger than int64 bytes), not torch tensors
TOO_LARGE = {
    "[0, 2**62] float32": (file_of(f'{{"a": {entry(shape=f"[0, {2**62}]", offsets="[0, 0]")}}}'),
                           "spans more than 2**63 bytes"),
}


def write(tmp_path, content: bytes, name: str = "model.safetensors") -> str:
    path = tmp_path / name
    path.write_bytes(content)
    return str(path)


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_like_the_library(tmp_path, case):
    content, words = REFUSED[case]
    path = write(tmp_path, content)
    with pytest.raises(Exception):  # the reference refuses it too
        st.load_file(path)
    with pytest.raises(CheckpointDamagedError) as info:
        from_safetensors(path, tmp_path / "out")
    message = str(info.value)
    assert message.startswith(f"{path}: damaged or not a safetensors file: ") and words in message
    assert "\n" not in message and info.value.file == path
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", sorted(TOO_LARGE))
def test_shapes_beyond_int64_bytes_are_refused(tmp_path, case):
    import safetensors.numpy

    content, words = TOO_LARGE[case]
    path = write(tmp_path, content)
    with pytest.raises(ValueError, match="too big"):
        safetensors.numpy.load_file(path)
    with pytest.raises(CheckpointDamagedError) as info:
        from_safetensors(path, tmp_path / "out")
    assert words in str(info.value) and info.value.key == "a"


def test_headers_the_library_reads_are_read_alike(tmp_path):
    """Padding, offsets out of key order, a null __metadata__, members it ignores, an empty name,
    empty tensors: read, with the same values as the library reads."""
    a, b = torch.arange(3, dtype=torch.float32), torch.tensor([7, -1], dtype=torch.int64)
    body = a.numpy().tobytes() + b.numpy().tobytes()
    header = ('  {"__metadata__": null, "b": {"dtype": "I64", "shape": [2], "data_offsets": [12, 28], "note": [1]},'
              ' "": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},'
              ' "z": {"dtype": "F16", "shape": [0, 5], "data_offsets": [28, 28]}}   ')
    path = write(tmp_path, file_of(header, body))
    want = st.load_file(path)
    from_safetensors(path, tmp_path / "out")
    got = {k: torch.empty_like(v) for k, v in want.items()}
    raydcp.load(got, str(tmp_path / "out"))
    assert set(got) == {"", "b", "z"}
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k])


def test_a_file_written_by_the_library_with_metadata(tmp_path):
    tensors = {"w": torch.randn(3, 4), "m": torch.ones(5, dtype=torch.bfloat16), "e": torch.empty(0)}
    path = str(tmp_path / "m.safetensors")
    st.save_file(tensors, path, metadata={"format": "pt", "x": "y"})
    result = from_safetensors(path, tmp_path / "out")
    assert result.tensors == 3
    got = {k: torch.empty_like(v) for k, v in tensors.items()}
    raydcp.load(got, str(tmp_path / "out"))
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)


def test_a_malformed_index_is_refused(tmp_path):
    st.save_file({"w": torch.ones(2)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(CheckpointDamagedError, match="model.safetensors.index.json: not valid JSON"):
        from_safetensors(str(tmp_path), tmp_path / "out")


@pytest.mark.parametrize("case", ["duplicate key", "deep nesting", "Infinity offset", "1e30 dimension"])
def test_command_line_exits_2_with_one_line(tmp_path, capsys, case):
    path = write(tmp_path, REFUSED[case][0])
    code = main(["convert", path, str(tmp_path / "out"), "--from", "safetensors", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert err.count("\n") == 1 and path in err and REFUSED[case][1] in err


def test_console_script_exits_2(tmp_path):
    """The installed `raydcp` entry point, as users run it, on files that used to end in exit status 3."""
    script = os.path.join(os.path.dirname(sys.executable), "raydcp")
    assert os.path.exists(script), "raydcp is not installed in this environment (pip install -e .)"
    for case in ("deep nesting", "Infinity offset", "1e30 dimension", "float dimension 4.7"):
        path = write(tmp_path, REFUSED[case][0], f"{case.replace(' ', '_')}.safetensors")
        proc = subprocess.run([script, "convert", path, str(tmp_path / "out"), "--from", "safetensors",
                               "--no-progress"], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, (case, proc.stderr)
        assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
        assert path in proc.stderr and REFUSED[case][1] in proc.stderr
    assert not (tmp_path / "out").exists()


def test_header_parser_names_every_problem():
    """The parser alone (no file system): the dedicated cases of the data layout."""
    from raydcp.convert._st_header import parse_header

    entries, meta, start = parse_header(file_of(f'{{"__metadata__": {{"k": "v"}}, "b": '
                                                f'{entry(offsets="[8, 16]")}, "a": {entry()}}}', bytes(16)), "f")
    assert [e.name for e in entries] == ["a", "b"] and meta == {"k": "v"}
    assert start == len(file_of(f'{{"__metadata__": {{"k": "v"}}, "b": {entry(offsets="[8, 16]")}, '
                                f'"a": {entry()}}}'))
    with pytest.raises(CheckpointDamagedError, match="'a': data_offsets \\[8, 4\\] ends before it begins"):
        parse_header(file_of(f'{{"z": {entry(shape="[2]", offsets="[0, 8]")}, "a": '
                             f'{entry(shape="[0]", offsets="[8, 4]")}}}', bytes(8)), "f")
    with pytest.raises(CheckpointDamagedError, match="more than the format's limit"):
        parse_header(struct.pack("<Q", 100_000_001) + b"{}", "f")
    assert json.loads(json.dumps({"ok": 1}))  # the standard reader is left as it is
