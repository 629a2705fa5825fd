"""The shared resume-and-compare helper (tests/resume_helpers.py) passes an exact resume and
fails a resume that starts afresh or ends elsewhere: the tests that lean on it can fail."""

import pytest
import torch
from torch.utils.data import DataLoader

import engine
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.store.storage import Storage
from models import Regression
from resume_helpers import assert_resumes_are_exact, memory_url


def fit(run_dir, scale=1.0, resume="auto"):
    """Three splits of one epoch, a checkpoint after each; ``scale`` multiplies the data."""
    torch.manual_seed(0)
    module = Regression()
    config = engine.TrainerConfig(max_epochs=1, run_dir=run_dir, progress_bar="off",
                                  checkpoint=engine.CheckpointConfig(every_n_splits=1, keep_last=None))
    data = DataLoader(scale * torch.randn(9, 2), batch_size=3)  # map-style: a resume skips to its batch
    return engine.Trainer(config).fit(module, data, resume=resume)


@pytest.fixture
def reference():
    run_dir = memory_url("helpers")
    fit(run_dir)
    return run_dir


def test_an_exact_resume_from_each_checkpoint_passes(reference):
    names = CheckpointStore(Storage(reference)).names()
    assert len(names) == 4  # one per split, one at the epoch end
    seen = []

    def train(run_dir):
        seen.append(run_dir)
        return fit(run_dir)

    assert_resumes_are_exact(reference, names[:-1], train)
    assert len(seen) == 3 and len(set(seen)) == 3 and all(url.startswith("memory://") for url in seen)


def test_a_run_that_does_not_resume_fails(reference):
    names = CheckpointStore(Storage(reference)).names()
    with pytest.raises(AssertionError, match="None"), pytest.warns(UserWarning, match="replaced"):
        assert_resumes_are_exact(reference, names[:1], lambda run_dir: fit(run_dir, resume="off"))


def test_a_resumed_run_that_ends_elsewhere_fails(reference):
    names = CheckpointStore(Storage(reference)).names()
    with pytest.raises(AssertionError, match="module"):
        assert_resumes_are_exact(reference, names[:1], lambda run_dir: fit(run_dir, scale=2.0))


def test_the_copy_comes_from_source_and_lands_where_asked(reference, tmp_path):
    source = tmp_path / "source"
    fit(str(source))
    (source / "from-the-source").write_text("copied with the run")
    name = CheckpointStore(Storage(str(source))).names()[1]
    assert_resumes_are_exact(reference, [name], fit, lambda checkpoint: str(tmp_path / "resumed" / checkpoint),
                             source=str(source))
    assert (tmp_path / "resumed" / name / "from-the-source").read_text() == "copied with the run"
