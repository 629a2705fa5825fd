"""CheckpointConfig(every_n_splits="auto", mtbf_seconds=...): the failure rate the run's goodput
ledger observed over its earlier attempts replaces the prior when the run starts; "observed"
takes the ledger's only; None weighs none."""

from __future__ import annotations

import pathlib

import pytest

import engine
from engine.checkpoint.budget import OverheadBudget
from engine.checkpoint.store.storage import Storage
from engine.goodput.observed import observed_mtbf_seconds
from ledger_rows import AttemptWriter, write
from scenarios import train_with_checkpoints


def killed_then_finished(run_dir: pathlib.Path) -> None:
    """Attempt 1 trains from 4 s and is killed (its last row at 9 s, one beat, one split of a
    second: dead at 11 s); attempt 2 trains from 22.5 s to its end at 25 s. One failure in
    (11 - 4) + (25 - 22.5) = 9.5 s of training."""
    first = AttemptWriter("a1", process_start=0.0).start(2.0).restored(3.0).row("training", 4.0)
    first.commit(6.0, 2, 0.5).commit(8.0, 4, 0.5).row("beat", 9.0, units=5)
    second = AttemptWriter("a2", process_start=20.0).start(21.0).restored(22.0, units=4).row("training", 22.5)
    second.commit(24.0, 6, 0.5, epochs=1).end(25.0, "finished")
    write(run_dir, first, second)


def test_the_ledger_gives_the_training_time_per_failure(tmp_path):
    assert observed_mtbf_seconds(Storage(str(tmp_path))) is None  # no ledger
    killed_then_finished(tmp_path)
    assert observed_mtbf_seconds(Storage(str(tmp_path))) == pytest.approx(9.5)


@pytest.mark.parametrize("mtbf_seconds, with_ledger, weighed", [
    (3600.0, False, 3600.0),    # a prior, nothing observed yet
    (3600.0, True, 9.5),        # the observed rate replaces the prior
    ("observed", False, None),  # nothing observed: the budget alone
    ("observed", True, 9.5),
    (None, True, None),         # no failure rate weighed, whatever the ledger says
])
def test_a_run_weighs_the_failure_rate_its_ledger_observed(tmp_path, monkeypatch, mtbf_seconds, with_ledger, weighed):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if with_ledger:
        killed_then_finished(run_dir)
    budgets = []
    original = OverheadBudget.__init__

    def recording(self, max_overhead, mtbf_seconds=None):
        original(self, max_overhead, mtbf_seconds)
        budgets.append(self)

    monkeypatch.setattr(OverheadBudget, "__init__", recording)
    checkpoint = engine.CheckpointConfig(every_n_splits="auto", mtbf_seconds=mtbf_seconds)
    train_with_checkpoints("plain", str(run_dir), epochs=1, every="auto", checkpoint=checkpoint)
    (budget,) = budgets
    assert budget.mtbf_seconds == (pytest.approx(weighed) if weighed is not None else None)


def test_observed_is_the_only_word_mtbf_seconds_takes():
    with pytest.raises(engine.ConfigError, match="mtbf_seconds"):
        engine.CheckpointConfig(every_n_splits="auto", mtbf_seconds="often")
