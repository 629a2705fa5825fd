"""``python -m engine launch``: a committed preemption becomes exit status 75."""

from __future__ import annotations

import json
import pathlib
import sys

from engine.cli.main import main
from engine.distributed import preemption_marker


def test_the_command_status_passes_through_without_a_marker(tmp_path: pathlib.Path) -> None:
    assert main(["launch", "--marker", str(tmp_path / "m.json"), "--", sys.executable, "-c", "raise SystemExit(3)"]) == 3


def test_a_marker_written_by_the_run_becomes_75(tmp_path: pathlib.Path) -> None:
    script = ("import os, json; json.dump({'reason': 'preempted by SIGTERM', 'checkpoint': 'ckpt-0000000004'}, "
              "open(os.environ['SPLITLOOP_PREEMPTION_MARKER'], 'w'))")
    marker = tmp_path / "m.json"
    assert main(["launch", "--marker", str(marker), "--", sys.executable, "-c", script]) == 75
    assert not marker.exists()
    assert main(["launch", "--marker", str(marker), "--exit-code", "99", "--", sys.executable, "-c", script]) == 99


def test_a_stale_marker_of_an_earlier_run_is_ignored(tmp_path: pathlib.Path) -> None:
    marker = tmp_path / "m.json"
    marker.write_text(json.dumps({"reason": "old"}))
    assert main(["launch", "--marker", str(marker), "--", sys.executable, "-c", "pass"]) == 0


def test_a_preempted_worker_of_several_exits_0_under_torchrun_and_writes_the_marker(tmp_path: pathlib.Path, monkeypatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert preemption_marker.preempted_exit_status(75) == 75
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert preemption_marker.preempted_exit_status(75) == 75  # one worker: torchrun restarts it, as before
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert preemption_marker.preempted_exit_status(75) == 0
    monkeypatch.setenv(preemption_marker.MARKER_VARIABLE, str(tmp_path / "m.json"))
    preemption_marker.write_preemption_marker("preempted by SIGTERM", "ckpt-0000000002")
    assert json.loads((tmp_path / "m.json").read_text())["checkpoint"] == "ckpt-0000000002"
