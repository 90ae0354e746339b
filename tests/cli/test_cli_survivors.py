"""raydcp ls says which checkpoints the survivors of a save committed, and without which ranks."""
from __future__ import annotations

import json

import raydcp
from raydcp.cli import main
from tests.engine.test_survivors_reduce import replicated, survivors_save


def test_ls_names_the_ranks_a_checkpoint_was_committed_without(tmp_path, capsys):
    survivors_save(str(tmp_path / "emergency"), {0: replicated(0), 1: replicated(1), 2: None, 3: replicated(3)})
    raydcp.save(replicated(0), str(tmp_path / "plain"))
    assert main(["ls", str(tmp_path), "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert rows["emergency"]["lost_ranks"] == [2] and rows["plain"]["lost_ranks"] == []
    assert main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "4 (survivors; lost 2)" in out and out.count("survivors") == 1
