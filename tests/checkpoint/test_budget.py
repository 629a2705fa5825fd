"""CheckpointConfig(every_n_splits="auto", max_overhead=...): the interval follows the measured
cost, is bounded, is reported, and a run checkpointed that way resumes exactly."""

import pytest

import engine
import engine.errors
from engine import faults
from engine.checkpoint.budget import AUTO_MAX_INTERVAL, OverheadBudget
from resume_helpers import assert_same_run
from scenarios import train_with_checkpoints


def test_the_interval_keeps_blocking_within_the_budget():
    budget = OverheadBudget(0.05)
    # 10 ms of blocking after one split of 20 ms: 5% of a split is 1 ms, so 10 splits.
    assert budget.record(0.010, 0.020, 1) == 10
    budget = OverheadBudget(0.10)
    # 1 ms of blocking after 4 splits of 10 ms each: 10% of a split is 1 ms, so every split.
    assert budget.record(0.001, 0.040, 4) == 1


def test_the_interval_is_capped():
    budget = OverheadBudget(0.05)
    assert budget.record(5.0, 0.001, 1) == AUTO_MAX_INTERVAL == 64


def test_a_cheaper_checkpoint_shortens_the_interval():
    budget = OverheadBudget(0.05)
    first = budget.record(0.010, 0.020, 1)
    for _ in range(10):
        later = budget.record(0.0005, 0.020, 1)
    assert later < first and later == 1


@pytest.mark.parametrize("settings, field", [(dict(every_n_splits="sometimes"), "every_n_splits"),
                                             (dict(every_n_splits="auto", max_overhead=0), "max_overhead"),
                                             (dict(every_n_splits="auto", max_overhead=1.5), "max_overhead")])
def test_budget_settings_are_validated(settings, field):
    with pytest.raises(engine.ConfigError, match=field):
        engine.CheckpointConfig(**settings)


def test_the_interval_is_reported_in_the_result_and_the_log(tmp_path, capsys):
    result = train_with_checkpoints("tbptt", str(tmp_path / "run"), every="auto", progress_bar="log")
    assert isinstance(result.checkpoint_interval, int) and 1 <= result.checkpoint_interval <= AUTO_MAX_INTERVAL
    assert f"(every {result.checkpoint_interval} splits)" in capsys.readouterr().err
    fixed = train_with_checkpoints("tbptt", str(tmp_path / "fixed"), every=3)
    assert fixed.checkpoint_interval == 3


def test_a_run_checkpointed_by_budget_resumes_exactly(tmp_path):
    reference = str(tmp_path / "reference")
    train_with_checkpoints("tbptt", reference)
    run_dir = str(tmp_path / "run")
    faults.inject([faults.Fault("split_end", 11, "raise")])
    try:
        with pytest.raises(engine.errors.InjectedFault):
            train_with_checkpoints("tbptt", run_dir, every="auto")
    finally:
        faults.clear()
    result = train_with_checkpoints("tbptt", run_dir, every="auto")
    assert result.resumed_from is not None
    assert_same_run(reference, run_dir)
