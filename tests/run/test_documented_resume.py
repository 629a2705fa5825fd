"""What docs/quickstart.md and docs/guarantees.md say about resuming, checked against fit."""

import json
import warnings

import torch

import engine
from models import Regression


def batches():
    torch.manual_seed(0)
    return [torch.randn(4, 2) for _ in range(4)]


def test_a_finished_max_steps_run_trains_nothing_more_when_called_again(tmp_path, capsys):
    """quickstart.md, Resuming: calling fit again on a run stopped by max_steps trains no split."""
    config = engine.TrainerConfig(max_epochs=None, max_steps=3, run_dir=str(tmp_path), progress_bar="log")
    first = engine.Trainer(config).fit(Regression(), batches())
    metrics_before = (tmp_path / "metrics.jsonl").read_text()
    again = engine.Trainer(config).fit(Regression(), batches())
    assert again.resumed_from == first.last_checkpoint
    assert again.optimizer_steps == first.optimizer_steps == 3 and again.cursor == first.cursor
    assert (tmp_path / "metrics.jsonl").read_text() == metrics_before
    assert "0 checkpoints written; stopped: max_steps=3 reached" in capsys.readouterr().err


def test_a_manifest_that_parses_but_has_other_keys_is_not_a_committed_checkpoint(tmp_path):
    """guarantees.md, No valid checkpoint is an error: such a checkpoint is skipped with a
    warning; when it is the only one, fit starts fresh (it is not 'committed')."""
    config = engine.TrainerConfig(max_epochs=1, run_dir=str(tmp_path), progress_bar="off",
                                  checkpoint=engine.CheckpointConfig(every_n_splits=None, at_epoch_end=True))
    first = engine.Trainer(config).fit(Regression(), batches())
    manifest = tmp_path / "checkpoints" / first.last_checkpoint / "MANIFEST.json"
    data = json.loads(manifest.read_text())
    data["unexpected"] = data.pop("writer_generation")
    manifest.write_text(json.dumps(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = engine.Trainer(config).fit(Regression(), batches())
    assert again.resumed_from is None and again.epochs_completed == 1
    assert any(f"skipping checkpoint {first.last_checkpoint}" in str(w.message) and "does not have the keys" in str(w.message)
               for w in caught)
