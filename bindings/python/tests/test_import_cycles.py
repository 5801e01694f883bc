"""No circle among kvtier's Python modules: every import of a kvtier module
by another, at the top of a file or inside a function, is an edge, and the
graph has no cycle (a module reaching back to one that imports it is held
together only by import order). A planted circle shows the check can fail."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import kvtier


def module_graph(root: Path, package: str) -> dict:
    """{module: the package's modules it imports}, from the source of every
    ``.py`` file under `root` (the directory of `package`)."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    graph = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = here[: len(here) - (node.level - 1)] if node.level else []
                target = ".".join(base + (node.module.split(".") if node.module else []))
                names = [f"{target}.{a.name}" for a in node.names]
                edges.update(n for n in names if n in modules)
                if target in modules and not all(n in modules for n in names):
                    edges.add(target)
            elif isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in modules)
        # importing a submodule imports the packages above it anyway
        graph[name] = {e for e in edges if e != name and not name.startswith(e + ".")}
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected groups of more than one module (Tarjan)."""
    index, low, on, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_kvtiers_modules_import_one_another_one_way():
    root = Path(kvtier.__file__).parent
    graph = module_graph(root, "kvtier")
    assert "kvtier.sglang._patch" in graph and graph["kvtier.sglang._patch"], "the graph was read"
    assert cycles(graph) == []


def test_a_planted_circle_is_found(tmp_path):
    pkg = tmp_path / "planted"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    # the way back, inside a function, as the shim's circle was held together
    (pkg / "b.py").write_text("def f():\n    from .sub import c\n")
    (pkg / "sub" / "c.py").write_text("from ..a import something\n")
    (pkg / "d.py").write_text("import planted.a\n")
    found = cycles(module_graph(pkg, "planted"))
    assert found == [["planted.a", "planted.b", "planted.sub.c"]]


# Imports sit at the top of each file. Inside a function only: optional
# third-party packages (torch, numpy, an engine's modules), and these, each
# for the reason given: (file under kvtier/, module as written) -> why.
DEFERRED = {
    ("sglang/_config.py", ".trace"): "trace needs numpy, which loading a config does not",
    ("sglang/plugin.py", "._patch"): "SGLang calls register() in every process; the shim loads only when configured",
    ("vllm/__init__.py", "..sglang._config"): "kvtier.sglang loads the SGLang shim and numpy; vLLM loads the plugin "
                                              "in every process",
    ("vllm/__init__.py", "..sglang.capacity"): "as ..sglang._config",
    ("vllm/__init__.py", ".host_pool"): "host_pool imports vllm/__init__ (a circle at the top)",
}


def imports_inside_functions(root: Path) -> list:
    """[(file relative to root, module as written)] of each import inside a
    function of a kvtier module or of the standard library."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom):
                    modules = ["." * node.level + (node.module or "")]
                elif isinstance(node, ast.Import):
                    modules = [a.name for a in node.names]
                else:
                    continue
                for m in modules:
                    top = m.split(".")[0]
                    if m.startswith(".") or top == root.name or top in sys.stdlib_module_names:
                        found.append((path.relative_to(root).as_posix(), m))
    return found


def test_kvtier_and_stdlib_imports_are_at_the_top():
    found = imports_inside_functions(Path(kvtier.__file__).parent)
    unlisted = sorted({f for f in found if f not in DEFERRED})
    assert not unlisted, f"move to the top of the file, or list in DEFERRED with the reason: {unlisted}"
    stale = sorted(set(DEFERRED) - set(found))
    assert not stale, f"DEFERRED lists imports that are not inside a function any more: {stale}"


def test_a_planted_import_inside_a_function_is_found(tmp_path):
    pkg = tmp_path / "planted"
    pkg.mkdir()
    (pkg / "a.py").write_text("import numpy\n\ndef f():\n    import os\n    from . import b\n    import torch\n")
    assert imports_inside_functions(pkg) == [("a.py", "os"), ("a.py", ".")]
