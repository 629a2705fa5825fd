"""``__all__`` of the public packages lists exactly what they expose, and each name is documented."""

from __future__ import annotations

import __future__
import ast
import importlib
import inspect
import subprocess
import sys
import types
from pathlib import Path

import pytest

import engine
import engine.lightning
import engine.loggers
import engine.testing
import progress

PACKAGES = [engine, engine.distributed, engine.lightning, engine.loggers, engine.testing, progress]


def _is_type_checking_block(node: ast.stmt) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:`` (whatever ``typing`` is bound as)."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _top_level_statements(package: types.ModuleType) -> list[ast.stmt]:
    """The statements of the package's ``__init__.py`` at top level, those of an ``if
    TYPE_CHECKING:`` block included (a package that imports its names lazily lists them there)."""
    tree = ast.parse(Path(package.__file__).read_text(encoding="utf-8"))
    statements: list[ast.stmt] = []
    for node in tree.body:
        statements.extend(node.body if _is_type_checking_block(node) else [node])
    return statements


def _names_bound_in_source(package: types.ModuleType) -> set[str]:
    """Public names the package's ``__init__.py`` binds at top level (imports, defs, assignments)."""
    names: set[str] = set()
    for node in _top_level_statements(package):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                continue
            for alias in node.names:
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return {name for name in names if not name.startswith("_")}


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.__name__)
def test_all_has_no_duplicates_and_only_strings(package):
    assert all(isinstance(name, str) for name in package.__all__)
    assert len(package.__all__) == len(set(package.__all__))


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.__name__)
def test_every_name_in_all_exists(package):
    missing = [name for name in package.__all__ if not hasattr(package, name)]
    assert missing == []


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.__name__)
def test_all_matches_the_public_names_bound_in_init(package):
    bound = _names_bound_in_source(package)
    assert bound, "the source scan found nothing"
    assert set(package.__all__) == bound


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.__name__)
def test_every_public_non_module_attribute_is_in_all(package):
    # dir(), not vars(): engine binds its names on first use (PEP 562), its __dir__ lists them all.
    public = {name for name in dir(package) if not name.startswith("_")
              and not isinstance(getattr(package, name), (types.ModuleType, __future__._Feature))}
    assert public - set(package.__all__) == set()
    assert set(package.__all__) - public == set(), "__all__ lists modules or missing names"


def test_star_import_gives_exactly_all():
    for package in PACKAGES:
        namespace: dict[str, object] = {}
        exec(f"from {package.__name__} import *", namespace)
        assert {name for name in namespace if name != "__builtins__"} == set(package.__all__)


@pytest.mark.parametrize("package", [engine, engine.distributed], ids=lambda p: p.__name__)
def test_lazy_names_come_from_the_modules_the_type_checking_block_imports(package):
    imported = {}
    for node in _top_level_statements(package):
        if isinstance(node, ast.ImportFrom):
            imported.setdefault(node.module, set()).update(alias.name for alias in node.names)
    assert imported == {module: set(names) for module, names in package._EXPORTS.items()}
    for module, names in imported.items():
        for name in names:
            assert getattr(package, name) is getattr(importlib.import_module(module), name)


def test_import_engine_imports_a_name_s_module_only_when_the_name_is_used():
    # A process that needs one engine module (the checkpoint writer process) must not pay for
    # the whole engine and torch: ``import engine`` binds nothing eagerly.
    script = ("import sys, engine\n"
              "loaded = [name for name in ('engine.trainer', 'torch') if name in sys.modules]\n"
              "assert not loaded, loaded\n"
              "trainer = engine.Trainer\n"
              "assert 'engine.trainer' in sys.modules and trainer.__name__ == 'Trainer'\n")
    _assert_runs(script)


def test_import_engine_still_gives_the_engines_subpackages_on_use():
    # As the eager __init__ gave them: ``import engine`` then ``engine.loggers.CSV(...)``.
    script = ("import sys, engine\n"
              "assert engine.loggers is sys.modules['engine.loggers'] and engine.faults is sys.modules['engine.faults']\n"
              "from engine import run\n"
              "assert run is sys.modules['engine.run']\n")
    _assert_runs(script)


def test_an_unknown_engine_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        engine.NoSuchName  # noqa: B018
    assert not hasattr(engine, "NoSuchName")
    with pytest.raises(ImportError):
        exec("from engine import NoSuchName", {})


def test_engine_exports_the_documented_api():
    documented = {
        "Trainer", "TrainerConfig", "CheckpointConfig", "FitResult", "Module", "LRSchedule", "split_along_time",
        "Callback", "RunView", "fingerprint", "EngineError", "ConfigError", "ModuleContractError", "SplitError",
        "DataError", "CheckpointError", "CheckpointNotFound", "CheckpointCorrupt", "CheckpointIncompatible",
        "CheckpointWriteError", "WriterConflict", "ReplicaDivergence", "InjectedFault", "EarlyStopping", "load_weights",
        "export_weights", "preemption_safe", "Rollback", "AnomalyError",
    }
    assert set(engine.__all__) == documented


def test_progress_exports_the_documented_api():
    documented = {"Counts", "Progress", "Cursor", "ProgressTree", "RunEnd", "encode_tree", "decode_tree",
                  "ProgressSchemaError", "SCHEMA_VERSION", "Anomaly"}
    assert set(progress.__all__) == documented


def test_engine_errors_form_one_tree():
    errors = [getattr(engine, name) for name in engine.__all__
              if isinstance(getattr(engine, name), type) and issubclass(getattr(engine, name), Exception)]
    assert len(errors) == 14
    assert all(issubclass(error, engine.EngineError) for error in errors)
    for child in ("CheckpointNotFound", "CheckpointCorrupt", "CheckpointIncompatible", "CheckpointWriteError",
                  "WriterConflict", "ReplicaDivergence"):
        assert issubclass(getattr(engine, child), engine.CheckpointError)


def _own_docstring(value: object) -> str | None:
    doc = value.__dict__.get("__doc__") if isinstance(value, type) else getattr(value, "__doc__", None)
    if not isinstance(doc, str) or not doc.strip():
        return None
    if isinstance(value, type) and doc.startswith(f"{value.__name__}("):
        return None  # the signature dataclasses write when a class has no docstring
    return doc


@pytest.mark.parametrize("name", engine.__all__)
def test_every_engine_public_name_has_a_docstring(name):
    assert _own_docstring(getattr(engine, name)) is not None, f"engine.{name} has no docstring"


@pytest.mark.parametrize("name", [n for n in progress.__all__ if callable(getattr(progress, n))])
def test_every_progress_public_callable_has_a_docstring(name):
    assert _own_docstring(getattr(progress, name)) is not None, f"progress.{name} has no docstring"


def test_docstring_check_detects_missing_docstrings():
    # Control for the two tests above.
    import dataclasses

    @dataclasses.dataclass
    class Undocumented:
        value: int = 0

    class Inherits(engine.EngineError):
        pass

    def function():
        pass

    assert _own_docstring(Undocumented) is None
    assert _own_docstring(Inherits) is None
    assert _own_docstring(function) is None
    assert _own_docstring(engine.Trainer) is not None


def test_engine_docstring_mentions_every_public_name():
    doc = inspect.getdoc(engine)
    assert doc
    missing = [name for name in engine.__all__ if name not in doc]
    assert missing == []


def _assert_runs(script: str) -> None:
    """Run ``script`` in a fresh interpreter (nothing of engine imported yet); it must succeed."""
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
