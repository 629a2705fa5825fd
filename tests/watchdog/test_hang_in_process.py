"""A process that trains alone and hangs (a ``hang`` fault: it sleeps forever at a fault point,
as user code stuck in a wait) is reported by its own monitor thread — phase, last split, the
stacks of every thread — on stderr and in hangs.jsonl, and ends with the hang exit code; started
again, it resumes from its newest checkpoint and ends bit-identical to a run never interrupted."""

from __future__ import annotations

import json
import pathlib

import pytest

import kill_helpers
from engine.watchdog import HANG_EXIT_CODE, HANGS_FILE
from resume_helpers import assert_same_run

pytestmark = pytest.mark.slow

WATCHDOG = ("--watchdog", "2", "--epochs", "1")


def test_a_hung_step_is_reported_ended_and_resumed_exactly(tmp_path: pathlib.Path) -> None:
    reference, hung = str(tmp_path / "reference"), str(tmp_path / "hung")
    assert kill_helpers.run_scenario("tbptt", reference, None, *WATCHDOG).returncode == 0
    process = kill_helpers.run_scenario("tbptt", hung, "step_start:9:hang", *WATCHDOG)
    assert process.returncode == HANG_EXIT_CODE, process.stderr[-3000:]
    assert "rank 0" in process.stderr and "hung in phase 'step'" in process.stderr, process.stderr[-3000:]
    assert "_hang_forever" in process.stderr  # the main thread's stack, dumped by the monitor thread
    rows = [json.loads(line) for line in (tmp_path / "hung" / HANGS_FILE).read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["phase"] == "step" and rows[0]["rank"] == 0
    assert rows[0]["last_split"] == 8 and rows[0]["stalled_s"] >= 2.0  # 8 splits done, the 9th hung
    assert "_hang_forever" in rows[0]["stacks"]
    assert kill_helpers.run_scenario("tbptt", hung, None, *WATCHDOG).returncode == 0
    assert_same_run(reference, hung)


@pytest.mark.exhaustive
@pytest.mark.parametrize("faults, options, detail", [
    # The writer process stops (SIGSTOP) before a data file; the training process waits for a slot.
    # Late enough that the training process has learned how long it waits for the writer.
    ("checkpoint_before_file:50:sigstop", ("--writer", "process", "--epochs", "2"), "writer process "),
    # A storage write that never returns, in the background writer thread.
    ("filesystem_write:30:hang", ("--async",), ""),
], ids=["writer-process-stopped", "storage-write-blocks"])
def test_a_hung_writer_is_reported_and_the_run_resumes_exactly(tmp_path: pathlib.Path, faults: str,
                                                               options: tuple[str, ...], detail: str) -> None:
    reference, hung = str(tmp_path / "reference"), str(tmp_path / "hung")
    assert kill_helpers.run_scenario("tbptt", reference, None, *WATCHDOG, *options).returncode == 0
    process = kill_helpers.run_scenario("tbptt", hung, faults, *WATCHDOG, *options)
    assert process.returncode == HANG_EXIT_CODE, process.stderr[-3000:]
    row = json.loads((tmp_path / "hung" / HANGS_FILE).read_text())
    if detail:  # the training process waits for the stopped writer process, which it names
        assert row["phase"] == "waiting for the writer" and row["detail"].startswith(detail), row
    else:  # the write blocks on the training thread (checkpoint) or on the writer thread, which it waits for
        assert row["phase"] in ("checkpoint", "waiting for the writer") and "_hang_forever" in row["stacks"], row
    assert kill_helpers.run_scenario("tbptt", hung, None, *WATCHDOG, *options).returncode == 0
    assert_same_run(reference, hung)
