"""A hung checkpoint writer under ``CheckpointConfig(on_io_error="warn")``: the training process's
wait for it reaches the watchdog's deadline, reports it (hangs.jsonl and stderr: the writer's pid
or thread and the checkpoint), counts that checkpoint as not written (a warning), replaces the
writer — a writer process is SIGKILLed and started again, a writer thread stuck in a write is
abandoned (fenced: it can commit and delete nothing should it return) — and training goes on: the
later checkpoints commit and the run ends identical to one never interrupted. With the default
``"raise"`` the hang ends the process instead (tests/watchdog/test_hang_in_process.py)."""

from __future__ import annotations

import json
import pathlib

import pytest

import kill_helpers
from engine.watchdog import HANGS_FILE
from resume_helpers import assert_same_run

pytestmark = pytest.mark.slow

# The first allowance (a wait for the writer before its timeout is learned) is shorter than the
# scenarios' 60 s too: whether the stopped writer is met by a learned wait depends on how often the
# training process waited before. Not much shorter: a start on a loaded machine (torch's imports)
# has been seen to take 8 s.
WATCHDOG = ("--watchdog", "3", "--first-timeout", "20")


def run_hung_writer(tmp_path: pathlib.Path, faults: str, *options: str, hung_only: tuple[str, ...] = ()) -> tuple[str, dict]:
    """The reference run and the run with ``faults`` armed (on_io_error="warn"), which must end by
    itself; its stderr and the hangs.jsonl row of the hung writer, once both runs are checked
    identical. (A loaded machine may make a later commit outlast the test-sized timeout too: that
    writer is abandoned the same way, and changes nothing of the result.)"""
    reference, hung = str(tmp_path / "reference"), str(tmp_path / "hung")
    assert kill_helpers.run_scenario("tbptt", reference, None, *WATCHDOG, *options).returncode == 0
    process = kill_helpers.run_scenario("tbptt", hung, faults, *WATCHDOG, *options, *hung_only, "--on-io-error", "warn")
    assert process.returncode == 0, process.stderr[-3000:]
    assert "checkpoint not written, training goes on (on_io_error='warn')" in process.stderr, process.stderr[-3000:]
    assert "was abandoned" in process.stderr, process.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "hung" / HANGS_FILE).read_text().splitlines()]
    assert rows and all(row["phase"] == "waiting for the writer" and row["exit_code"] is None for row in rows), rows
    row = rows[0]
    assert row["rank"] == 0 and row["stalled_s"] >= 3.0 and "training goes on" in row["action"], row
    # Later checkpoints committed: the newest is the end of the run, after the abandoned one.
    assert_same_run(reference, hung)
    return process.stderr, row


def test_a_stopped_writer_process_is_killed_replaced_and_training_goes_on(tmp_path: pathlib.Path) -> None:
    # The writer process stops (SIGSTOP) before a data file of its 20th checkpoint: late enough
    # that the training process has learned how long it waits for the writer (3 s, not 20).
    stderr, row = run_hung_writer(tmp_path, "checkpoint_before_file:60:sigstop", "--writer", "process", "--epochs", "2")
    assert row["detail"].startswith("writer process ") and ", checkpoint of split " in row["detail"], row
    assert "killed (SIGKILL)" in row["action"] and row["process_state"].startswith("stopped by a signal"), row
    pid = int(row["detail"].split()[2].rstrip(","))
    assert f"writer process {pid}" in stderr


@pytest.mark.exhaustive
def test_a_writer_thread_stuck_in_a_write_is_abandoned_and_training_goes_on(tmp_path: pathlib.Path) -> None:
    # The writer thread sleeps for ever before a data file of its 20th checkpoint (a write that
    # never returns); a new thread takes over, the old one stays stuck (a daemon).
    stderr, row = run_hung_writer(tmp_path, "checkpoint_before_file:60:hang", "--async", "--epochs", "2")
    assert row["detail"].startswith("writer thread splitloop-checkpoint-writer (tid "), row
    assert ", checkpoint of split " in row["detail"] and "_hang_forever" in row["stacks"], row


@pytest.mark.exhaustive
@pytest.mark.parametrize("writer", [("--writer", "process"), ("--async",)], ids=["process", "thread"])
def test_with_when_behind_skip_a_hung_writer_is_abandoned_at_a_split_boundary(tmp_path: pathlib.Path,
                                                                             writer: tuple[str, ...]) -> None:
    # "skip" never waits for the writer: each split boundary looks at how long it has had its oldest
    # checkpoint, against a wait's timeout: learned from the writer's three writes before it
    # (warmup=3), whether or not anyone waited for them, not the first allowance (10 s here).
    # The writer hangs at its 4th checkpoint; the hung run sleeps 1 s per split (24 splits), so
    # that a boundary sees it before the end of fit's flush would.
    fault = "sigstop" if writer[0] == "--writer" else "hang"
    _, row = run_hung_writer(tmp_path, f"checkpoint_before_file:12:{fault}", *writer, "--epochs", "2",
                             "--when-behind", "skip", hung_only=("--sleep", "1.0", "--first-timeout", "10"))
    assert 3.0 <= row["timeout_s"] < 10.0 and row["stalled_s"] >= row["timeout_s"] and row["last_split"] <= 20, row
    assert ", checkpoint of split " in row["detail"], row
