"""A careless configuration is refused when it is built, with a ConfigError that names the
field and the value: flags that are not bools, fields the rest of the policy would ignore,
malformed preemption signals and run directories, and a fast tier that would delete another
run's checkpoints (refused by ``fit`` before anything is written)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

import engine
from misuse_helpers import Plain


def _rows():
    return [torch.randn(2, 3, generator=torch.Generator().manual_seed(i)) for i in range(4)]


@pytest.mark.parametrize("field, value", [(field, value) for field in ("at_epoch_end", "asynchronous")
                                          for value in (1, 0, "yes", None) if (field, value) != ("asynchronous", None)])
def test_checkpoint_flags_must_be_bools(field, value):
    with pytest.raises(engine.ConfigError) as caught:
        engine.CheckpointConfig(**{field: value})
    assert f"CheckpointConfig.{field}" in str(caught.value) and repr(value) in str(caught.value)


@pytest.mark.parametrize("field", ["val_at_epoch_end", "distributed_sampler", "exit_on_preemption"])
@pytest.mark.parametrize("value", [1, 0, "no", None])
def test_trainer_flags_must_be_bools(field, value):
    with pytest.raises(engine.ConfigError) as caught:
        engine.TrainerConfig(**{field: value})
    assert f"TrainerConfig.{field}" in str(caught.value) and repr(value) in str(caught.value)


@pytest.mark.parametrize("field, value", [("max_in_flight", 3), ("when_behind", "skip")])
def test_background_writer_options_with_the_synchronous_writer_are_refused(field, value):
    with pytest.raises(engine.ConfigError, match="writer is 'sync'") as caught:
        engine.CheckpointConfig(**{field: value})
    assert f"CheckpointConfig.{field}={value!r}" in str(caught.value)
    engine.CheckpointConfig(writer="thread", **{field: value})  # the same option with it is fine


@pytest.mark.parametrize("field, value", [("mode", "max"), ("keep_best", 3)])
def test_best_checkpoint_options_without_monitor_are_refused(field, value):
    with pytest.raises(engine.ConfigError, match="monitor") as caught:
        engine.CheckpointConfig(**{field: value})
    assert f"CheckpointConfig.{field}={value!r}" in str(caught.value)
    engine.CheckpointConfig(monitor="val_loss", **{field: value})


def test_monitor_with_stray_whitespace_is_refused():
    with pytest.raises(engine.ConfigError, match="whitespace") as caught:
        engine.CheckpointConfig(monitor="val_loss ")
    assert "'val_loss '" in str(caught.value)


def test_max_overhead_without_auto_interval_is_refused():
    with pytest.raises(engine.ConfigError, match="auto") as caught:
        engine.CheckpointConfig(every_n_splits=4, max_overhead=0.2)
    assert "CheckpointConfig.max_overhead=0.2" in str(caught.value)
    engine.CheckpointConfig(every_n_splits="auto", max_overhead=0.2)


@pytest.mark.parametrize("value", [15, None, "SIGTERM", (True,), ("15",), (15.0,)])
def test_malformed_preemption_signals_are_named(value):
    with pytest.raises(engine.ConfigError) as caught:
        engine.TrainerConfig(preemption_signals=value)
    assert "TrainerConfig.preemption_signals" in str(caught.value)


def test_preemption_signals_may_be_empty_or_a_list():
    assert engine.TrainerConfig(preemption_signals=()).preemption_signals == ()
    assert engine.TrainerConfig(preemption_signals=[int(signal.SIGTERM)]).preemption_signals == [int(signal.SIGTERM)]


@pytest.mark.parametrize("value", [3, "", "   ", ["requeue"]])
def test_malformed_requeue_command_is_named(value):
    with pytest.raises(engine.ConfigError) as caught:
        engine.TrainerConfig(requeue_command=value)
    assert "TrainerConfig.requeue_command" in str(caught.value) and repr(value) in str(caught.value)


def test_log_every_seconds_none_is_refused():
    with pytest.raises(engine.ConfigError, match="TrainerConfig.log_every_seconds"):
        engine.TrainerConfig(log_every_seconds=None)


@pytest.mark.parametrize("value", ["   ", "runs/a\x00b", "runs/a\nb", "runs/\ta"])
def test_blank_or_control_character_run_dir_is_refused_before_anything_is_created(value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(engine.ConfigError) as caught:
        engine.TrainerConfig(run_dir=value)
    assert "TrainerConfig.run_dir" in str(caught.value) and repr(value) in str(caught.value)
    assert os.listdir(tmp_path) == []


def test_run_dir_with_spaces_and_unicode_trains_and_resumes(tmp_path):
    run_dir = str(tmp_path / "my runs" / "ü ñ 日本")
    config = engine.TrainerConfig(max_epochs=1, run_dir=run_dir, progress_bar="off")
    first = engine.Trainer(config).fit(Plain(), _rows())
    assert first.last_checkpoint is not None
    config = engine.TrainerConfig(max_epochs=2, run_dir=run_dir, progress_bar="off")
    assert engine.Trainer(config).fit(Plain(), _rows()).resumed_from == first.last_checkpoint


def _tier_config(run_dir, local_tier) -> engine.TrainerConfig:
    checkpoint = engine.CheckpointConfig(local_tier=str(local_tier), durable_every_n_splits=2)
    return engine.TrainerConfig(max_epochs=1, run_dir=str(run_dir), checkpoint=checkpoint, progress_bar="off")


def test_local_tier_that_is_another_runs_directory_is_refused_and_its_checkpoints_kept(tmp_path):
    other = tmp_path / "other-run"
    engine.Trainer(engine.TrainerConfig(max_epochs=1, run_dir=str(other), progress_bar="off",
                                        checkpoint=engine.CheckpointConfig(keep_last=None))).fit(Plain(), _rows())
    before = sorted(os.listdir(other / "checkpoints"))
    assert len(before) == 5
    with pytest.raises(engine.ConfigError, match="CheckpointConfig.local_tier") as caught:
        engine.Trainer(_tier_config(tmp_path / "mine", other)).fit(Plain(), _rows())
    assert str(other) in str(caught.value) and "delete" in str(caught.value)
    assert sorted(os.listdir(other / "checkpoints")) == before
    assert not (tmp_path / "mine").exists()


@pytest.mark.parametrize("where", ["run", "run/fast", "run/checkpoints", "run/checkpoints/fast"])
def test_local_tier_at_or_inside_the_run_dir_is_refused_before_any_write(tmp_path, where):
    run_dir = tmp_path / "run"
    with pytest.raises(engine.ConfigError, match="CheckpointConfig.local_tier"):
        engine.Trainer(_tier_config(run_dir, tmp_path / where)).fit(Plain(), _rows())
    assert not run_dir.exists()


def test_run_dir_inside_the_local_tiers_checkpoints_is_refused(tmp_path):
    with pytest.raises(engine.ConfigError, match="CheckpointConfig.local_tier"):
        engine.Trainer(_tier_config(tmp_path / "tier" / "checkpoints" / "run", tmp_path / "tier")).fit(Plain(), _rows())


def test_local_tier_apart_from_the_run_dir_works_and_is_reused(tmp_path):
    run_dir, tier = tmp_path / "run", tmp_path / "node" / "fast"
    first = engine.Trainer(_tier_config(run_dir, tier)).fit(Plain(), _rows())
    assert first.last_checkpoint is not None
    again = engine.Trainer(_tier_config(run_dir, tier)).fit(Plain(), _rows())
    assert again.resumed_from == first.last_checkpoint


@pytest.mark.parametrize("field, value", [("max_epochs", 0), ("max_epochs", "2"), ("accumulate_grad", 0),
                                          ("checkpoint", {"every_n_splits": 1})])
def test_trainer_config_field_changed_after_construction_is_checked_by_fit(tmp_path, field, value):
    config = engine.TrainerConfig(max_epochs=1, run_dir=str(tmp_path / "run"), progress_bar="off")
    setattr(config, field, value)
    with pytest.raises(engine.ConfigError) as caught:
        engine.Trainer(config).fit(Plain(), _rows())
    assert f"TrainerConfig.{field}" in str(caught.value) and repr(value) in str(caught.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("field, value", [("keep_last", 0), ("every_n_splits", 0), ("asynchronous", "yes")])
def test_checkpoint_config_field_changed_after_construction_is_checked_by_fit(tmp_path, field, value):
    policy = engine.CheckpointConfig()
    config = engine.TrainerConfig(max_epochs=1, run_dir=str(tmp_path / "run"), checkpoint=policy, progress_bar="off")
    setattr(policy, field, value)
    with pytest.raises(engine.ConfigError) as caught:
        engine.Trainer(config).fit(Plain(), _rows())
    assert f"CheckpointConfig.{field}" in str(caught.value) and repr(value) in str(caught.value)
    assert not (tmp_path / "run").exists()


# ---- unknown keyword arguments: the closest name, or what Lightning's name is called here ----
@pytest.mark.parametrize("make, says", [
    (lambda: engine.TrainerConfig(max_epoch=3), r"TrainerConfig: unknown argument 'max_epoch'; did you mean max_epochs\?"),
    (lambda: engine.TrainerConfig(precison="bf16-mixed"), "did you mean precision"),
    (lambda: engine.CheckpointConfig(every_n_split=3), r"CheckpointConfig: .*'every_n_split'; did you mean every_n_splits\?"),
    (lambda: engine.CheckpointConfig(keep_lats=3), "did you mean keep_last"),
], ids=["max_epoch", "precison", "every_n_split", "keep_lats"])
def test_a_misspelt_field_names_the_closest_one(make, says):
    # ConfigError is also a TypeError: code that caught Python's unexpected-keyword error still does.
    with pytest.raises(engine.ConfigError, match=says) as caught:
        make()
    assert isinstance(caught.value, TypeError)


@pytest.mark.parametrize("owner, name, says", [
    (engine.TrainerConfig, "accumulate_grad_batches", "accumulate_grad=N with accumulate_over='batches'"),
    (engine.TrainerConfig, "accelerator", "device='cpu', 'cuda'"),
    (engine.TrainerConfig, "strategy", "torchrun .*DistributedDataParallel"),
    (engine.TrainerConfig, "devices", "--nproc-per-node"),
    (engine.TrainerConfig, "default_root_dir", "run_dir="),
    (engine.TrainerConfig, "enable_progress_bar", "progress_bar='off'"),
    (engine.CheckpointConfig, "save_top_k", "keep_best=K with monitor="),
    (engine.CheckpointConfig, "every_n_train_steps", "every_n_steps=N"),
    (engine.CheckpointConfig, "dirpath", r"TrainerConfig\(run_dir=...\)"),
])
def test_a_lightning_name_gets_its_equivalent(owner, name, says):
    with pytest.raises(engine.ConfigError, match=rf"{owner.__name__}: unknown argument '{name}'; that is PyTorch "
                                                 rf"Lightning's name; here: .*{says}"):
        owner(**{name: 2})


def test_an_unknown_name_with_no_close_one_lists_the_fields():
    with pytest.raises(engine.ConfigError, match="unknown argument 'zzz'; it takes max_epochs, max_steps"):
        engine.TrainerConfig(zzz=1)


def test_known_fields_and_positional_arguments_still_work():
    config = engine.TrainerConfig(3, max_steps=5, run_dir="memory://x", checkpoint=engine.CheckpointConfig(1, keep_last=3))
    assert (config.max_epochs, config.max_steps, config.checkpoint.keep_last) == (3, 5, 3)
