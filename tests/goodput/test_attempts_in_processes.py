"""Real processes, really ended: SIGKILLed twice, preempted (SIGTERM), ended by an exception,
hung (the watchdog ends it), then finished. The ledger shows each attempt and its cause, its
buckets add up to the wall time, and no sample was skipped or seen twice. A kill at random
instants never leaves a torn or doubled row among the ledger's rows."""

from __future__ import annotations

import json
import pathlib
import random
import signal
import time

import pytest

import kill_helpers
from engine.checkpoint.store.storage import Storage
from engine.cli.main import main
from engine.goodput.account import Account, account
from engine.goodput.rows import rank_file
from engine.watchdog import HANG_EXIT_CODE
from scenarios import BATCH, SAMPLES

pytestmark = pytest.mark.slow

EPOCHS = 2
OPTIONS = ("--epochs", str(EPOCHS), "--watchdog", "2")
# (fault armed in the attempt, its exit status, the cause the ledger must give it)
ENDINGS = [
    ("split_end:5:sigkill", -signal.SIGKILL, "killed"),
    ("split_end:5:sigkill", -signal.SIGKILL, "killed"),
    ("split_end:4:sigterm", 75, "preempted"),
    ("split_end:3:raise", 1, "exception"),
    ("step_start:9:hang", HANG_EXIT_CODE, "hang"),
    (None, 0, "finished"),
]


# CI time: the six-attempt run (about a minute of processes) is in the exhaustive run; the
# default run keeps the random-instant kills below (the real ledger writer, whole rows) and the
# hand-written ledgers of tests/goodput/test_account.py (causes and buckets).
CHAOS_RUN = pytest.mark.exhaustive


@pytest.fixture(scope="module")
def chaos_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, Account, float, float]:
    run_dir = tmp_path_factory.mktemp("goodput") / "run"
    began = time.time()
    for faults, status, _ in ENDINGS:
        process = kill_helpers.run_scenario("tbptt", str(run_dir), faults, *OPTIONS)
        assert process.returncode == status, (faults, process.returncode, process.stderr[-3000:])
    ended = time.time()
    found = account(Storage(str(run_dir)))
    assert found is not None
    return run_dir, found, began, ended


@CHAOS_RUN
def test_each_attempt_has_its_cause(chaos_run) -> None:
    _, found, _, _ = chaos_run
    assert [attempt.cause for attempt in found.attempts] == [cause for _, _, cause in ENDINGS]
    assert found.failures == 4 and found.ended


@CHAOS_RUN
def test_the_buckets_add_up_to_the_wall_time(chaos_run) -> None:
    _, found, began, ended = chaos_run
    assert sum(found.buckets.values()) == pytest.approx(found.wall_s, rel=0.01)
    # The wall time lies within what the test saw (the kernel's start time has a 10 ms tick).
    assert began - 0.02 <= found.attempts[0].process_start and found.attempts[-1].ended_at <= ended + 0.02
    buckets = found.buckets
    assert buckets["work_lost"] > 0 and buckets["down"] > 0 and buckets["restore"] > 0
    assert buckets["hang_detection"] >= 2.0  # Watchdog(min_timeout_s=2): at least that without progress
    assert buckets["checkpoint_stall"] > 0 and buckets["productive"] > 0


@CHAOS_RUN
def test_no_sample_was_skipped_or_seen_twice(chaos_run) -> None:
    _, found, _, _ = chaos_run
    assert (found.samples.trained, found.samples.skipped, found.samples.seen_twice) == (EPOCHS * SAMPLES, 0, 0)
    assert SAMPLES % BATCH == 0  # every sample is in a batch: an epoch trains each once


@CHAOS_RUN
def test_the_command_prints_the_account(chaos_run, capsys) -> None:
    run_dir, found, _, _ = chaos_run
    assert main(["goodput", str(run_dir)]) == 0
    text = capsys.readouterr().out
    assert f"samples: {EPOCHS * SAMPLES} trained, 0 skipped, 0 seen twice" in text
    assert "attempts: 6 (1 finished, 1 preempted, 1 exception, 1 hang, 2 killed)" in text
    assert main(["goodput", str(run_dir), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["attempts"] == 6 and printed["failures"] == 4
    assert main(["inspect", str(run_dir)]) == 0
    assert "samples: 24 trained, 0 skipped, 0 seen twice" in capsys.readouterr().out


@CHAOS_RUN
def test_the_model_takes_the_runs_costs(chaos_run, capsys) -> None:
    run_dir, _, _, _ = chaos_run
    assert main(["goodput", "--simulate", "--gpus", "10000", "--from", str(run_dir), "--trials", "20"]) == 0
    text = capsys.readouterr().out
    assert "costs: measured in" in text and "Young/Daly" in text and "measured " in text


def test_kills_at_random_instants_leave_whole_rows(tmp_path: pathlib.Path) -> None:
    run_dir = str(tmp_path / "run")
    rng = random.Random(35)
    for _ in range(3):  # each started training (its start row is written) before the kill, or finished
        kill_helpers.kill_at_random_instant("tbptt", run_dir, rng, 1.5, "--epochs", "1")
    assert kill_helpers.run_scenario("tbptt", run_dir, None, "--epochs", "1").returncode == 0
    lines = (tmp_path / "run" / rank_file(0)).read_bytes().split(b"\n")
    assert lines[-1] == b""  # the finished attempt's last row is whole
    rows = []
    for line in lines[:-1]:
        try:
            rows.append(json.loads(line))
        except ValueError:  # a row cut by a kill: alone on its line, never glued to the next one
            assert line.count(b'"attempt"') <= 1
    keys = [(row["attempt"], row["seq"]) for row in rows]
    assert len(keys) == len(set(keys))
    by_attempt: dict[str, list[int]] = {}
    for attempt, seq in keys:
        by_attempt.setdefault(attempt, []).append(seq)
    assert len(by_attempt) == 4
    for seqs in by_attempt.values():  # in order, no row missing before the last
        assert seqs == list(range(len(seqs)))
    found = account(Storage(run_dir))
    assert found is not None and found.samples.skipped == found.samples.seen_twice == 0
    assert found.samples.trained == SAMPLES


# The default run keeps one sequence (two kills, a preemption, an exception, a hang) with a
# checkpoint every split; this matrix adds asynchronous writes, sparser checkpoints and more kills.
@pytest.mark.exhaustive
@pytest.mark.parametrize("kills", [1, 3])
@pytest.mark.parametrize("options", [("--async",), ("--every", "3"), ("--every", "5", "--async")],
                         ids=["async", "every-3", "every-5-async"])
def test_a_run_killed_n_times_has_n_plus_one_attempts_and_exact_samples(tmp_path: pathlib.Path, kills: int,
                                                                         options: tuple[str, ...]) -> None:
    run_dir = str(tmp_path / "run")
    for _ in range(kills):
        process = kill_helpers.run_scenario("tbptt", run_dir, "split_end:6:sigkill", "--epochs", "2", *options)
        assert process.returncode == -signal.SIGKILL, process.stderr[-3000:]
    assert kill_helpers.run_scenario("tbptt", run_dir, None, "--epochs", "2", *options).returncode == 0
    found = account(Storage(run_dir))
    assert found is not None
    assert [attempt.cause for attempt in found.attempts] == ["killed"] * kills + ["finished"]
    assert sum(found.buckets.values()) == pytest.approx(found.wall_s, rel=0.01)
    assert (found.samples.trained, found.samples.skipped, found.samples.seen_twice) == (2 * SAMPLES, 0, 0)
