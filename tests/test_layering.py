"""The import graph of raydcp, read from the source with ``ast`` (nothing is imported).

The rules of the architecture (docs/architecture.md), every import counted: at module level,
inside functions and under ``if TYPE_CHECKING:``. An import of a package counts as an import of
its ``__init__``; ``from pkg import name`` counts as an import of ``pkg.name`` where that is a
module, else of ``pkg``. (That importing ``a.b.c`` first runs ``a/__init__`` is not counted: the
packages above a module are already loading.)

1. The engine, ``raydcp/group.py``, the planner, the storage layer and the pipeline never import
   ``raydcp.runtime`` or ``ray``: the API layer (``raydcp/api.py``) picks the Ray transport,
   persister and pipeline driver and hands them down.
2. Layers: the library below the public calls (engine, group, planner, storage, metadata, codec,
   state, transport, errors, options, verify) imports neither the public calls (the package face
   ``raydcp``, ``raydcp.api``, ``raydcp.memory``) nor what is built on them (pipeline, train, cli)
   nor the runtime, convert or reshard; the public calls import nothing built on them; the
   runtime imports neither the public calls nor train or cli.
3. No import cycle among raydcp's modules.
4. A name used outside its package is public there: no ``_name`` imported across packages, no
   underscore module used across packages (a package is ``raydcp.<first part>``).
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


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


LIBRARY = ("raydcp.engine", "raydcp.group", "raydcp.planner", "raydcp.storage", "raydcp.metadata",
           "raydcp.metadata_format", "raydcp.codec", "raydcp.state", "raydcp.state_modules", "raydcp.transport",
           "raydcp.errors", "raydcp.options", "raydcp.lazy", "raydcp.verify")
PUBLIC_CALLS = ("raydcp", "raydcp.api", "raydcp.memory")
BUILT_ON_THEM = ("raydcp.pipeline", "raydcp.train", "raydcp.cli")
# what each layer must not import (packages, as _package names them)
NOT_BELOW = {
    LIBRARY: PUBLIC_CALLS + BUILT_ON_THEM + ("raydcp.runtime", "raydcp.convert", "raydcp.reshard"),
    ("raydcp.api",): BUILT_ON_THEM,
    ("raydcp.runtime",): PUBLIC_CALLS + ("raydcp.train", "raydcp.cli"),
}


def layer_breaks() -> list[str]:
    out = []
    for layer, forbidden in NOT_BELOW.items():
        for module in sorted(MODULES):
            if _package(module) not in layer:
                continue
            out += [f"{module} imports {name}" for name in sorted(_imports(module, module_level_only=False))
                    if name in MODULES and _package(name) in forbidden and _package(name) != _package(module)]
    return out


def test_each_layer_imports_only_the_layers_below_it():
    assert layer_breaks() == []


def test_the_layer_check_sees_an_upward_import():
    assert _package("raydcp.api") == "raydcp.api" and _package("raydcp") == "raydcp"
    assert "raydcp.pipeline" in BUILT_ON_THEM and "raydcp.api" in PUBLIC_CALLS
    graph = {m: _imports(m, module_level_only=False) for m in ("raydcp.pipeline.api", "raydcp.train.checkpoint")}
    assert all("raydcp.api" in names for names in graph.values())  # the layers above use the public calls


def private_imports() -> list[str]:
    """Every private name or underscore module one package imports from another."""
    out = []
    for module, path in sorted(MODULES.items()):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = _absolute(module, node)
            if not base.startswith("raydcp"):
                continue
            for alias in node.names:
                target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                if _package(target) == _package(module):
                    continue
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    out.append(f"{module} imports {base}.{alias.name}")
                if any(p.startswith("_") and not p.startswith("__") for p in target.split(".")[1:]):
                    out.append(f"{module} imports the underscore module {target}")
    return out


def test_no_private_name_or_underscore_module_is_used_across_packages():
    assert private_imports() == []


def test_no_import_cycle_among_raydcp_modules():
    graph = {m: {i for i in _imports(m, module_level_only=False) if i in MODULES and i != m} for m in MODULES}
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
