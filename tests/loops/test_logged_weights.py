"""The metric logger's weighted means and per-split / per-epoch routing (what engine.lightning's
``self.log(batch_size=..., on_step=..., on_epoch=...)`` relies on); the engine's own
``Module.log`` keeps logging both, unweighted."""

from __future__ import annotations

import pytest

from engine.errors import ModuleContractError
from engine.loops.logged import MetricLogger, Recording, reduce_recordings


def test_a_weighted_mean_divides_by_the_weights_and_survives_a_checkpoint():
    logger = MetricLogger()
    logger.log("acc", 0.5, "mean", weight=8, per_split=False)
    logger.log("acc", 0.25, "mean", weight=4, per_split=False)
    restored = MetricLogger()
    restored.load_state_dict(logger.state_dict())
    restored.log("acc", 1.0, "mean", weight=2.5, per_split=False)
    assert restored.end_split() == {}
    assert restored.end_epoch() == {"acc": (0.5 * 8 + 0.25 * 4 + 1.0 * 2.5) / (8 + 4 + 2.5)}


def test_split_only_values_stay_out_of_the_epoch_and_epoch_only_values_out_of_the_split():
    logger = MetricLogger()
    logger.log("step_loss", 2.0, "mean", per_epoch=False)
    logger.log("epoch_loss", 3.0, "mean", weight=2, per_split=False)
    logger.log("both", 4.0, "mean")
    assert logger.end_split() == {"step_loss": 2.0, "both": 4.0}
    logger.log("step_loss", 6.0, "mean", per_epoch=False)
    assert logger.end_split() == {"step_loss": 6.0}
    assert logger.end_epoch() == {"epoch_loss": 3.0, "both": 4.0}


def test_a_value_logged_nowhere_is_refused():
    with pytest.raises(ModuleContractError, match="neither per split nor per epoch"):
        MetricLogger().log("lost", 1.0, "mean", per_split=False, per_epoch=False)


def test_validation_values_are_weighted_too():
    logger = MetricLogger()
    logger.begin_evaluation()
    logger.log("val_loss", 1.0, "mean", weight=8)
    logger.log("val_loss", 4.0, "mean", weight=4)
    recording = logger.end_evaluation()
    assert reduce_recordings([recording]) == {"val_loss": (1.0 * 8 + 4.0 * 4) / 12}
    # The weights cross ranks with the values: a recording sent to another rank reduces alike.
    assert reduce_recordings([Recording.decode(recording.encode())]) == {"val_loss": (1.0 * 8 + 4.0 * 4) / 12}
