"""Exact resume, in process: resume from every checkpoint of a run and finish it; the result
must equal the uninterrupted run bit for bit. (Kill tests in test_kill.py do the same across
real processes.)"""

import shutil

import pytest
import torch

import engine
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.store.storage import Storage
from resume_helpers import assert_resumes_are_exact, assert_same_run, memory_url, read_metrics
from scenarios import SCENARIOS, scenario_params, train_with_checkpoints


def train(name, run_dir, epochs=2, resume="auto", keep_last=None, **extra):
    return train_with_checkpoints(name, run_dir, epochs=epochs, resume=resume, keep_last=keep_last, **extra)


def check_resumes(name, tmp_path, chosen):
    """Train ``name``, then resume from each checkpoint ``chosen(names)`` picks (the last one
    left out) and compare with the uninterrupted run. memory:// keeps this fast; every seventh
    checkpoint's resume goes through a local directory."""
    reference = memory_url("resume")
    train(name, reference)
    names = CheckpointStore(Storage(reference)).names()
    units = 24 if SCENARIOS[name].tbptt else 6
    assert len(names) == units + 2  # one per split (or batch), plus one per epoch end
    assert_resumes_are_exact(reference, chosen(names[:-1]), lambda run_dir: train(name, run_dir),
                             lambda checkpoint: str(tmp_path / checkpoint) if names.index(checkpoint) % 7 == 3
                             else memory_url("resume"))


@pytest.mark.parametrize("name", scenario_params())
def test_resume_from_every_fourth_checkpoint_rotated_by_scenario(name, tmp_path):
    """CI time: every fourth checkpoint, from an offset that rotates with the scenario, so that
    across the scenarios each position of a split in its batch, and the first epoch's end, is
    resumed from; the exhaustive run resumes every scenario from every checkpoint (below)."""
    offset = sorted(SCENARIOS).index(name) % 4
    check_resumes(name, tmp_path, lambda names: names[offset::4])


@pytest.mark.exhaustive
@pytest.mark.parametrize("name", scenario_params())
def test_resume_from_every_checkpoint(name, tmp_path):
    check_resumes(name, tmp_path, lambda names: names)


def test_local_and_memory_runs_are_identical(tmp_path):
    local = str(tmp_path / "local")
    memory = memory_url("resume")
    train("tbptt", local)
    train("tbptt", memory)
    assert_same_run(local, memory)


def test_resume_continues_with_more_epochs(tmp_path):
    """Training 2 epochs, then fit again with max_epochs=3, equals training 3 epochs at once."""
    straight = str(tmp_path / "straight")
    staged = str(tmp_path / "staged")
    train("tbptt", straight, epochs=3)
    train("tbptt", staged, epochs=2)
    result = train("tbptt", staged, epochs=3)
    assert result.resumed_from is not None
    assert_same_run(straight, staged)


def test_resume_after_max_steps_stop(tmp_path):
    straight = str(tmp_path / "straight")
    staged = str(tmp_path / "staged")
    train("accumulate_batches", straight)
    first = train("accumulate_batches", staged, max_steps=1)
    assert first.stop_reason is not None
    train("accumulate_batches", staged)
    assert_same_run(straight, staged)


def test_resume_off_starts_over(tmp_path):
    run = str(tmp_path / "run")
    train("plain", run)
    with pytest.warns(UserWarning, match="replaced"):
        result = train("plain", run, resume="off")
    assert result.resumed_from is None
    assert read_metrics(run).count(b"\n") == 6


def test_resume_latest_requires_a_checkpoint(tmp_path):
    with pytest.raises(engine.CheckpointNotFound, match="no checkpoint"):
        train("plain", str(tmp_path / "empty"), resume="latest")


def test_resume_named_checkpoint(tmp_path):
    reference = str(tmp_path / "reference")
    train("tbptt", reference)
    names = CheckpointStore(Storage(reference)).names()
    resumed = str(tmp_path / "resumed")
    shutil.copytree(reference, resumed)
    with pytest.warns(UserWarning, match="newer checkpoint"):
        result = train("tbptt", resumed, resume=names[5])
    assert result.resumed_from == names[5]
    assert_same_run(reference, resumed)


def test_refitting_a_finished_max_steps_run_does_nothing(tmp_path):
    run = str(tmp_path / "run")
    first = train("tbptt", run, max_steps=5)
    again = train("tbptt", run, max_steps=5)
    assert first.optimizer_steps == again.optimizer_steps == 5
    assert again.resumed_from is not None and "max_steps" in again.stop_reason
    assert read_metrics(run).count(b"\n") == 5


def test_namedtuple_hidden_state_and_batches_round_trip():
    import collections

    from engine.checkpoint.format.codec import decode_state, encode_state

    State = collections.namedtuple("State", ["h", "c"])
    value = {"hidden": State(torch.ones(2), torch.zeros(3)), "plain": (1, 2)}
    encoded = encode_state(value)
    data = bytearray(b"".join(bytes(chunk) for chunk in encoded.tensor_chunks()))
    decoded = decode_state(encoded.header, data)
    assert type(decoded["hidden"]).__name__ == "State" and decoded["hidden"]._fields == ("h", "c")
    assert torch.equal(decoded["hidden"].h, torch.ones(2)) and torch.equal(decoded["hidden"].c, torch.zeros(3))
    assert type(decoded["plain"]) is tuple


class _LoadedCheckpointsAlive(engine.Callback):
    """Counts, at the first split after the resume, the LoadedCheckpoints still holding a state
    tree or rank files (the checkpoint's bytes)."""

    def __init__(self):
        self.holding = None

    def on_split_end(self, view):
        import gc
        from engine.checkpoint.store.catalogue import LoadedCheckpoint
        if self.holding is None:
            gc.collect()
            self.holding = sum(1 for item in gc.get_objects()
                               if isinstance(item, LoadedCheckpoint) and (item.state or item.extra_files))


def test_a_resumed_run_does_not_keep_the_checkpoint_it_restored_in_memory(tmp_path):
    # In a distributed run every rank reads every rank's part (a resharding resume needs them):
    # once restored, none of it may stay alive for the rest of the fit.
    run_dir = str(tmp_path / "run")
    train("tbptt", run_dir, epochs=1)
    alive = _LoadedCheckpointsAlive()
    result = train("tbptt", run_dir, epochs=2, callbacks=(alive,))
    assert result.resumed_from is not None and alive.holding == 0
