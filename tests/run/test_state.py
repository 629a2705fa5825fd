"""The run state tree (engine/run/state.py): one set of keys, validated the same way by resume
and by ``inspect``; a checkpoint whose state decodes but is wrong is skipped, never a crash."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import engine
from engine.checkpoint.format.codec import encode_state
from engine.checkpoint.store.request import CommitRequest
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.cli.commands import inspect_run
from engine.run import state as run_state
from resume_helpers import assert_same_run, copy_run_until
from scenarios import train_with_checkpoints


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("reference"))
    train_with_checkpoints("tbptt", run_dir, epochs=1, keep_last=None)
    return run_dir


def newest_state(run_dir):
    loaded = CheckpointStore(Storage(run_dir)).latest()
    return loaded, copy.deepcopy(loaded.state)


def drop_key(state):
    del state[run_state.RNG]


def negative_metrics_bytes(state):
    state[run_state.METRICS_BYTES] = -5


def infinite_elapsed(state):
    state[run_state.ELAPSED_SECONDS] = math.inf


def rng_with_wrong_dtype(state):
    state[run_state.RNG]["torch_cpu"] = state[run_state.RNG]["torch_cpu"].to(torch.float32)


def python_rng_not_a_tensor(state):
    state[run_state.RNG]["python"][1] = "words"


def module_entry_not_a_tensor(state):
    key = next(iter(state[run_state.MODULE]))
    state[run_state.MODULE][key] = [1, 2, 3]


def loops_without_data(state):
    del state[run_state.LOOPS]["data"]


def optimizers_not_a_list(state):
    state[run_state.OPTIMIZERS] = {"0": {}}


BREAKAGES = [drop_key, negative_metrics_bytes, infinite_elapsed, rng_with_wrong_dtype, python_rng_not_a_tensor,
             module_entry_not_a_tensor, loops_without_data, optimizers_not_a_list]


@pytest.mark.parametrize("breakage", BREAKAGES, ids=lambda f: f.__name__)
def test_validate_names_what_is_wrong(reference, breakage):
    loaded, state = newest_state(reference)
    run_state.validate(loaded.name, state)  # control: the state as written is valid
    breakage(state)
    with pytest.raises(engine.CheckpointCorrupt, match=loaded.name):
        run_state.validate(loaded.name, state)


def append_checkpoint_with(run_dir, breakage):
    """Commit one more checkpoint whose files verify but whose state tree is broken."""
    store = CheckpointStore(Storage(run_dir))
    loaded, state = newest_state(run_dir)
    breakage(state)
    progress_bytes = Storage(run_dir).read(f"checkpoints/{loaded.name}/progress.msgpack")
    return loaded.name, store.write(CommitRequest.of_state(encode_state(state), bytes(progress_bytes),
                                                           loaded.progress.cursor, generation=store.newest_generation()))


@pytest.mark.parametrize("breakage", [negative_metrics_bytes, rng_with_wrong_dtype, drop_key], ids=lambda f: f.__name__)
def test_inspect_reports_a_wrong_state_tree_invalid(reference, tmp_path, breakage):
    run_dir = str(tmp_path / "run")
    names = CheckpointStore(Storage(reference)).names()
    copy_run_until(reference, run_dir, names[-1])
    good, bad = append_checkpoint_with(run_dir, breakage)
    report = inspect_run(run_dir)
    entries = {entry["name"]: entry for entry in report["checkpoints"]}
    assert entries[bad]["valid"] is False and entries[bad]["error"]
    assert report["latest"] == good


@pytest.mark.parametrize("breakage", [negative_metrics_bytes, rng_with_wrong_dtype, python_rng_not_a_tensor],
                         ids=lambda f: f.__name__)
def test_resume_falls_back_past_a_wrong_state_tree_and_stays_exact(reference, tmp_path, breakage):
    run_dir = str(tmp_path / "run")
    names = CheckpointStore(Storage(reference)).names()
    copy_run_until(reference, run_dir, names[len(names) // 2])
    good, bad = append_checkpoint_with(run_dir, breakage)
    with pytest.warns(UserWarning, match=bad):
        result = train_with_checkpoints("tbptt", run_dir, epochs=1, keep_last=None)
    assert result.resumed_from == good
    assert_same_run(reference, run_dir)


def test_a_different_setup_is_refused_by_name(reference, tmp_path):
    run_dir = str(tmp_path / "run")
    names = CheckpointStore(Storage(reference)).names()
    copy_run_until(reference, run_dir, names[-1])
    with pytest.raises(engine.CheckpointIncompatible, match="accumulate_grad: checkpoint 1, this run 2"):
        train_with_checkpoints("tbptt", run_dir, epochs=2, keep_last=None, accumulate_grad=2)


def test_compared_keys_are_state_keys_without_setup_wall_time_and_envelope():
    assert set(run_state.COMPARED_KEYS) == run_state.STATE_KEYS - {run_state.SIGNATURE, run_state.ELAPSED_SECONDS,
                                                                  run_state.ENVELOPE}
