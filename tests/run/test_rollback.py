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
from engine.checkpoint.storage import Storage
from engine.checkpoint.store import CheckpointStore
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
    while kill_at_random_instant(poison, run_dir, rng, 1.5, "--sleep", "0.05", script=SCRIPT):
        kills += 1
        assert kills < 40
    assert_same_run(reference_dir, run_dir)
    assert [tuple(row["split"]) for row in anomaly_rows(run_dir)] == ANOMALOUS
