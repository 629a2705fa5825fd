"""The command line: the demo is deterministic and resumable, inspect reports what it finds."""

import json
import os
import subprocess
import sys

import pytest

import forkserver
from engine.cli.main import main

FINGERPRINT_PREFIX = "fingerprint: "


def run_cli(*args, faults=None, check=True, fresh=False):
    """``python -m engine ARGS`` in a child forked from the tests' fork server, or, with
    ``fresh``, in a plain new interpreter (the real entry point, imports included)."""
    env = dict(os.environ)
    env.pop("SPLITLOOP_FAULTS", None)
    env["OMP_NUM_THREADS"] = "1"  # a tiny model: threads only contend on a loaded machine
    if faults:
        env["SPLITLOOP_FAULTS"] = faults
    start = subprocess.run if fresh else forkserver.run
    process = start([sys.executable, "-m", "engine", *args], capture_output=True, text=True, env=env, timeout=300)
    if check:
        assert process.returncode == 0, process.stderr[-3000:]
    return process


def fingerprint_of(output):
    last = output.strip().splitlines()[-1]
    assert last.startswith(FINGERPRINT_PREFIX), last
    value = last[len(FINGERPRINT_PREFIX):]
    assert len(value) == 64 and int(value, 16) >= 0
    return value


@pytest.mark.slow
def test_demo_is_deterministic_and_resumes_exactly(tmp_path):
    first = run_cli("demo", "--dir", str(tmp_path / "a"), "--epochs", "2", "--progress", "off", fresh=True)
    second = run_cli("demo", "--dir", str(tmp_path / "b"), "--epochs", "2", "--progress", "off")
    assert fingerprint_of(first.stdout) == fingerprint_of(second.stdout)

    killed = run_cli("demo", "--dir", str(tmp_path / "c"), "--epochs", "2", "--progress", "off",
                     faults="split_end_after_checkpoint:17:sigkill", check=False)
    assert killed.returncode == -9
    resumed = run_cli("demo", "--dir", str(tmp_path / "c"), "--epochs", "2", "--progress", "off")
    assert "resumed from" in resumed.stdout
    assert fingerprint_of(resumed.stdout) == fingerprint_of(first.stdout)
    assert (tmp_path / "a" / "metrics.jsonl").read_bytes() == (tmp_path / "c" / "metrics.jsonl").read_bytes()

    # Another seed is another run from its first split on (one epoch is enough to see it).
    run_cli("demo", "--dir", str(tmp_path / "d"), "--epochs", "1", "--seed", "1", "--progress", "off")
    first_row, other_first_row = (json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0]) for name in "ad")
    assert other_first_row["loss"] != first_row["loss"]

    report = json.loads(run_cli("inspect", str(tmp_path / "c"), "--json").stdout)
    assert report["fingerprint"] == fingerprint_of(first.stdout)
    assert report["latest"] == report["checkpoints"][-1]["name"]
    assert all(entry["valid"] and entry["error"] is None for entry in report["checkpoints"])
    assert report["checkpoints"][-1]["cursor"] == {"epoch": 1, "batch": 5, "split": 3, "optimizer": 0}


def test_demo_writes_metrics_lines(tmp_path, capsys):
    assert main(["demo", "--dir", str(tmp_path), "--epochs", "1", "--progress", "off"]) == 0
    output = capsys.readouterr().out
    fingerprint_of(output)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 24  # 6 windows x 4 splits
    assert [(l["epoch"], l["batch"], l["split"]) for l in lines[:5]] == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3), (0, 1, 0)]
    assert all(isinstance(l["loss"], float) for l in lines)


def test_inspect_table_and_empty_dir(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 0
    assert "no checkpoints" in capsys.readouterr().out


@pytest.mark.parametrize("command, flags", [
    ("demo", ["--dir", "--epochs", "--seed", "--checkpoint-every", "--fresh", "--progress"]),
    ("inspect", ["--json"]),
])
def test_help_explains_every_flag(command, flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in flags:
        assert flag in text


def test_faults_lists_points_and_kinds(capsys):
    from engine import faults

    assert main(["faults"]) == 0
    text = capsys.readouterr().out
    for point in faults.POINTS:
        assert point in text
    for kind in faults.KINDS:
        assert kind in text


def test_inspect_of_a_missing_dir_is_an_error_and_creates_nothing(tmp_path, capsys):
    missing = tmp_path / "typo"
    assert main(["inspect", str(missing)]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert not missing.exists()


def small_run(run_dir):
    import engine
    import torch
    from misuse_helpers import Plain

    rows = [torch.randn(2, 3, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    engine.Trainer(engine.TrainerConfig(max_epochs=2, run_dir=str(run_dir), progress_bar="off")).fit(Plain(), rows)


@pytest.mark.parametrize("command", [["inspect"], pytest.param(["inspect", "--json"], marks=pytest.mark.exhaustive),
                                     ["--help"]], ids=["table", "json", "help"])  # json: CI time (the table's path)
def test_output_into_a_closed_pipe_ends_quietly(tmp_path, command):
    """``splitloop inspect DIR | head``: once the reader is gone, no ``error: [Errno 32] Broken
    pipe`` and no traceback; the status is the shell's for a process ended by SIGPIPE."""
    small_run(tmp_path)
    arguments = [*command, str(tmp_path)] if command[0] == "inspect" else command
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line is written
    try:
        process = subprocess.run([sys.executable, "-m", "engine", *arguments], stdout=write_end,
                                 stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write_end)
    assert process.stderr == ""
    assert process.returncode in ((0, 141) if command == ["--help"] else (141,))


def test_usage_names_the_command_that_was_run(capsys):
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="splitloop")
    with pytest.raises(SystemExit):
        script.load()(["--help"])
    assert capsys.readouterr().out.startswith("usage: splitloop ")
    as_module = forkserver.run([sys.executable, "-m", "engine", "--help"], capture_output=True, text=True, timeout=300)
    assert as_module.stdout.startswith("usage: python -m engine ")
