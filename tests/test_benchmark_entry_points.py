"""Every benchmark script imports and parses its options (a refactor that breaks one shows here,
not on the day someone needs its figures). Running them is for a person: tests never time."""

import pathlib
import runpy
import sys

import pytest

BENCHMARKS = sorted(pathlib.Path(__file__).parent.parent.joinpath("benchmarks").glob("*.py"))


def test_there_are_benchmarks():
    assert {path.name for path in BENCHMARKS} >= {"checkpoint_overhead.py", "checkpoint_budget.py", "checkpoint_io.py",
                                                   "loop_overhead.py", "distributed_overhead.py"}


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda path: path.name)
def test_a_benchmark_prints_its_usage(script, monkeypatch, capsys):
    # As `python benchmarks/NAME.py --help` runs it (its folder first on the path), in this
    # process: torch is imported already.
    monkeypatch.setattr(sys, "argv", [script.name, "--help"])
    monkeypatch.syspath_prepend(str(script.parent))
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {script.name}")
