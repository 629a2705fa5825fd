"""The sample count can fail: a resume whose data position is broken on purpose (the sampler
restarted at the top of the epoch, or one batch too far) shows samples seen twice, or skipped,
in exactly the number the break implies."""

from __future__ import annotations

import pathlib

import pytest

import engine.data.position as position
from engine.checkpoint.store.storage import Storage
from engine.goodput.account import account
from kill_helpers import AtSplit
from scenarios import BATCH, SAMPLES, TIME, SPLIT, train_with_checkpoints

SPLITS_PER_BATCH = TIME // SPLIT
# The broken sampler yields another number of batches than len(loader) says: the engine warns.
pytestmark = pytest.mark.filterwarnings("ignore:len\\(train_data\\) is 3")


class Stop(RuntimeError):
    pass


def stop() -> None:
    raise Stop("stopped in the middle of the second batch")


def train_with_a_broken_resume(run_dir: str, monkeypatch: pytest.MonkeyPatch, shift) -> None:
    """Stop in the second batch of epoch 0 (every split is committed), then resume with the
    sampler told to skip ``shift(skip)`` batches instead of ``skip``."""
    with pytest.raises(Stop):
        train_with_checkpoints("tbptt", run_dir, epochs=1, callbacks=(AtSplit(SPLITS_PER_BATCH + 2, stop),))
    original = position._open_skipping_loader
    monkeypatch.setattr(position, "_open_skipping_loader", lambda loader, skip: original(loader, shift(skip)))
    train_with_checkpoints("tbptt", run_dir, epochs=1)


def test_a_sampler_restarted_at_the_top_of_the_epoch_shows_samples_seen_twice(tmp_path: pathlib.Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = str(tmp_path / "run")
    train_with_a_broken_resume(run_dir, monkeypatch, lambda skip: 0)
    found = account(Storage(run_dir))
    assert found is not None
    # Batches 0 and 1 were drawn before the stop; after it the sampler gave all three again.
    assert (found.samples.seen_twice, found.samples.skipped) == (2 * BATCH, 0)
    assert found.samples.trained == SAMPLES + 2 * BATCH


def test_a_sampler_one_batch_too_far_shows_samples_skipped(tmp_path: pathlib.Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = str(tmp_path / "run")
    train_with_a_broken_resume(run_dir, monkeypatch, lambda skip: skip + 1)
    found = account(Storage(run_dir))
    assert found is not None
    assert (found.samples.seen_twice, found.samples.skipped) == (0, BATCH)  # the third batch never came
    assert [attempt.cause for attempt in found.attempts] == ["exception", "finished"]

