"""Every benchmark script imports and parses its options, and those the README lists run whole in
their smoke mode (a refactor that breaks one shows here, not on the day someone needs its figures).
Reading their figures is for a person: tests never time."""

import pathlib
import re
import runpy
import sys

import pytest

import forkserver

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


def readme_benchmarks() -> list[str]:
    """The benchmark scripts the README's Benchmarks section tells a reader to run."""
    readme = pathlib.Path(__file__).parent.parent.joinpath("README.md").read_text()
    section = readme.split("## Benchmarks", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"python (benchmarks/\w+\.py)", section)


def test_the_readme_lists_benchmarks_that_exist():
    listed = readme_benchmarks()
    assert len(listed) >= 5
    assert {pathlib.Path(name).name for name in listed} <= {path.name for path in BENCHMARKS}


# The slowest smoke runs (about 20, 12 and 60 s: memory_tier's starts six torchrun jobs) are in
# the exhaustive run (CI time).
SLOW_SMOKE = {"checkpoint_io.py", "goodput_validation.py", "memory_tier.py"}


@pytest.mark.slow
@pytest.mark.parametrize("script", [pytest.param(name, marks=pytest.mark.exhaustive)
                                    if pathlib.Path(name).name in SLOW_SMOKE else name for name in readme_benchmarks()],
                         ids=lambda name: pathlib.Path(name).name)
def test_a_readme_benchmark_runs_to_its_figures_in_smoke_mode(script, tmp_path):
    # Each runs whole, every way it measures, at its smallest (--smoke): a refactor that breaks a
    # benchmark fails here, not on the day someone needs its figures. The figures mean nothing.
    root = pathlib.Path(__file__).parent.parent
    completed = forkserver.run([sys.executable, str(root / script), "--smoke"], cwd=str(tmp_path),
                               capture_output=True, text=True, timeout=240)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    last_line = completed.stdout.strip().splitlines()[-1]
    assert re.search(r": \d+\.\d+ ", last_line), last_line
    assert list(tmp_path.iterdir()) == [], "the benchmark left its temporary directory behind"
