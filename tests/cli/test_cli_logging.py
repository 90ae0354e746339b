"""raydcp's loggers: one hierarchy under "raydcp", quieted as docs/cli.md says; the command line
prints warnings by default, errors only with -q, INFO with -v; a complete conversion prints only
its summary."""
from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import raydcp
from raydcp.cli import main
from raydcp.cli._registry import _COMMANDS, Command

SCRIPT = os.path.join(os.path.dirname(sys.executable), "raydcp")
PACKAGE = Path(raydcp.__file__).resolve().parent


def test_every_logger_is_under_raydcp():
    """Each ``logging.getLogger(...)`` in the package names ``__name__`` or a ``raydcp.`` child, and
    nothing logs through the root logger (``logging.warning(...)``)."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "logging"):
                continue
            where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
            if node.func.attr in ("debug", "info", "warning", "error", "exception", "critical", "log"):
                bad.append(f"{where}: logging.{node.func.attr}() logs through the root logger")
            if node.func.attr == "getLogger":
                arg = node.args[0] if node.args else None
                if isinstance(arg, ast.Name) and arg.id == "__name__":
                    continue
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and (
                        arg.value == "raydcp" or arg.value.startswith("raydcp.")):
                    continue
                bad.append(f"{where}: getLogger({ast.unparse(arg) if arg else ''}) is outside 'raydcp'")
    assert bad == []


def test_quieting_raydcp_as_documented(tmp_path, caplog):
    raydcp.save({"a": torch.ones(2), "b": torch.ones(3)}, tmp_path / "ck")
    caplog.set_level(logging.WARNING)
    raydcp.load({"a": torch.zeros(2)}, tmp_path / "ck", strict=False)
    skipped = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and skipped[0].name.startswith("raydcp.")  # one warning, in the hierarchy
    caplog.clear()
    logger = logging.getLogger("raydcp")
    saved = logger.level
    logger.setLevel(logging.ERROR)  # docs/cli.md: how to quiet raydcp
    try:
        raydcp.load({"a": torch.zeros(2)}, tmp_path / "ck", strict=False)
    finally:
        logger.setLevel(saved)
    assert caplog.records == []


@pytest.fixture
def talker(monkeypatch):
    """A subcommand that logs one line at each level through raydcp loggers."""
    def talk(args):
        log = logging.getLogger("raydcp.engine.example")
        log.debug("detail of the step")
        log.info("step done")
        log.warning("something is off")
        logging.getLogger("raydcp.pipeline").error("it failed")
        print("result")
        return 0

    monkeypatch.setitem(_COMMANDS, "talk", Command("talk", "logs", lambda p: None, talk))


@pytest.mark.parametrize("flags, shown", [
    ((), ["warning: something is off", "error: it failed"]),
    (("-q",), ["error: it failed"]),
    (("-v",), ["info: [raydcp.engine.example] step done", "warning: something is off", "error: it failed"]),
    (("-vv",), ["debug: [raydcp.engine.example] detail of the step", "info: [raydcp.engine.example] step done",
               "warning: something is off", "error: it failed"]),
])
def test_verbosity_flags(talker, capsys, flags, shown):
    logger = logging.getLogger("raydcp")
    before = (logger.level, list(logger.handlers))
    for argv in (["talk", *flags], [*flags, "talk"]):  # before or after the subcommand
        assert main(argv) == 0
        out, err = capsys.readouterr()
        assert out == "result\n"
        assert err.splitlines() == [f"raydcp: {line}" for line in shown]
    assert (logger.level, list(logger.handlers)) == before  # nothing left behind in the process


def test_every_command_takes_quiet_and_verbose(capsys):
    from raydcp.cli import build_parser

    build_parser()  # registers the built-in subcommands
    for name in sorted(_COMMANDS):
        assert main([name, "--help"]) == 0
        out = capsys.readouterr().out
        assert "-q, --quiet" in out and "-v, --verbose" in out, name
    assert main(["inspect", "-q", "-v", "x"]) == 2  # one or the other
    assert "not allowed with" in capsys.readouterr().err


def test_complete_torch_dcp_conversion_prints_only_its_summary(tmp_path):
    src = tmp_path / "ck"
    raydcp.save({"model": {"w": torch.randn(8, 4), "b": torch.randn(4)}, "emb": torch.randn(16), "step": 3}, src)
    # a budget of one byte: every tensor is a group of its own, loaded by a load of its own
    proc = subprocess.run([SCRIPT, "convert", src, tmp_path / "dcp", "--to", "torch-dcp", "--memory-budget", "1B"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.startswith(f"converted {src} -> {tmp_path / 'dcp'} (torch-dcp): 3 tensors")
    assert proc.stdout.count("\n") == 1
    proc = subprocess.run([SCRIPT, "-q", "convert", tmp_path / "dcp", tmp_path / "back", "--from", "torch-dcp",
                           "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stderr == "" and json.loads(proc.stdout)["tensors"] == 3
