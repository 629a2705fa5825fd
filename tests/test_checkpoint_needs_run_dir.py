"""A checkpoint policy given explicitly without a run_dir is refused: it could write nothing."""

import dataclasses

import pytest

import engine


def test_an_explicit_checkpoint_policy_without_run_dir_is_a_config_error():
    with pytest.raises(engine.ConfigError, match=r"TrainerConfig\.checkpoint: CheckpointConfig\(every_n_splits=5.*run_dir is None, "
                                                 r"so no checkpoint would be written; set run_dir"):
        engine.TrainerConfig(checkpoint=engine.CheckpointConfig(every_n_splits=5))


def test_the_default_policy_needs_no_run_dir():
    config = engine.TrainerConfig(max_epochs=2)
    assert config.run_dir is None and config.checkpoint == engine.CheckpointConfig()
    assert dataclasses.replace(config, max_epochs=3).checkpoint == engine.CheckpointConfig()


def test_explicit_policies_with_run_dir_and_none_without_are_fine():
    engine.TrainerConfig(run_dir="runs/x", checkpoint=engine.CheckpointConfig(every_n_splits=5))
    engine.TrainerConfig(checkpoint=None)
