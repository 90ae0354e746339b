"""The import graph of raydcp, read from the source with ``ast`` (nothing is imported).

Two rules of the architecture (docs/architecture.md):

1. The engine, ``raydcp/group.py``, the planner, the storage layer and the pipeline never import
   ``raydcp.runtime`` or ``ray`` -- at module level or inside a function: the API layer
   (``raydcp/api.py``) picks the Ray transport, persister and pipeline driver and hands them down.
2. No import cycle among raydcp's modules. What counts: the imports a module executes when it is
   imported (module level, including inside ``if``/``try`` blocks there, but not those inside
   functions or under ``if TYPE_CHECKING:``), from a module to another raydcp module. An import
   of a package counts as an import of its ``__init__``; ``from pkg import name`` counts as an
   import of ``pkg.name`` where that is a module, else of ``pkg``. (That importing ``a.b.c``
   first runs ``a/__init__`` is not counted: the packages above a module are already loading.)
"""
from __future__ import annotations

import ast
from pathlib import Path

import raydcp

ROOT = Path(raydcp.__file__).parent
RAY_FREE = ("raydcp.engine", "raydcp.group", "raydcp.planner", "raydcp.storage", "raydcp.pipeline")
FORBIDDEN = ("raydcp.runtime", "ray")


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not _is_package(module):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str, *, module_level_only: bool) -> set[str]:
    """Every module name ``module`` imports (``from a import b``: ``a.b`` if it is a module, else ``a``)."""
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if module_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if module_level_only and isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:
                    visit(ast.Module(body=[sub], type_ignores=[]))
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = _absolute(module, child)
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in MODULES else base)
            visit(child)

    visit(tree)
    return found


def _forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def test_the_engine_group_planner_storage_and_pipeline_never_import_the_runtime_or_ray():
    checked, offences = 0, []
    for module in sorted(MODULES):
        if not any(module == p or module.startswith(p + ".") for p in RAY_FREE):
            continue
        checked += 1
        offences += [f"{module} imports {name}" for name in sorted(_imports(module, module_level_only=False))
                     if _forbidden(name)]
    assert checked >= 30  # the walk found the packages' modules
    assert offences == []


# Known and scheduled: raydcp.metadata re-exports the codec of raydcp.metadata_format (an import at
# the bottom of metadata.py), which imports the model from raydcp.metadata. Issue 14 item 5 drops
# the re-export; delete this entry then. Any other cycle fails.


def test_no_import_cycle_among_raydcp_modules():
    graph = {m: {i for i in _imports(m, module_level_only=True) if i in MODULES and i != m} for m in MODULES}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def dfs(m: str, path: list[str]) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(path[path.index(d):] + [d])
            elif d not in state:
                dfs(d, path)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m, [])
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_walk_sees_imports_inside_functions():
    # raydcp/api.py imports the runtime only inside functions: the first rule's walk must see it
    assert any(_forbidden(n) for n in _imports("raydcp.api", module_level_only=False))
    assert not any(_forbidden(n) for n in _imports("raydcp.api", module_level_only=True))
