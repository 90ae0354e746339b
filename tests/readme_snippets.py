"""The code blocks of README.md's "Using it" section, for the tests that execute them as written."""
from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
DEMO_PATH = '"/tmp/raydcp-demo/step-100"'  # the first snippet's path literal; tests put theirs in its place


def using_it_snippets() -> list[str]:
    text = README.read_text()
    start = text.index("\n## Using it\n")
    end = text.index("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end], flags=re.DOTALL)


def single_process_snippet(path: str) -> str:
    code = using_it_snippets()[0]
    assert code.count(DEMO_PATH) == 1, "README's first snippet no longer sets its path the way the test expects"
    return code.replace(DEMO_PATH, repr(path))


def group_snippet() -> str:
    code = using_it_snippets()[1]
    assert "raydcp.Group(" in code and "group=group" in code
    return code
