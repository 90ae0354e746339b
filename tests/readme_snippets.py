"""The code blocks of README.md's "Using it" section, for the tests that execute them as written."""
from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
DEMO_PATH = '"/tmp/raydcp-demo/step-100"'  # the first snippet's path literal; tests put theirs in its place
ACTORS_PATH = '"/tmp/raydcp-demo/actors"'  # the actors example's


def using_it_snippets() -> list[str]:
    text = README.read_text()
    start = text.index("\n## Using it\n")
    end = text.index("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end], flags=re.DOTALL)


def _with_path(code: str, literal: str, path: str) -> str:
    assert code.count(literal) == 1, f"README's snippet no longer sets its path to {literal} the way the test expects"
    return code.replace(literal, repr(path))


def single_process_snippet(path: str) -> str:
    return _with_path(using_it_snippets()[0], DEMO_PATH, path)


def actors_snippet(path: str) -> str:
    code = using_it_snippets()[1]
    assert "ray.init()" in code and "raydcp.Group(" in code and "group=self.group" in code
    return _with_path(code, ACTORS_PATH, path)
