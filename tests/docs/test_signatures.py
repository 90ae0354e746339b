"""Every signature of a public call written in docs/*.md is the real one (``inspect.signature``).

A signature is ``NAME(PARAMETERS)`` in inline code or in a code block, where NAME is a raydcp
public name (``raydcp.save``, ``raydcp.train.restore``, ``raydcp.ShardGroup.reshard``,
``raydcp.pipeline.CheckpointPipeline``, ...) and PARAMETERS read as a Python parameter list that
declares rather than calls: it has a ``*``/``*args``/``**kwargs``, a ``-> RESULT`` follows it, or it is
a definition (an inline code span that opens a line). Calls in examples (``raydcp.save(state,
"/tmp/c")``) are left alone. Parameter names, order, kinds and defaults must match; parameters whose
name starts with ``_`` are internal and never documented.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))

# names documented without their package in the docs' prose and examples
BARE = {"CheckpointPipeline": "raydcp.pipeline.CheckpointPipeline", "ShardGroup": "raydcp.ShardGroup",
        "KeySelection": "raydcp.convert.KeySelection", "Tier": "raydcp.pipeline.Tier"}
# the public calls whose signatures the docs must state (the public API contract and the pages' own)
REQUIRED = {"raydcp.save", "raydcp.async_save", "raydcp.load", "raydcp.read_metadata", "raydcp.Group",
            "raydcp.ShardGroup", "raydcp.train.save", "raydcp.train.restore", "raydcp.train.RayDCPCallback",
            "raydcp.pipeline.CheckpointPipeline"}
_NAME = re.compile(r"(?<![\w.])((?:raydcp\.[A-Za-z_][\w.]*)|" + "|".join(BARE) + r")\(")


def _code(text: str):
    """(code, is a definition) for every inline code span and every fenced code block of a page."""
    fenced = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
    for block in fenced.finditer(text):
        yield block.group(1), False
    rest = fenced.sub("", text)
    for line in rest.splitlines():
        for m in re.finditer(r"`([^`]+)`", line):
            yield m.group(1), m.start() == 0


def _closing(code: str, start: int) -> int | None:
    depth = 0
    for i in range(start, len(code)):
        if code[i] in "([{":
            depth += 1
        elif code[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return None


def documented() -> list[tuple[str, str, str]]:
    """(page, name, parameter text) of every documented signature."""
    out = []
    for page in DOCS:
        for code, definition in _code(page.read_text()):
            for m in _NAME.finditer(code):
                end = _closing(code, m.end() - 1)
                if end is None:
                    continue
                params = code[m.end():end]
                try:
                    args = ast.parse(f"def f({params}): pass").body[0].args
                except SyntaxError:
                    continue  # a call with literals, not a parameter list
                declares = (args.vararg or args.kwarg or args.kwonlyargs or "*" in params
                            or code[end + 1:].lstrip().startswith("->") or (definition and m.start() == 0))
                if declares:
                    out.append((page.name, BARE.get(m.group(1), m.group(1)), params))
    return out


def _resolve(name: str):
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise AssertionError(f"{name} is not importable")


def _documented_params(params: str, namespace: dict) -> list[tuple[str, str, object]]:
    """(name, kind, default or inspect.Parameter.empty) from the documented parameter text."""
    args = ast.parse(f"def f({params}): pass").body[0].args
    out = []
    positional = args.posonlyargs + args.args
    defaults = [inspect.Parameter.empty] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for a, d in zip(positional, defaults):
        out.append((a.arg, "positional", d))
    if args.vararg:
        out.append((args.vararg.arg, "*args", inspect.Parameter.empty))
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        out.append((a.arg, "keyword", inspect.Parameter.empty if d is None else d))
    if args.kwarg:
        out.append((args.kwarg.arg, "**kwargs", inspect.Parameter.empty))
    return [(n, k, d if d is inspect.Parameter.empty else eval(compile(ast.Expression(d), "<doc>", "eval"),
                                                                   dict(namespace)))
            for n, k, d in out]


_KINDS = {inspect.Parameter.POSITIONAL_ONLY: "positional", inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
          inspect.Parameter.VAR_POSITIONAL: "*args", inspect.Parameter.KEYWORD_ONLY: "keyword",
          inspect.Parameter.VAR_KEYWORD: "**kwargs"}


def _real_params(obj) -> tuple[list[tuple[str, str, object]], dict]:
    sig = inspect.signature(obj)
    params = [p for p in sig.parameters.values() if not p.name.startswith("_") and p.name != "self"]
    module = importlib.import_module(getattr(obj, "__module__", None) or "raydcp")
    return [(p.name, _KINDS[p.kind], p.default) for p in params], vars(module)


def test_the_docs_state_the_public_calls_signatures():
    found = {name for _, name, _ in documented()}
    assert REQUIRED <= found, f"no signature in docs/*.md for {sorted(REQUIRED - found)}"


@pytest.mark.parametrize("page, name, params", documented(), ids=lambda v: str(v)[:60])
def test_a_documented_signature_is_the_real_one(page, name, params):
    real, namespace = _real_params(_resolve(name))
    doc = _documented_params(params, namespace)
    want = str(inspect.signature(_resolve(name)).replace(return_annotation=inspect.Signature.empty))
    assert [(n, k) for n, k, _ in doc] == [(n, k) for n, k, _ in real], f"{page}: {name}({params}); it is ({want})"
    for (n, _, d), (_, _, r) in zip(doc, real):
        assert (d is inspect.Parameter.empty) == (r is inspect.Parameter.empty) and (
            d is inspect.Parameter.empty or d == r), f"{page}: {name}: {n}={d!r}, the default is {r!r}"
