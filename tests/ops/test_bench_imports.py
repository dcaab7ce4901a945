"""The benchmark's modules import one way: the runner (bench.run) imports
the scenarios, a scenario imports the harness (bench.harness, bench.cpu,
bench.common), and no module is part of an import circle, counting imports
inside functions (which Python resolves late, so a circle among them only
shows once a scenario runs)."""

from __future__ import annotations

import ast

from tests.conftest import REPO


def bench_imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in sorted((REPO / "bench").glob("*.py")):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "bench":
                    found.update(alias.name for alias in node.names)
                elif node.module.startswith("bench."):
                    found.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                found.update(
                    a.name.split(".")[1] for a in node.names if a.name.startswith("bench.")
                )
        graph[path.stem] = found - {path.stem}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    found = []

    def walk(module: str, path: list[str]) -> None:
        for imported in sorted(graph.get(module, ())):
            if imported in path:
                found.append([*path[path.index(imported) :], imported])
            elif len(path) < len(graph):
                walk(imported, [*path, imported])

    for module in graph:
        walk(module, [module])
    return found


def test_no_module_of_the_benchmark_imports_the_runner():
    graph = bench_imports()
    assert "run" in graph and "kafka" in graph  # the files were found
    importers = sorted(module for module, imported in graph.items() if "run" in imported)
    assert importers == [], f"{importers} import bench.run"


def test_the_benchmark_modules_import_each_other_in_no_circle():
    assert circles(bench_imports()) == []


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}})
