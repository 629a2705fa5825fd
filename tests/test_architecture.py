"""The engine's units form a layered graph: no import cycle between its top-level units, type-only
imports included, and few loose modules directly in ``engine/`` (docs/concepts.md has the map)."""

from __future__ import annotations

import ast
import pathlib

ENGINE = pathlib.Path(__file__).resolve().parent.parent / "engine"
MAX_LOOSE_MODULES = 8


def unit_of(module: str) -> str | None:
    """The top-level unit of a dotted engine module name: a package (``checkpoint``) or a loose
    module (``trainer``); ``engine`` itself for the package's ``__init__``."""
    parts = module.split(".")
    if parts[0] != "engine":
        return None
    return parts[1] if len(parts) > 1 else "engine"


def module_name(path: pathlib.Path) -> str:
    parts = ("engine",) + path.relative_to(ENGINE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every engine module ``path`` imports, at any depth of the file (TYPE_CHECKING blocks too)."""
    own = module_name(path).split(".")
    package = own if path.name == "__init__.py" else own[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            target = ".".join(filter(None, (base, node.module)))
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] == "engine"}


def unit_graph() -> dict[str, dict[str, set[str]]]:
    """unit -> imported unit -> the files that import it."""
    graph: dict[str, dict[str, set[str]]] = {}
    for path in ENGINE.rglob("*.py"):
        source = unit_of(module_name(path))
        assert source is not None
        for target in filter(None, map(unit_of, imported_modules(path))):
            target_is_a_unit = (ENGINE / target).is_dir() or (ENGINE / f"{target}.py").is_file()
            if target != source and target != "engine" and target_is_a_unit:
                graph.setdefault(source, {}).setdefault(target, set()).add(str(path.relative_to(ENGINE.parent)))
    return graph


def find_cycle(graph: dict[str, dict[str, set[str]]]) -> list[str] | None:
    """One import cycle as a list of units (first == last), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(unit: str) -> list[str] | None:
        state[unit], _ = "open", stack.append(unit)
        for target in sorted(graph.get(unit, {})):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        state[unit], _ = "done", stack.pop()
        return None

    for unit in sorted(graph):
        if unit not in state and (cycle := visit(unit)) is not None:
            return cycle
    return None


def test_the_engines_units_import_each_other_without_a_cycle() -> None:
    graph = unit_graph()
    cycle = find_cycle(graph) or []
    edges = [f"{a} -> {b} ({', '.join(sorted(graph[a][b]))})" for a, b in zip(cycle, cycle[1:])]
    assert not cycle, "import cycle between engine units:\n  " + "\n  ".join(edges)


def test_the_fault_points_are_the_bottom_layer() -> None:
    assert set(unit_graph().get("faults", {})) <= {"errors"}


def test_few_modules_lie_loose_in_the_engine_package() -> None:
    loose = sorted(path.stem for path in ENGINE.glob("*.py") if path.stem not in ("__init__", "__main__"))
    assert len(loose) <= MAX_LOOSE_MODULES, f"{len(loose)} loose modules in engine/: {loose}"


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b": {"a.py"}}, "b": {"c": {"b.py"}}, "c": {"a": {"c.py"}}, "d": {"a": {"d.py"}}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": {"a.py"}}, "b": {}}) is None
