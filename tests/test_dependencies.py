"""The package runs on a fresh machine: every third-party module that engine/ and progress/
import is a declared dependency, and checkpoints do not need NumPy (torch can be built or
installed without it)."""

import ast
import importlib.metadata
import pathlib
import re
import sys

import pytest
import torch

import engine
from engine.checkpoint.format.tensor_bytes import tensor_bytes_view
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from models import Regression

ROOT = pathlib.Path(__file__).resolve().parent.parent
OWN_PACKAGES = {"engine", "progress"}


def _top_level(node):
    if isinstance(node, ast.Import):
        return {alias.name.split(".")[0] for alias in node.names}
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return {node.module.split(".")[0]}
    return set()


def _catches_import_error(handler):
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(name, ast.Name) and name.id in ("ImportError", "ModuleNotFoundError") for name in names)


def _imports(package: str) -> tuple[set[str], set[str]]:
    """(modules imported unconditionally, modules imported only under try/except ImportError)."""
    plain, guarded = set(), set()
    for path in (ROOT / package).rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        guarded_nodes = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.Try)
                         and any(_catches_import_error(handler) for handler in node.handlers)
                         for statement in node.body for inner in ast.walk(statement)}
        for node in ast.walk(tree):
            (guarded if id(node) in guarded_nodes else plain).update(_top_level(node))
    return plain, guarded - plain


def _requirement_names(requirements) -> set[str]:
    return {re.split(r"[<>=!~ \[;]", requirement, maxsplit=1)[0].lower() for requirement in requirements}


def _declared() -> tuple[set[str], set[str]]:
    """(distributions in [project].dependencies, distributions in any extra)."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set().union(*(_requirement_names(group) for group in project.get("optional-dependencies", {}).values()))
    return _requirement_names(project["dependencies"]), extras


def _undeclared(modules: set[str], declared: set[str], distributions) -> dict[str, list[str]]:
    modules = modules - set(sys.stdlib_module_names) - OWN_PACKAGES
    return {module: distributions.get(module, [module]) for module in modules
            if not any(name.lower() in declared for name in distributions.get(module, [module]))}


def test_every_third_party_import_is_a_declared_dependency():
    required, optional = _declared()
    plain, guarded = set(), set()
    for package in OWN_PACKAGES:
        package_plain, package_guarded = _imports(package)
        plain |= package_plain
        guarded |= package_guarded
    distributions = importlib.metadata.packages_distributions()
    missing = _undeclared(plain, required, distributions)
    assert not missing, f"imported but not in pyproject [project].dependencies: {missing}"
    missing_optional = _undeclared(guarded, required | optional, distributions)
    assert not missing_optional, f"imported under try/except ImportError but in no extra: {missing_optional}"
    assert "tqdm" in required


def test_checkpoints_and_fingerprints_need_no_numpy(tmp_path, monkeypatch):
    def numpy_is_not_available(self, *args, **kwargs):
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(torch.Tensor, "numpy", numpy_is_not_available)
    module = Regression(features=3)
    model = module.net
    batches = [torch.randn(2, 3) for _ in range(3)]
    config = engine.TrainerConfig(max_epochs=1, run_dir=str(tmp_path), progress_bar="off")
    result = engine.Trainer(config).fit(module, batches)
    assert result.last_checkpoint is not None
    loaded = CheckpointStore(Storage(str(tmp_path), create=False), create=False).load(result.last_checkpoint)
    assert torch.equal(loaded.state["module"]["net.weight"], model.weight.detach())
    assert len(engine.fingerprint(model.state_dict(), [])) == 64


def test_tensor_bytes_are_the_tensors_memory_in_order():
    for tensor in [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.tensor(7, dtype=torch.int64),
                   torch.tensor([True, False]), torch.tensor([1 + 2j], dtype=torch.complex64), torch.empty(0)]:
        expected = b"".join(bytes(element.reshape(1).view(torch.uint8).tolist()) for element in tensor.reshape(-1))
        assert bytes(tensor_bytes_view(tensor)) == expected
