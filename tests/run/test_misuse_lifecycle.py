"""Lifecycle mistakes: resuming with a changed optimizer class or DataLoader batch size is a
CheckpointIncompatible naming what changed (not a KeyError from inside the optimizer later),
a second Trainer on a run directory in use is refused, and Ctrl-C inside the step leaves a
run that resumes exactly."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import engine
from misuse_helpers import Plain


def _rows(count=6):
    return [torch.randn(2, 3, generator=torch.Generator().manual_seed(i)) for i in range(count)]


def _config(run_dir, **overrides) -> engine.TrainerConfig:
    settings = {"max_epochs": 1, "run_dir": str(run_dir), "progress_bar": "off"}
    settings.update(overrides)
    return engine.TrainerConfig(**settings)


def test_resume_with_another_optimizer_class_names_it(tmp_path):
    engine.Trainer(_config(tmp_path)).fit(Plain(torch.optim.SGD), _rows())
    with pytest.raises(engine.CheckpointIncompatible, match=r"optimizer_classes: checkpoint \['SGD'\], this run \['Adam'\]"):
        engine.Trainer(_config(tmp_path, max_epochs=2)).fit(Plain(torch.optim.Adam), _rows())


def test_resume_with_another_dataloader_batch_size_names_it(tmp_path):
    samples = TensorDataset(torch.randn(30, 3, generator=torch.Generator().manual_seed(0)))
    engine.Trainer(_config(tmp_path)).fit(Plain(), DataLoader(samples, batch_size=8))  # 4 batches
    with pytest.raises(engine.CheckpointIncompatible, match="batch_size: checkpoint 8, this run 9") as caught:
        engine.Trainer(_config(tmp_path, max_epochs=2)).fit(Plain(), DataLoader(samples, batch_size=9))  # 4 batches too
    assert "data_length" not in str(caught.value)


def test_resume_with_the_same_setup_still_works(tmp_path):
    samples = TensorDataset(torch.randn(30, 3, generator=torch.Generator().manual_seed(0)))
    first = engine.Trainer(_config(tmp_path)).fit(Plain(), DataLoader(samples, batch_size=8))
    again = engine.Trainer(_config(tmp_path, max_epochs=2)).fit(Plain(), DataLoader(samples, batch_size=8))
    assert again.resumed_from == first.last_checkpoint and again.optimizer_steps == 8


def test_checkpoint_without_the_newer_signature_entries_still_resumes(tmp_path):
    from engine.run import state as run_state

    original = run_state.RunParts.signature

    def older_signature(parts):
        signature = original(parts)
        for key in run_state.NEWER_SIGNATURE_KEYS:
            signature.pop(key, None)  # some are recorded only by some runs (global_batch: distributed)
        return signature

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run_state.RunParts, "signature", older_signature)
        first = engine.Trainer(_config(tmp_path)).fit(Plain(), _rows())
    again = engine.Trainer(_config(tmp_path, max_epochs=2)).fit(Plain(), _rows())
    assert again.resumed_from == first.last_checkpoint and again.optimizer_steps == 12


def test_second_trainer_on_a_run_dir_in_use_in_the_same_process_is_refused(tmp_path):
    refused = []

    class StartsAnother(Plain):
        def training_step(self, batch):
            if not refused:
                with pytest.raises(engine.WriterConflict) as caught:
                    engine.Trainer(_config(tmp_path, max_epochs=1)).fit(Plain(), _rows(), resume="off")
                refused.append(str(caught.value))
            return super().training_step(batch)

    result = engine.Trainer(_config(tmp_path)).fit(StartsAnother(), _rows())
    assert refused and str(tmp_path) in refused[0]
    assert result.optimizer_steps == 6


def test_ctrl_c_inside_the_step_leaves_a_run_that_resumes_exactly(tmp_path):
    reference = Plain()
    engine.Trainer(_config(tmp_path / "reference", max_epochs=2)).fit(reference, _rows())

    class CtrlC(Plain):
        calls = 0

        def training_step(self, batch):
            CtrlC.calls += 1
            if CtrlC.calls == 8:  # epoch 1, batch 1
                raise KeyboardInterrupt
            return super().training_step(batch)

    with pytest.raises(KeyboardInterrupt):
        engine.Trainer(_config(tmp_path / "run", max_epochs=2)).fit(CtrlC(), _rows())
    resumed = Plain()
    result = engine.Trainer(_config(tmp_path / "run", max_epochs=2)).fit(resumed, _rows())
    assert result.resumed_from is not None and result.optimizer_steps == 12
    for mine, theirs in zip(resumed.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_resume_off_over_earlier_checkpoints_warns_that_retention_deletes_them(tmp_path):
    keep_all = engine.CheckpointConfig(keep_last=None)
    engine.Trainer(_config(tmp_path, checkpoint=keep_all)).fit(Plain(), _rows())
    with pytest.warns(UserWarning, match=r"resume='off'.*holds 7 checkpoint\(s\).*newest ckpt-0000000007.*keep_last=2"):
        engine.Trainer(_config(tmp_path, checkpoint=engine.CheckpointConfig(keep_last=2))).fit(Plain(), _rows(),
                                                                                               resume="off")


def test_resume_off_in_a_new_run_dir_does_not_warn(tmp_path, recwarn):
    engine.Trainer(_config(tmp_path)).fit(Plain(), _rows(), resume="off")
    assert not [w for w in recwarn if "resume='off'" in str(w.message)]


def test_export_weights_into_a_missing_directory_is_a_config_error(tmp_path):
    engine.Trainer(_config(tmp_path / "run")).fit(Plain(), _rows())
    target = tmp_path / "missing" / "model.pt"
    with pytest.raises(engine.ConfigError, match="does not exist; create it first") as caught:
        engine.export_weights(str(tmp_path / "run"), str(target))
    assert str(target) in str(caught.value)
    assert engine.export_weights(str(tmp_path / "run"), str(tmp_path / "model.pt")).startswith("ckpt-")
