"""Crash loops (engine.watchdog.crash_loop): the rule on recorded attempts, and a run that fails the
same way at every start stops with the "do not requeue" code and one verdict line, while a run that
makes progress between failures is never stopped by it."""

from __future__ import annotations

import json
import pathlib

import pytest

import engine
import scenarios
from engine.watchdog import CRASH_LOOP_EXIT_CODE
from engine.watchdog.crash_loop import verdict


def start(source: str | None) -> dict:
    return {"event": "start", "from": source}


def failed(source: str | None, at: str, error: str = "ValueError: bad") -> dict:
    return {"event": "failed", "from": source, "at": at, "error": error}


def test_failures_from_one_checkpoint_are_a_loop_failures_that_move_on_are_not() -> None:
    def failing(source: str | None, at: str) -> list[dict]:
        return [start(source), failed(source, at, f"ValueError: at {at}")]

    assert verdict([*failing("ckpt-1", "a"), *failing("ckpt-1", "b")], "ckpt-1", 3) is None
    looping = verdict([*failing("ckpt-1", "a"), *failing("ckpt-1", "b"), *failing("ckpt-1", "c")], "ckpt-1", 3)
    assert looping is not None and "restarted 3 times from ckpt-1" in looping
    assert verdict([*failing("ckpt-1", "a"), *failing("ckpt-2", "b"), *failing("ckpt-3", "c")], "ckpt-4", 3) is None
    assert verdict([*failing("ckpt-1", "a"), *failing("ckpt-1", "b"), {"event": "end"}, *failing("ckpt-1", "c")],
                   "ckpt-1", 3) is None


def test_attempts_killed_from_outside_before_a_commit_are_no_loop() -> None:
    # SIGKILLs at random instants, several before the next commit: the job must be requeued.
    assert verdict([start("ckpt-1")] * 5, "ckpt-1", 3) is None
    assert verdict([start("ckpt-1"), failed("ckpt-1", "a"), start("ckpt-1"), start("ckpt-1"),
                    start("ckpt-1")], "ckpt-1", 3) is None


def test_the_same_exception_at_the_same_split_twice_is_deterministic() -> None:
    rows = [start(None), failed(None, "split 5"), start("ckpt-4"), failed("ckpt-4", "split 5")]
    text = verdict(rows, "ckpt-4", 3)
    assert text is not None and "deterministic failure at split split 5" in text and "Rollback" in text
    other = [start(None), failed(None, "split 5"), start("ckpt-4"), failed("ckpt-4", "split 9")]
    assert verdict(other, "ckpt-8", 3) is None
    assert verdict([start(None), failed(None, "split 5", "ValueError: a"), start(None),
                    failed(None, "split 5", "KeyError: b")], None, 3) is None


class FailAtStep(engine.Callback):
    """Raises the same exception at the end of the split that makes optimizer step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_split_end(self, view: engine.RunView) -> None:
        if view.optimizer_steps == self.step:
            raise ValueError(f"poisoned at step {self.step}")


def fit(run_dir: pathlib.Path, step: int | None) -> engine.FitResult:
    callbacks = () if step is None else (FailAtStep(step),)
    return scenarios.train_with_checkpoints("tbptt", str(run_dir), epochs=1, callbacks=callbacks)


def test_a_run_failing_at_the_same_split_every_time_stops_with_the_verdict(tmp_path: pathlib.Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    for _ in range(2):
        with pytest.raises(ValueError, match="poisoned at step 3"):
            fit(tmp_path, 3)
    with pytest.raises(SystemExit) as stopped:
        fit(tmp_path, 3)
    assert stopped.value.code == CRASH_LOOP_EXIT_CODE
    err = capsys.readouterr().err
    assert err.count("crash loop: deterministic failure") == 1 and "poisoned at step 3" in err


def test_a_run_that_progresses_between_failures_is_never_stopped(tmp_path: pathlib.Path) -> None:
    for step in (3, 5, 7, 9):
        with pytest.raises(ValueError, match=f"poisoned at step {step}"):
            fit(tmp_path, step)
    assert fit(tmp_path, None).epochs_completed == 1  # trained to its end


def test_inspect_shows_the_crash_loop_verdict_and_the_hangs(tmp_path: pathlib.Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from engine.cli.main import main

    for _ in range(2):
        with pytest.raises(ValueError):
            fit(tmp_path, 3)
    hang = {"rank": 1, "host": "node7", "phase": "boundary", "stalled_s": 300.4, "last_split": 12, "reported_by": 0}
    (tmp_path / "hangs.jsonl").write_text(json.dumps(hang) + "\n")
    capsys.readouterr()
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "hang: rank 1 on node7 in phase 'boundary' for 300.4 s after split 12 (reported by rank 0)" in out
    assert "crash loop: deterministic failure" in out and f"the next start exits {CRASH_LOOP_EXIT_CODE}" in out
