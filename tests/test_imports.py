"""jrl's modules import each other without cycles, lazy imports inside functions included."""

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jrl")


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(ROOT))[: -len(".py")].replace(os.sep, ".")
    return rel.removesuffix(".__init__")


def _imports(path: str, modules: set[str]) -> set[str]:
    """The jrl modules `path` imports anywhere, TYPE_CHECKING blocks included (a cycle
    hidden there is still two modules that each need the other)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import sub` imports the submodule; `from pkg.mod import name`, pkg.mod.
            subs = [f"{node.module}.{a.name}" for a in node.names]
            names = [n for n in subs if n in modules] or [node.module]
        else:
            continue
        found.update(name for name in names if name in modules)
    return found


def _graph() -> dict[str, set[str]]:
    paths = [os.path.join(d, f) for d, _, fs in os.walk(ROOT) for f in fs if f.endswith(".py")]
    modules = {_module_name(p) for p in paths}
    graph = {_module_name(p): _imports(p, modules) for p in paths}
    # Python initialises a module's parent packages before it: an import of a parent
    # package from inside it is no cycle.
    return {m: {d for d in deps if d != m and not m.startswith(d + ".")}
            for m, deps in graph.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycles():
    graph = _graph()
    assert "jrl.sft" in graph and "jrl.train" in graph
    assert "jrl.app.experiment" in graph["jrl.train"]
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_optim_needs_nothing_of_settings():
    assert "jrl.config.settings" not in _graph()["jrl.optim"]


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


if __name__ == "__main__":
    pytest.main([__file__])
