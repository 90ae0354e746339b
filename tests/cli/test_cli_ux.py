"""The command line as a user meets it: a fast --help without torch, `raydcp ls`, progress
switches, exit statuses, neighbour formats recognised, and names escaped for the terminal."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import raydcp
from raydcp import CheckpointError
from raydcp.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_help_and_version_import_no_torch():
    """Every help text is built with torch (and numpy, pyarrow, ray) made unimportable."""
    script = textwrap.dedent("""
        import sys
        BLOCKED = ("torch", "numpy", "pyarrow", "ray")

        class Blocker:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"{name} imported while building the command line")

        sys.meta_path.insert(0, Blocker())
        from raydcp.cli import main, build_parser
        codes = [main(["--help"]), main(["--version"])]
        names = sorted(build_parser()._subparsers._group_actions[0].choices)
        codes += [main([name, "--help"]) for name in names]
        assert [m for m in sys.modules if m.split(".")[0] in BLOCKED] == [], "heavy import"
        print("CODES", codes, names)
    """)
    env = {**os.environ, "PYTHONPATH": _ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("CODES"))
    assert line.startswith("CODES [0, 0, 0") and set(line.split("]")[0].removeprefix("CODES [").split(", ")) == {"0"}
    for name in ("inspect", "verify", "diff", "convert", "reshard", "status", "ls"):
        assert f"'{name}'" in line
    assert "raydcp 0." in proc.stdout  # --version


@pytest.fixture
def root(tmp_path):
    from raydcp.pipeline.record_files import write_record
    from raydcp.pipeline.status import StatusRecord, TierCopy, plan_stages
    from raydcp.storage import CheckpointStorage

    r = tmp_path / "run"
    raydcp.save({"model": {"w": torch.ones(256)}, "step": 10}, r / "ckpt-a")          # step from the value
    raydcp.save({"model": {"w": torch.ones(512), "b": torch.ones(2)}}, r / "step-20")  # no step saved: none
    raydcp.save({"w": torch.ones(4)}, r / "p")                                        # step from the record
    stages = plan_stages(1, verify=False, export_tier=None, hooks=[], retention_tiers=[])
    for e in stages:
        e.state = "done"
    write_record(CheckpointStorage(r / "p"), StatusRecord(name="p", seq=1, tiers=[TierCopy(str(r / "p"))],
                                                          stages=stages, step=30))
    (r / "not-committed" / "data").mkdir(parents=True)
    (r / "not-committed" / "data" / "x.bin").write_bytes(b"123")
    return r


def test_ls_lists_committed_checkpoints(root, capsys):
    code, out, err = run(capsys, "ls", root, "--json")
    assert code == 0 and err == ""
    rows = {r["name"]: r for r in json.loads(out)["checkpoints"]}
    assert sorted(rows) == ["ckpt-a", "p", "step-20"]  # the uncommitted directory is not listed
    assert [rows[n]["step"] for n in ("ckpt-a", "step-20", "p")] == [10, None, 30]  # never digits of a name
    assert rows["step-20"]["tensors"] == 2 and rows["step-20"]["bytes"] == (512 + 2) * 4
    assert rows["p"]["pipeline_state"] == "complete" and rows["ckpt-a"]["pipeline_state"] is None
    # the counts are the ones inspect gives
    code, out, _ = run(capsys, "inspect", root / "step-20", "--json")
    doc = json.loads(out)
    assert len(doc["tensors"]) == rows["step-20"]["tensors"] and doc["total_bytes"] == rows["step-20"]["bytes"]
    assert sum(t["pieces"] for t in doc["tensors"].values()) == rows["step-20"]["pieces"]

    code, out, err = run(capsys, "ls", root)
    assert code == 0
    for name, size in (("ckpt-a", "1.0 KiB"), ("step-20", "2.0 KiB"), ("p", "16 B")):
        line = next(x for x in out.splitlines() if f" {name} " in x)
        assert size in line
    assert "complete" in out and "3 committed checkpoints" in out

    code, out, err = run(capsys, "ls", root / "step-20" / "data")  # a directory without checkpoints
    assert code == 0 and "no committed checkpoints" in out


@pytest.mark.parametrize("argv", [("ls", "{p}"), ("verify", "{p}"), ("inspect", "{p}"), ("diff", "{p}", "{p}"),
                                  ("convert", "{p}", "{p}-out", "--to", "safetensors"),
                                  ("reshard", "{p}", "{p}-out", "-M", "2")])
def test_missing_path_exits_2(tmp_path, capsys, argv):
    missing = tmp_path / "no-such-checkpoint"
    code, out, err = run(capsys, *[a.format(p=missing) for a in argv])
    assert code == 2 and out == "" and err.startswith("raydcp: error: ") and err.count("\n") == 1
    assert str(missing) in err and "Traceback" not in err


def test_no_progress_and_counts_agree(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    raydcp.save({"w": torch.arange(10.0), "e": torch.empty(0), "v": 1}, a)
    raydcp.save({"w": torch.arange(10.0), "e": torch.empty(0), "v": 1}, b)
    code, out, err = run(capsys, "verify", a, "--no-progress")
    assert code == 0 and err == "" and "2 tensors in 1 pieces" in out and "40 B" in out  # the empty one has none
    code, out, _ = run(capsys, "inspect", a)
    assert "2 tensors in 1 pieces" in out
    code, out, err = run(capsys, "diff", a, b, "--no-progress")
    assert code == 0 and err == "" and "the same 3 keys" in out
    code, out, _ = run(capsys, "verify", a, "--json")
    doc = json.loads(out)
    assert doc["tensors"] == 2 and doc["pieces"] == 1 and doc["bytes_checked"] == 40


def test_progress_bar_prints_logs_above_the_bar(monkeypatch):
    """On a terminal the bar is drawn (transient) and messages go through its console."""
    import io

    from rich.console import Console

    from raydcp.cli import _common

    buf = io.StringIO()
    monkeypatch.setattr(_common, "Console", lambda **kw: Console(file=buf, force_terminal=True, width=100))
    with _common.progress_bar("verify") as progress:
        progress(5, 10)
        progress.log("round 1/2: \x1b[2Jdone")
    text = buf.getvalue()
    assert "round 1/2: \\x1b[2Jdone" in text and "\x1b[2J" not in text
    with _common.progress_bar("verify", enabled=False) as progress:  # --no-progress: nothing drawn
        progress(5, 10)
    assert buf.getvalue() == text


def _dcp_checkpoint(path):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(3)}, checkpoint_id=str(path))


def _safetensors_folder(path, index: bool):
    from safetensors.torch import save_file

    path.mkdir()
    save_file({"w": torch.ones(3)}, str(path / "model-00001-of-00001.safetensors"))
    if index:
        index = {"weight_map": {"w": "model-00001-of-00001.safetensors"}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))


NEIGHBOURS = {
    "torch-dcp": (lambda p: _dcp_checkpoint(p), "torch.distributed.checkpoint", "--from torch-dcp"),
    "safetensors-folder": (lambda p: _safetensors_folder(p, True), "safetensors folder", "--from safetensors"),
    "safetensors-no-index": (lambda p: _safetensors_folder(p, False), "safetensors folder", "--from safetensors"),
    "safetensors-file": (lambda p: __import__("safetensors.torch").torch.save_file({"w": torch.ones(3)}, str(p)),
                         "safetensors file", "--from safetensors"),
    "torch-save-file": (lambda p: torch.save({"w": torch.ones(3)}, p), "torch.save file", "--from torch-save"),
    "torch-save-legacy": (lambda p: torch.save({"w": torch.ones(3)}, p, _use_new_zipfile_serialization=False),
                          "torch.save file", "--from torch-save"),
}


@pytest.mark.parametrize("kind", sorted(NEIGHBOURS))
def test_neighbour_formats_are_recognised(tmp_path, capsys, kind):
    make, what, command = NEIGHBOURS[kind]
    path = tmp_path / "x"
    make(path)
    with pytest.raises(CheckpointError) as info:
        raydcp.load({"w": torch.zeros(3)}, path)
    msg = str(info.value)
    assert what in msg and f"raydcp convert {path}" in msg and command in msg
    with pytest.raises(CheckpointError, match=command):
        raydcp.read_metadata(path)
    for argv in (("inspect", path), ("verify", path), ("status", path), ("diff", path, path),
                 ("reshard", path, tmp_path / "out", "-M", "2"),
                 ("convert", path, tmp_path / "out", "--to", "torch-save")):
        code, out, err = run(capsys, *argv)
        assert code == 2 and what in err and command in err, (argv, err)
    # and the command it names converts it
    code, out, err = run(capsys, "convert", path, tmp_path / "rd", *command.split())
    assert code == 0, err
    got = {"w": torch.zeros(3)}
    raydcp.load(got, tmp_path / "rd")
    assert torch.equal(got["w"], torch.ones(3))


def test_root_of_checkpoints_is_recognised(tmp_path):
    raydcp.save({"w": torch.ones(2)}, tmp_path / "root" / "step-1")
    with pytest.raises(CheckpointError, match=r"directory of checkpoints .*raydcp ls"):
        raydcp.read_metadata(tmp_path / "root")


def test_names_are_escaped_for_the_terminal(tmp_path, capsys):
    evil = "model.w\x1b]0;pwned\x07\x1b[2J\u202e[bold]x"
    a, b = tmp_path / "a", tmp_path / "b"
    raydcp.save({evil: torch.ones(3), "v\x1b[31m": "red\x1b[0m"}, a)
    raydcp.save({evil: torch.zeros(3)}, b)
    outputs = []
    for argv in (("inspect", a), ("verify", a), ("diff", a, b), ("ls", tmp_path)):
        code, out, err = run(capsys, *argv)
        outputs.append(out + err)
    # damage names the key on stderr
    md = raydcp.read_metadata(a)
    chunk = md.tensors[evil].chunks[0]
    with open(os.path.join(a, chunk.file), "r+b") as f:
        f.seek(chunk.byte_offset)
        f.write(b"\xff\xff")
    code, out, err = run(capsys, "verify", a)
    assert code == 1
    outputs.append(out + err)
    for text in outputs:
        assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text, text
    assert "model.w\\x1b]0;pwned\\x07\\x1b[2J\\u202e[bold]x" in outputs[0]  # shown, escaped, markup kept literal
    assert "model.w\\x1b]0;pwned" in outputs[2] and "model.w\\x1b]0;pwned" in outputs[4]
