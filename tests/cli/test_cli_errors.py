"""The command line reports a problem in one `error: ...` line (the path and what to do) and a
non-zero exit status, never a traceback; Ctrl-C exits with 130."""

import os
import signal
import subprocess
import sys
import time

import pytest

import engine.run.run
from engine.cli.main import main


def error_line(capsys):
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


def test_demo_into_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert main(["demo", "--dir", str(tmp_path / "f"), "--epochs", "1", "--progress", "off"]) == 1
    line = error_line(capsys)
    assert str(tmp_path / "f") in line and "is an existing file, not a directory" in line


def test_demo_with_checkpoints_being_a_file(tmp_path, capsys):
    (tmp_path / "checkpoints").write_text("x")
    assert main(["demo", "--dir", str(tmp_path), "--epochs", "1", "--progress", "off"]) == 1
    assert "holds a file named 'checkpoints'" in error_line(capsys)


def test_demo_into_an_unwritable_dir(capsys):
    assert main(["demo", "--dir", "/proc/self", "--epochs", "1", "--progress", "off"]) == 1
    assert "cannot write to '/proc/self'" in error_line(capsys)


def test_inspect_of_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert main(["inspect", str(tmp_path / "f")]) == 1
    line = error_line(capsys)
    assert "is a file, not a run directory" in line and "does not exist" not in line


def test_chaos_on_a_used_dir(tmp_path, capsys):
    (tmp_path / "old-run").mkdir()
    assert main(["chaos", "--dir", str(tmp_path), "--trials", "1"]) == 1
    line = error_line(capsys)
    assert f"chaos --dir '{tmp_path}' is not empty" in line and "pass a new or empty directory" in line


def test_ctrl_c_in_the_demo_exits_130_with_one_line(tmp_path, capsys, monkeypatch):
    real_boundary = engine.run.run.FitRun._split_boundary
    calls = []

    def interrupted_boundary(self, *args):
        real_boundary(self, *args)
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(engine.run.run.FitRun, "_split_boundary", interrupted_boundary)
    assert main(["demo", "--dir", str(tmp_path), "--epochs", "1", "--progress", "off"]) == 130
    assert error_line(capsys) == "error: interrupted (Ctrl-C); committed checkpoints are kept: run the same command again to resume"
    assert len(list((tmp_path / "checkpoints").iterdir())) == 2


@pytest.mark.exhaustive  # CI time (about 25 s: the default run keeps Ctrl-C at random instants (test_save_on_exception))
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_real_sigint_stops_the_demo_without_a_traceback(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "SPLITLOOP_FAULTS"}
    process = subprocess.Popen([sys.executable, "-m", "engine", "demo", "--dir", str(tmp_path), "--epochs", "1", "--progress", "log"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               # Python ignores SIGINT when started with it ignored (a background job).
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    while not (tmp_path / "checkpoints").is_dir() or not list((tmp_path / "checkpoints").glob("ckpt-*")):
        assert process.poll() is None  # a hang is ended by the test's timeout, not by a clock here
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert "Traceback" not in err
    assert err.splitlines()[0].endswith(f"splitloop: starting fresh in {tmp_path}")
    assert err.splitlines()[-1] == "error: interrupted (Ctrl-C); committed checkpoints are kept: run the same command again to resume"
