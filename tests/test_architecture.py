"""The engine's units form a layered graph: no import cycle between its top-level units, nor between
any two of its modules, type-only and function-level imports included; the units keep the README's
layer order; few loose modules directly in ``engine/``; the checkpoint package's rooms import
downwards only (docs/concepts.md has the map)."""

from __future__ import annotations

import ast
import functools
import pathlib
import re

ENGINE = pathlib.Path(__file__).resolve().parent.parent / "engine"
README = ENGINE.parent / "README.md"
MAX_LOOSE_MODULES = 8
CHECKPOINT = ENGINE / "checkpoint"
MAX_CHECKPOINT_ENTRIES = 10
# engine.checkpoint's rooms, lowest first; "" is the front (the modules at the package's top).
CHECKPOINT_ROOMS = ("format", "store", "writers", "tiers", "")
WRITERS = "engine.checkpoint.writers"
# What the engine outside engine.checkpoint.writers may import of it: the Writer protocol, the
# choice, what is handed to a writer, and its threads' notion of background work. Never a writer.
WRITERS_FRONT = {f"{WRITERS}.{name}" for name in ("protocol", "choice", "pending", "committer", "worker")}


def unit_of(module: str) -> str | None:
    """The top-level unit of a dotted engine module name: a package (``checkpoint``) or a loose
    module (``trainer``); ``engine`` itself for the package's ``__init__``."""
    parts = module.split(".")
    if parts[0] != "engine":
        return None
    return parts[1] if len(parts) > 1 else "engine"


def module_name(path: pathlib.Path, root: pathlib.Path = ENGINE) -> str:
    parts = ("engine",) + path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_statements(path: pathlib.Path, root: pathlib.Path = ENGINE) -> list[tuple[str, list[str]]]:
    """Each import of ``path``, at any depth of the file (TYPE_CHECKING blocks too): the module
    it names (relative imports resolved) and the names imported from it ([] for ``import a.b``)."""
    own = module_name(path, root).split(".")
    package = own if path.name == "__init__.py" else own[:-1]
    statements = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            statements += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            statements.append((".".join(filter(None, (base, node.module))), [alias.name for alias in node.names]))
    return statements


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every engine module ``path`` imports, at any depth of the file (TYPE_CHECKING blocks too)."""
    found = set()
    for target, names in import_statements(path):
        found.add(target)
        found.update(f"{target}.{name}" for name in names)
    return {name for name in found if name.split(".")[0] == "engine"}


@functools.cache  # the tree does not change during a test session; the callers only read
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


@functools.cache  # the tree does not change during a test session; the callers only read
def engine_modules() -> dict[str, pathlib.Path]:
    return {module_name(path): path for path in ENGINE.rglob("*.py")}


def imported_engine_modules(path: pathlib.Path, modules: dict[str, pathlib.Path], root: pathlib.Path = ENGINE) -> set[str]:
    """The engine modules ``path`` imports, each by its own file: ``from engine.a import b`` names
    the module ``engine.a.b`` when there is one, the package ``engine.a`` otherwise. The parent
    packages Python initialises on the way are not counted (a package's ``__init__`` may import
    its own modules: that is its front door, not a loop)."""
    found = set()
    for target, names in import_statements(path, root):
        submodules = {f"{target}.{name}" for name in names} & modules.keys()
        found.update(submodules)
        if len(submodules) < len(names) or not names:
            found.add(target)
    resolved = set()
    for name in found:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name.split(".")[0] == "engine":
            resolved.add(name)
    return resolved - {module_name(path, root)}


@functools.cache  # the tree does not change during a test session; the callers only read
def module_graph() -> dict[str, dict[str, set[str]]]:
    """engine module -> the engine modules it imports (at any depth of its file) -> its file."""
    modules = engine_modules()
    graph: dict[str, dict[str, set[str]]] = {}
    for name, path in modules.items():
        for target in imported_engine_modules(path, modules):
            graph.setdefault(name, {}).setdefault(target, set()).add(str(path.relative_to(ENGINE.parent)))
    return graph


def describe(cycle: list[str], graph: dict[str, dict[str, set[str]]]) -> str:
    return "\n  ".join(f"{a} -> {b} ({', '.join(sorted(graph[a][b]))})" for a, b in zip(cycle, cycle[1:]))


def test_no_two_engine_modules_import_each_other() -> None:
    graph = module_graph()
    cycle = find_cycle(graph) or []
    assert not cycle, "import loop between engine modules:\n  " + describe(cycle, graph)


def readme_layers() -> list[str]:
    """The README's layer order of the engine's units, top first (the "Layout" section)."""
    layout = README.read_text().split("## Layout", 1)[1]
    sentence = layout.split("importing only those below it", 1)[1].split("with `callbacks/`", 1)[0]
    return [name.rstrip("/") for name in re.findall(r"`([a-z_]+/?)`", sentence)]


def test_the_units_keep_the_readmes_layer_order() -> None:
    layers = readme_layers()
    assert layers[0] == "cli" and layers[-1] == "faults", layers
    graph = unit_graph()
    upward = [f"{unit} -> {target} ({', '.join(sorted(files))})"
              for unit, targets in graph.items() if unit in layers
              for target, files in targets.items() if target in layers and layers.index(target) < layers.index(unit)]
    assert not upward, "imports against the README's layer order:\n  " + "\n  ".join(sorted(upward))


def checkpoint_room(module: str) -> str | None:
    """The room of an engine.checkpoint module ("" for the front), None outside the package."""
    parts = module.split(".")
    if parts[:2] != ["engine", "checkpoint"] or len(parts) < 3:
        return None
    return parts[2] if len(parts) > 3 or (CHECKPOINT / parts[2]).is_dir() else ""


def test_the_checkpoint_rooms_import_downwards_only() -> None:
    upward = []
    for module, targets in module_graph().items():
        room = checkpoint_room(module)
        for target, files in targets.items():
            target_room = checkpoint_room(target)
            if room is not None and target_room is not None and \
                    CHECKPOINT_ROOMS.index(target_room) > CHECKPOINT_ROOMS.index(room):
                upward.append(f"{module} -> {target} ({', '.join(sorted(files))})")
    assert not upward, "engine.checkpoint: a room imports one above it:\n  " + "\n  ".join(sorted(upward))


def test_the_checkpoint_package_has_few_entries_at_its_top() -> None:
    entries = sorted(path.name for path in CHECKPOINT.iterdir()
                     if path.name not in ("__init__.py", "__pycache__") and (path.suffix == ".py" or path.is_dir()))
    rooms = {path.name for path in CHECKPOINT.iterdir() if path.is_dir() and path.name != "__pycache__"}
    assert rooms == set(CHECKPOINT_ROOMS) - {""}, rooms
    assert len(entries) <= MAX_CHECKPOINT_ENTRIES, f"{len(entries)} entries in engine/checkpoint/: {entries}"


def test_a_writer_is_seen_through_its_protocol_and_chosen_in_one_place() -> None:
    """Adding a writer needs no edit outside engine/checkpoint/writers/ but its line in
    ``WRITER_KINDS``: no module outside the room imports a writer class, one module calls
    ``choose_writer``, and no module outside the room lists the writers' names (the configuration
    checks a name against ``WRITER_KINDS``; tests/checkpoint/test_plan.py adds a writer that way)."""
    from engine.checkpoint.writers.choice import WRITER_KINDS
    reaching_in = []
    choosers = []
    listing = []
    graph = module_graph()
    for module, path in engine_modules().items():
        if module == WRITERS or module.startswith(WRITERS + "."):
            continue
        targets = graph.get(module, {})
        reaching_in += [f"{module} -> {target}" for target in targets
                        if target.startswith(WRITERS + ".") and target not in WRITERS_FRONT]
        nodes = list(ast.walk(ast.parse(path.read_text())))
        calls = [node for node in nodes if isinstance(node, ast.Call)]
        if any(getattr(call.func, "id", getattr(call.func, "attr", None)) == "choose_writer" for call in calls):
            choosers.append(module)
        listing += [module for node in nodes
                    if isinstance(node, (ast.List, ast.Tuple, ast.Set, ast.Dict))
                    and len({getattr(element, "value", None) for element in getattr(node, "elts", getattr(node, "keys", []))}
                            & set(WRITER_KINDS)) >= 2]
    assert not reaching_in, "modules that reach into engine.checkpoint.writers:\n  " + "\n  ".join(sorted(reaching_in))
    assert choosers == ["engine.checkpoint.policy"], choosers
    assert not listing, f"modules that list the writers' names outside engine.checkpoint.writers: {sorted(set(listing))}"


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


def test_the_module_graph_counts_type_only_and_function_level_imports(tmp_path: pathlib.Path) -> None:
    package = tmp_path / "engine" / "pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.pkg.b import B\n")
    (package / "b.py").write_text("def f():\n    from engine.pkg import a\n")
    modules = {"engine.pkg": package / "__init__.py", "engine.pkg.a": package / "a.py", "engine.pkg.b": package / "b.py"}
    root = tmp_path / "engine"
    assert imported_engine_modules(package / "a.py", modules, root) == {"engine.pkg.b"}
    assert imported_engine_modules(package / "b.py", modules, root) == {"engine.pkg.a"}
    assert find_cycle({name: dict.fromkeys(imported_engine_modules(path, modules, root), {""})
                       for name, path in modules.items()}) == ["engine.pkg.a", "engine.pkg.b", "engine.pkg.a"]


def test_the_run_sees_its_checkpoints_through_two_narrow_doors() -> None:
    """engine.run's start gets the ResumeSource side of its checkpoints, the save on exception the
    CheckpointSink side; the two sides share no member and together are what FitRun holds."""
    import inspect

    from engine.checkpoint.checkpointing import Checkpointing, CheckpointSink, ResumeSource
    from engine.run.exception_save import ExceptionSave
    from engine.run.start import RunStart

    def members(protocol: type) -> set[str]:
        return {name for name in vars(protocol) if not name.startswith("_")}

    assert not members(ResumeSource) & members(CheckpointSink)
    assert Checkpointing.__mro__[1:3] == (ResumeSource, CheckpointSink)
    assert inspect.signature(RunStart).parameters["checkpoints"].annotation == "ResumeSource"
    assert inspect.signature(ExceptionSave).parameters["checkpoints"].annotation == "CheckpointSink"
