"""Rollback past a numerical anomaly: a poisoned sample (NaN input, or a target that makes the
loss spike) never reaches an optimizer step; the run restores an earlier checkpoint in the
same process, skips the batch, and ends with finite weights; anomalies.jsonl names each
anomalous split; and the same run SIGKILLed at any instant (between the rollback and its
commit too) ends bit-identical to the uninterrupted rollback run."""

from __future__ import annotations

import json
import pathlib
import random

import pytest
import torch

import engine
from engine.checkpoint.store.storage import Storage
from engine.cli.main import main
from engine.cli.plot import draw, read_curves
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from kill_helpers import kill_at_random_instant, run_scenario
from resume_helpers import assert_same_run
from rollback_scenario import POISONED_FROM_TIME, POISONED_SAMPLE, train_poisoned
from scenarios import BATCH, SPLIT, TIME, build, train_with_checkpoints

SCRIPT = str(pathlib.Path(__file__).parent.parent / "rollback_scenario.py")
# The split the poison reaches first, in each of the two epochs (the data is not shuffled).
ANOMALOUS = [(epoch, POISONED_SAMPLE // BATCH, POISONED_FROM_TIME // SPLIT, 0) for epoch in (0, 1)]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The uninterrupted rollback run of each poison (in this process, as the kill tests' references)."""
    cache = {}

    def reference(poison):
        if poison not in cache:
            run_dir = str(tmp_path_factory.mktemp(f"reference-{poison}"))
            with pytest.warns(UserWarning, match="rolled back to"):
                model, result = train_poisoned(poison, run_dir)
            cache[poison] = run_dir, model, result
        return cache[poison]

    return reference


def anomaly_rows(run_dir):
    return [json.loads(line) for line in pathlib.Path(run_dir, "anomalies.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("poison, kind", [("nan", "non-finite loss"), ("spike", "loss spike")])
def test_a_poisoned_sample_is_rolled_back_past_and_the_weights_stay_finite(references, poison, kind):
    run_dir, model, result = references(poison)
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())
    rows = anomaly_rows(run_dir)
    assert [tuple(row["split"]) for row in rows] == ANOMALOUS
    assert [row["kind"] for row in rows] == [kind, kind]
    assert [row["skipped_batches"] for row in rows] == [[[epoch, batch]] for epoch, batch, _, _ in ANOMALOUS]
    for row in rows:  # each went back to a committed checkpoint taken before the anomalous split
        assert tuple(row["rolled_back_cursor"]) < tuple(row["split"])
    assert result.epochs_completed == 2


def test_without_rollback_the_poison_reaches_the_weights(tmp_path):
    model, _ = train_poisoned("nan", str(tmp_path), anomaly=None)
    assert not all(torch.isfinite(parameter).all() for parameter in model.parameters())


def test_the_skipped_batches_are_in_the_committed_progress(references):
    run_dir, _, _ = references("nan")
    latest = CheckpointStore(Storage(run_dir, create=False), create=False).latest()
    assert [anomaly.split.as_tuple() for anomaly in latest.progress.anomalies] == ANOMALOUS
    assert "non-finite loss nan at epoch 1, batch 1, split 2" in latest.progress.anomalies[1].describe()


def test_inspect_lists_each_rollback(references, capsys):
    run_dir, _, _ = references("nan")
    assert main(["inspect", run_dir]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("anomaly: ")]
    assert len(lines) == 2
    assert lines[0].startswith("anomaly: non-finite loss nan at epoch 0, batch 1, split 2, optimizer 0: rolled back to ckpt-")
    assert lines[1].endswith("skipped epoch 1 batch 1")
    assert main(["inspect", run_dir, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [tuple(row["split"]) for row in report["anomalies"]] == ANOMALOUS


def test_plot_marks_each_rollback(references):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    run_dir, _, _ = references("spike")
    curves = read_curves(run_dir)
    figure = draw(curves, pyplot, "run")
    try:
        steps = [row["step"] for row in anomaly_rows(run_dir)]
        for panel in figure.axes[:len(curves.families())]:  # the step panels (a last one: the attempts' timeline)
            marks = [line.get_xdata()[0] for line in panel.get_lines() if line.get_linestyle() == ":"]
            assert marks == steps
        texts = [text.get_text() for text in figure.axes[0].texts]
        assert sum(text.startswith("loss spike: back to ckpt-") for text in texts) == 2
    finally:
        pyplot.close(figure)


@pytest.mark.timeout(180)  # the old code rolled back forever
def test_a_rollback_to_a_checkpoint_older_than_an_earlier_rollback_keeps_skipping_its_batches(tmp_path, monkeypatch):
    """As if every newer checkpoint were unreadable: each rollback goes back to the first one,
    which predates the first rollback. Both skips stay recorded (and skipped), the run ends."""
    from engine.run import state as run_state
    from engine.run.rollback import Rollbacks

    def oldest(self, latest_steps):
        return self._checkpoints.store.load(self._checkpoints.existing_names()[0], run_state.validate)

    monkeypatch.setattr(Rollbacks, "_newest_before", oldest)
    with pytest.warns(UserWarning, match="rolled back to"):
        model, result = train_poisoned("nan", str(tmp_path))  # keep_last=None: the first checkpoint stays
    assert [tuple(row["split"]) for row in anomaly_rows(str(tmp_path))] == ANOMALOUS
    assert result.epochs_completed == 2
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())


def test_max_rollbacks_stops_the_run_with_a_clear_error(tmp_path):
    with pytest.warns(UserWarning, match="rolled back to"):
        with pytest.raises(engine.AnomalyError, match=r"after 1 rollback\(s\): Rollback.max_rollbacks=1 reached"):
            train_poisoned("nan", str(tmp_path), anomaly=engine.Rollback(max_rollbacks=1))


def test_no_checkpoint_old_enough_is_a_clear_error(tmp_path):
    with pytest.raises(engine.AnomalyError, match="no committed checkpoint to roll back to .Rollback.back=1000"):
        train_poisoned("nan", str(tmp_path), anomaly=engine.Rollback(back=1000))


def test_back_goes_back_at_least_that_many_optimizer_steps(tmp_path):
    with pytest.warns(UserWarning, match="rolled back to"):
        model, _ = train_poisoned("nan", str(tmp_path), anomaly=engine.Rollback(back=3))
    first = anomaly_rows(str(tmp_path))[0]
    _, batch, split, _ = first["split"]
    steps_at_anomaly = batch * (TIME // SPLIT) + split  # one optimizer step per completed split before it
    restored = CheckpointStore(Storage(str(tmp_path), create=False), create=False).load(first["rolled_back_to"])
    assert restored.progress.records["flow.optimizer_steps"].total.completed <= steps_at_anomaly - 3
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())


class Regressor(engine.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def overflowing_batches():
    """Six small regression batches; batch 2 has a target of 100: its loss is finite, but its
    gradient times the scaler's first scale (65536) overflows float16."""
    generator = torch.Generator().manual_seed(3)
    batches = []
    for index in range(6):
        x = torch.randn(4, 4, generator=generator) * 0.01
        y = x.sum(dim=1, keepdim=True) * 0.5
        if index == 2:
            y[0, 0] = 100.0
        batches.append((x, y))
    return batches


def test_a_scaler_skipped_step_under_16_mixed_is_not_an_anomaly(tmp_path):
    finals = {}
    for name, anomaly in (("plain", None), ("watched", engine.Rollback())):
        model = Regressor()
        config = engine.TrainerConfig(run_dir=str(tmp_path / name), progress_bar="off", precision="16-mixed",
                                      anomaly=anomaly)
        result = engine.Trainer(config).fit(model, overflowing_batches())
        finals[name] = result, [parameter.detach().clone() for parameter in model.parameters()]
    flow = CheckpointStore(Storage(str(tmp_path / "watched"))).latest().state["loops"]["flow"]
    assert flow["skipped_steps"] == 1  # the scaler skipped batch 2's step
    assert not (tmp_path / "watched" / "anomalies.jsonl").exists()
    assert finals["watched"][0].optimizer_steps == finals["plain"][0].optimizer_steps == 5
    for mine, theirs in zip(finals["watched"][1], finals["plain"][1], strict=True):
        assert torch.equal(mine, theirs)


class SqrtRegressor(Regressor):
    """Its loss is the mean square root of the error: finite (zero) where the prediction is
    exact, but with a NaN gradient there. A batch flagged ``exact`` targets the prediction."""

    def training_step(self, batch):
        x, y, exact = batch
        prediction = self.layer(x)
        if exact:
            y = prediction.detach()
        return torch.sqrt((prediction - y).abs()).mean()


def test_non_finite_gradients_of_a_finite_loss_never_reach_the_step(tmp_path):
    batches = [(x, y, index == 2) for index, (x, y) in enumerate(overflowing_batches())]
    model = SqrtRegressor()
    config = engine.TrainerConfig(run_dir=str(tmp_path / "run"), progress_bar="off", anomaly=engine.Rollback())
    with pytest.warns(UserWarning, match="non-finite gradients nan at epoch 0, batch 2"):
        engine.Trainer(config).fit(model, batches)
    without = SqrtRegressor()  # the same training on the data without batch 2, by hand
    optimizer = without.configure_optimizers()
    for batch in batches[:2] + batches[3:]:
        optimizer.zero_grad()
        without.training_step(batch).backward()
        optimizer.step()
    for mine, theirs in zip(model.parameters(), without.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    assert [row["kind"] for row in anomaly_rows(str(tmp_path / "run"))] == ["non-finite gradients"]


def test_rollback_with_manual_optimization_is_refused(tmp_path):
    model, loader = build("manual")
    config = engine.TrainerConfig(run_dir=str(tmp_path), progress_bar="off", anomaly=engine.Rollback())
    with pytest.raises(engine.ConfigError, match="Rollback needs automatic optimization"):
        engine.Trainer(config).fit(model, loader)


@pytest.mark.parametrize("field, value", [("factor", 1.0), ("factor", -2), ("window", 0), ("back", -1),
                                          ("skip_batches", 0), ("max_rollbacks", 0)])
def test_invalid_rollback_settings_name_the_field(field, value):
    with pytest.raises(engine.ConfigError, match=f"Rollback.{field}: expected"):
        engine.Rollback(**{field: value})


@pytest.mark.slow
@pytest.mark.parametrize("hit", [1, 2])
def test_sigkill_between_a_rollback_and_its_commit_resumes_to_the_same_end(references, tmp_path, hit):
    reference_dir, _, _ = references("nan")
    run_dir = str(tmp_path / "run")
    killed = run_scenario("nan", run_dir, f"after_rollback:{hit}:sigkill", script=SCRIPT)
    assert killed.returncode == -9, killed.stderr[-3000:]
    finished = run_scenario("nan", run_dir, None, script=SCRIPT)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert_same_run(reference_dir, run_dir)
    assert [tuple(row["split"]) for row in anomaly_rows(run_dir)] == ANOMALOUS


@pytest.mark.slow
@pytest.mark.parametrize("poison", ["nan", "spike"])
def test_sigkill_at_random_instants_ends_bit_identical(references, tmp_path, poison):
    reference_dir, _, _ = references(poison)
    run_dir = str(tmp_path / "run")
    rng = random.Random(f"rollback-{poison}")
    kills = 0
    # 0.1 s after each of ~26 splits: the first process always lives longer than the longest delay.
    while kill_at_random_instant(poison, run_dir, rng, 1.5, "--sleep", "0.1", script=SCRIPT):
        kills += 1
        assert kills < 40
    assert kills >= 1
    assert_same_run(reference_dir, run_dir)
    assert [tuple(row["split"]) for row in anomaly_rows(run_dir)] == ANOMALOUS
