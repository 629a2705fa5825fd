"""The tracker loggers' packages: ``import engine`` imports neither mlflow nor wandb (the sender
thread imports them when a run starts), and a logger whose package is missing says which extra
to install, when it is built."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

import engine
import engine.loggers


@pytest.mark.parametrize("package, make", [
    ("mlflow", lambda: engine.loggers.MLflow("http://127.0.0.1:1")),
    ("wandb", lambda: engine.loggers.WandB()),
])
def test_without_its_package_a_tracker_says_what_to_install(monkeypatch, package, make):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == package else find_spec(name, *args))
    with pytest.raises(engine.ConfigError, match=rf"needs the {package} package.*pip install 'splitloop\[{package}\]'"):
        make()


def test_import_engine_imports_neither_tracker():
    code = ("import sys, engine, engine.loggers; engine.loggers.WandB(); engine.loggers.MLflow(); "
            "assert not {'wandb', 'mlflow'} & set(sys.modules), 'imported'")
    process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert process.returncode == 0, process.stderr[-2000:]
