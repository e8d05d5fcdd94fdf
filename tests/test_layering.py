"""Imports run one way: no torch_stage module imports one that imports it
back, directly or through others, counting imports inside functions (a lazy
import is still a cycle of meaning). Package ``__init__`` files are facades
that gather the API and are left out."""

import ast
import os
import pkgutil

import torch_stage

ROOT = os.path.dirname(torch_stage.__file__)


def _modules():
    names = {}
    for info in pkgutil.walk_packages([ROOT], prefix="torch_stage."):
        if info.ispkg:
            continue
        path = os.path.join(ROOT, *info.name.split(".")[1:]) + ".py"
        if os.path.exists(path):
            names[info.name] = path
    return names


def _imports(path, known):
    """The torch_stage modules (of ``known``) that the file imports."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in known:
                out.add(node.module)
            for a in node.names:  # from package import submodule
                if f"{node.module}.{a.name}" in known:
                    out.add(f"{node.module}.{a.name}")
    return out


def _cycle(graph):
    state = {}

    def visit(m, path):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return path[path.index(n) :] + [n]
            if n not in state:
                found = visit(n, path + [n])
                if found:
                    return found
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


def test_the_modules_are_found():
    modules = _modules()
    assert {
        "torch_stage.streams.multi_stream",
        "torch_stage.streams.annotations",
        "torch_stage.streams.fx.analysis",
    } <= set(modules)


def test_no_module_imports_one_that_imports_it_back():
    modules = _modules()
    graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
    assert graph["torch_stage.streams.multi_stream"] >= {"torch_stage.streams.fx.multi_stream_pass"}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_check_sees_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(graph) == ["a", "b", "c", "a"]
