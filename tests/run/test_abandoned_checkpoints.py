"""Resuming by name from an older checkpoint branches the run's history: the newer checkpoints
are named in a warning before anything is deleted, kept until the new branch's first commit
(then deleted by retention), and resume="auto" never returns to them silently."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest

import engine
from engine.checkpoint.store.abandoned import ABANDONED_FILE
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from resume_helpers import assert_same_run
from scenarios import train_with_checkpoints


def names(run_dir):
    return CheckpointStore(Storage(run_dir)).names()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("reference") / "run")
    train_with_checkpoints("tbptt", run_dir, keep_last=4)
    return run_dir


def branch_with_a_failure_before_the_first_commit(run_dir, branch_point, **settings):
    """Resume from ``branch_point``; the first split boundary raises before any commit."""
    engine.testing.inject([engine.testing.Fault("split_end", 1, "raise")])
    try:
        with pytest.warns(UserWarning, match="newer checkpoint") as caught, pytest.raises(engine.InjectedFault):
            train_with_checkpoints("tbptt", run_dir, resume=branch_point, **settings)
    finally:
        engine.testing.clear()
    return [str(w.message) for w in caught if "newer checkpoint" in str(w.message)][0]


def test_the_newer_checkpoints_are_named_kept_until_the_first_commit_and_never_resumed_by_auto(reference, tmp_path):
    run_dir = str(tmp_path / "run")
    shutil.copytree(reference, run_dir)
    before = names(run_dir)
    branch_point, newer = before[0], before[1:]
    message = branch_with_a_failure_before_the_first_commit(run_dir, branch_point, keep_last=4)
    assert all(name in message for name in newer) and "kept until this run commits its first checkpoint" in message
    assert names(run_dir) == before  # nothing deleted before the new branch committed
    assert json.loads((tmp_path / "run" / ABANDONED_FILE).read_text()) == {"abandoned": newer}

    with pytest.warns(UserWarning, match="skipping .*abandoned"):
        result = train_with_checkpoints("tbptt", run_dir, keep_last=4)  # a requeue with resume="auto"
    assert result.resumed_from == branch_point
    assert not set(newer) & set(names(run_dir))  # deleted by retention once the branch committed
    assert_same_run(reference, run_dir)  # the branch retrained exactly what the abandoned history held


def test_with_keep_last_none_the_abandoned_checkpoints_stay_but_auto_skips_them(reference, tmp_path):
    run_dir = str(tmp_path / "run")
    shutil.copytree(reference, run_dir)
    before = names(run_dir)
    branch_point = before[1]
    message = branch_with_a_failure_before_the_first_commit(run_dir, branch_point, keep_last=None)
    assert "kept (keep_last=None)" in message
    with pytest.warns(UserWarning, match="skipping"):
        result = train_with_checkpoints("tbptt", run_dir, keep_last=None, epochs=3)
    assert result.resumed_from == branch_point
    assert set(before) <= set(names(run_dir))
    # Returning to an abandoned checkpoint by name takes it off the list.
    with pytest.warns(UserWarning, match="newer checkpoint"):
        train_with_checkpoints("tbptt", run_dir, keep_last=None, resume=before[-1], epochs=2)
    assert before[-1] not in json.loads((tmp_path / "run" / ABANDONED_FILE).read_text())["abandoned"]


def test_resuming_the_newest_checkpoint_by_name_abandons_nothing(reference, tmp_path):
    run_dir = str(tmp_path / "run")
    shutil.copytree(reference, run_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_with_checkpoints("tbptt", run_dir, keep_last=4, resume=names(run_dir)[-1], epochs=3)
    assert not (tmp_path / "run" / ABANDONED_FILE).exists()
