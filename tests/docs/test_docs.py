"""The docs cite only what is in the repo, and the README's benchmark table is BENCHMARKS.md's."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_MD_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")       # [text](path) and ![alt](path)
_MD_NAME = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.md)\b")  # a bare FOO.md or docs/foo.md


def _text_files():
    for pattern in ("*.md", "docs/**/*.md", "raydcp/**/*.py", "jobs/*.py", "bench/*.py", "tests/**/*.py",
                    "Makefile", "cluster.yaml", "deploy/*"):
        for path in ROOT.glob(pattern):
            if path.is_file() and ".venv" not in path.parts:
                yield path


def _cited(path: Path) -> set[str]:
    text = path.read_text(errors="replace")
    found = set(_MD_NAME.findall(text))
    if path.suffix == ".md":
        found |= {link for link in _MD_LINK.findall(text) if "://" not in link and not link.startswith("mailto:")}
    return found


def test_every_cited_document_is_in_the_repo():
    names = {p.name for p in ROOT.glob("**/*.md") if ".venv" not in p.parts}
    missing = []
    for path in _text_files():
        if path == Path(__file__):
            continue
        for ref in _cited(path):
            if not ((ROOT / ref).exists() or (path.parent / ref).exists() or ("/" not in ref and ref in names)):
                missing.append(f"{path.relative_to(ROOT)} cites {ref}")
    assert not missing, "\n".join(sorted(missing))


def _table_after(text: str, heading: str) -> list[list[str]]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    rows, seen = [], False
    for line in lines[start + 1:]:
        if line.startswith("|"):
            seen = True
            cells = [c.strip() for c in line.strip("|").split("|")]
            if not set("".join(cells)) <= set("-: "):
                rows.append(cells)
        elif seen:
            break
    return rows


def test_readme_benchmark_table_is_the_summary_of_benchmarks_md():
    readme = _table_after((ROOT / "README.md").read_text(), "## How fast")
    summary = _table_after((ROOT / "BENCHMARKS.md").read_text(), "<!-- summary-table")
    assert len(readme) == len(summary) >= 5
    for r, s in zip(readme[1:], summary[1:]):
        assert r[:2] == s[:2]
        assert r[2] == f"{s[2]}x", (r, s)


def test_summary_plot_reads_the_table(tmp_path):
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("plot_summary", ROOT / "bench" / "plot_summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.read_summary((ROOT / "BENCHMARKS.md").read_text())
    assert [name for name, _ in rows][0].startswith("save")
    assert all(r > 0 for _, r in rows)
    out = tmp_path / "plot.png"
    mod.plot(rows, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (ROOT / "docs" / "img" / "benchmarks.png").exists()
