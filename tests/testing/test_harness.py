"""The public fault-injection harness: every fault point x kind that makes sense, each resumed
and compared with the uninterrupted run; and the harness reports a run that does not resume
exactly."""

import contextlib
import os
import pathlib

import pytest

import engine
import forkserver
from engine import faults
from engine.faults import Fault
from engine.testing import harness
from engine.testing.harness import check_fault_tolerance
from scenarios import harness_train, train_with_checkpoints

# Listed here on purpose (not imported): a point added to the engine must get a test here.
LOOP_POINTS = ["step_start", "after_backward", "after_optimizer_step", "split_end", "split_end_after_checkpoint",
               "batch_end", "epoch_end"]
CHECKPOINT_POINTS = ["checkpoint_before_file", "checkpoint_after_file", "checkpoint_before_manifest",
                     "checkpoint_before_rename", "checkpoint_after_rename", "checkpoint_retention"]
HITS = {"batch_end": 2, "epoch_end": 1, "checkpoint_before_file": 7, "checkpoint_after_file": 8,
        "checkpoint_retention": 2, "filesystem_write": 25}


def matrix(kinds_by_point):
    return [Fault(point, HITS.get(point, 5), kind) for point, kinds in kinds_by_point.items() for kind in kinds]


def test_every_point_has_a_test_here():
    # validation_batch_end needs validation data: tests/run/test_validation*.py fault it;
    # after_rollback needs an anomaly: tests/run/test_rollback.py faults it; the memory tier's
    # points need torchrun: tests/distributed/test_memory_tier.py kills there.
    assert set(LOOP_POINTS) | set(CHECKPOINT_POINTS) | {"filesystem_write", "validation_batch_end", "after_rollback",
                                                        "memory_tier_peer_copy", "memory_tier_refill"} == set(faults.POINTS)


IN_PROCESS_KINDS = {**{point: ["raise", "sigterm"] for point in LOOP_POINTS},
                    **{point: ["raise", "enospc", "eio"] for point in CHECKPOINT_POINTS},
                    "filesystem_write": ["enospc", "eio"]}


def rotated_kinds() -> dict[str, list[str]]:
    """One kind per point, taking each point's kinds in turn, so that every point and every kind
    runs (CI time: the whole product is the exhaustive case below)."""
    return {point: [kinds[index % len(kinds)]] for index, (point, kinds) in enumerate(IN_PROCESS_KINDS.items())}


def check_in_process_faults(tmp_path, kinds_by_point):
    fault_list = matrix(kinds_by_point)
    report = check_fault_tolerance(harness_train, fault_list, work_dir=str(tmp_path))
    assert len(report.trials) == len(fault_list)
    for trial in report.trials:
        assert trial.outcome not in ("never fired", "completed"), trial
        assert trial.exact, report.table()
        assert trial.resumed_from is not None
    sigterm = [t for t in report.trials if t.fault.kind == "sigterm"]
    assert sigterm and all(t.outcome == "exit 75" for t in sigterm)
    assert report.summary() == f"chaos: {len(fault_list)} trials, {len(fault_list)} exact, 0 failed"


def test_in_process_faults_at_every_point_and_of_every_kind_resume_exactly(tmp_path):
    kinds_by_point = rotated_kinds()
    assert set(kinds_by_point) == set(IN_PROCESS_KINDS)
    assert {kind for kinds in kinds_by_point.values() for kind in kinds} == {"raise", "sigterm", "enospc", "eio"}
    check_in_process_faults(tmp_path, kinds_by_point)


@pytest.mark.exhaustive
def test_in_process_faults_resume_exactly(tmp_path):
    assert sum(map(len, IN_PROCESS_KINDS.values())) == 34
    check_in_process_faults(tmp_path, IN_PROCESS_KINDS)


# SIGKILL at split_end, split_end_after_checkpoint, epoch_end and every checkpoint_* point is
# exercised by tests/test_kill.py; the harness covers the remaining points in subprocesses.
SIGKILL_HERE = ["step_start", "after_backward", "after_optimizer_step", "batch_end"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_in_a_subprocess(tmp_path, monkeypatch):
    tests_dir = str(pathlib.Path(__file__).parent.parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")])))
    monkeypatch.setattr(harness, "subprocess", forkserver.SubprocessShim)  # its children forked, not exec'd
    fault_list = matrix({point: ["sigkill"] for point in SIGKILL_HERE})
    fault_list.append(Fault("filesystem_write", 40, "sigkill"))
    report = check_fault_tolerance("scenarios:harness_train", fault_list, work_dir=str(tmp_path))
    for trial in report.trials:
        assert trial.outcome == "killed by signal 9", report.table()
        assert trial.exact, report.table()


class ForgetfulLearningRate(engine.Callback):
    """A bug on purpose: halves the LR at the 3rd split of *this process*, which a resume
    repeats. The harness must catch it."""

    def __init__(self, model_holder):
        self.seen = 0
        self.model_holder = model_holder

    def on_split_end(self, view):
        self.seen += 1
        if self.seen == 3:
            for group in self.model_holder["optimizer"].param_groups:
                group["lr"] *= 0.5


def forgetful_train(run_dir):
    from scenarios import build

    holder = {}
    model, loader = build("tbptt")

    class Holder(engine.Callback):
        def on_fit_start(self, view):
            holder["optimizer"] = model.optimizers()

    config = engine.TrainerConfig(max_epochs=2, run_dir=run_dir, progress_bar="off",
                                  checkpoint=engine.CheckpointConfig(every_n_splits=1))
    return engine.Trainer(config, callbacks=[Holder(), ForgetfulLearningRate(holder)]).fit(model, loader)


def test_the_harness_reports_an_inexact_resume(tmp_path):
    report = check_fault_tolerance(forgetful_train, [Fault("split_end", 9, "raise")], work_dir=str(tmp_path))
    trial = report.trials[0]
    assert trial.outcome == "raised InjectedFault"
    assert not trial.exact and not report.all_exact
    assert any(d.startswith("module.") for d in trial.differences)
    assert "NO:" in report.table() and report.summary().endswith("0 exact, 1 failed")


def test_a_fault_that_never_fires_is_not_exact(tmp_path):
    report = check_fault_tolerance(harness_train, [Fault("epoch_end", 9, "raise")], work_dir=str(tmp_path))
    assert report.trials[0].outcome == "never fired" and not report.all_exact


def test_sigkill_needs_a_subprocess(tmp_path):
    with pytest.raises(engine.ConfigError, match="subprocess"):
        check_fault_tolerance(harness_train, [Fault("split_end", 1, "sigkill")], work_dir=str(tmp_path))


@pytest.mark.slow
def test_chaos_command_prints_table_and_summary(tmp_path, monkeypatch, capsys):
    import subprocess

    from engine.cli.main import main

    # the command runs here; each of its training attempts is a child forked from the fork server
    monkeypatch.setattr(harness, "subprocess", forkserver.SubprocessShim)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # for those children: a tiny model, threads only contend
    status = main(["chaos", "--dir", str(tmp_path), "--trials", "2", "--hang-timeout", "4"])  # its first trial hangs
    process = subprocess.CompletedProcess([], status, *capsys.readouterr())
    assert process.returncode == 0, process.stderr[-2000:]
    lines = process.stdout.strip().splitlines()
    assert lines[-1] == "chaos: 2 trials, 2 exact, 0 failed"
    assert lines[0] == "chaos: a reference run, then 2 trials; one row per trial as it finishes"
    assert lines[1].split()[:2] == ["fault", "outcome"] and len(lines) == 5


def first_retention_delete_arrival(run_dir, monkeypatch):
    """The arrival count at filesystem_write of the first deletion of an old checkpoint."""
    import engine.checkpoint.store.checkpoint_store as store_module

    found = []
    original_retire = store_module.CheckpointStore._retire

    def retire(self, name):  # deletes it, or renames it to the spare staging directory
        if not found:
            found.append(faults.arrivals("filesystem_write") + 1)
        return original_retire(self, name)

    monkeypatch.setattr(store_module.CheckpointStore, "_retire", retire)
    faults.inject([Fault("filesystem_write", 10_000, "eio")])  # armed, never reached: counts arrivals
    try:
        harness_train(run_dir)
    finally:
        faults.clear()
        monkeypatch.undo()
    return found[0]


def test_a_tolerated_fault_is_reported_as_such(tmp_path, monkeypatch):
    """An EIO while deleting an old checkpoint is tolerated (a warning); the harness says so."""
    hit = first_retention_delete_arrival(str(tmp_path / "probe"), monkeypatch)

    def train(run_dir):
        with pytest.warns(UserWarning, match="could not delete old checkpoint") if faults.armed_at("filesystem_write") \
                else contextlib.nullcontext():
            return harness_train(run_dir)

    report = check_fault_tolerance(train, [Fault("filesystem_write", hit, "eio")], work_dir=str(tmp_path / "work"))
    assert report.trials[0].outcome == "tolerated" and report.trials[0].exact


def test_work_dir_must_be_empty(tmp_path):
    (tmp_path / "leftover").mkdir()
    with pytest.raises(engine.ConfigError, match="not empty"):
        check_fault_tolerance(harness_train, ["split_end:1:raise"], work_dir=str(tmp_path))


def test_one_spec_alone_is_one_fault_list(tmp_path):
    # Before, a string was iterated character by character ("'s' is not POINT:HIT:KIND").
    report = check_fault_tolerance(harness_train, "split_end:5:raise", work_dir=str(tmp_path))
    assert [trial.fault for trial in report.trials] == [Fault("split_end", 5, "raise")]
    assert report.trials[0].exact, report.table()


@pytest.mark.parametrize("settings, field", [(dict(max_attempts=0), "max_attempts"), (dict(max_attempts=True), "max_attempts"),
                                             (dict(timeout=-1), "timeout"), (dict(timeout=float("nan")), "timeout")])
def test_attempts_and_timeout_are_validated(tmp_path, settings, field):
    with pytest.raises(engine.ConfigError, match=field):
        check_fault_tolerance(harness_train, ["split_end:1:raise"], work_dir=str(tmp_path), **settings)
    assert not os.listdir(tmp_path)  # refused before any run


def test_a_reference_run_that_fails_shows_why(tmp_path):
    with pytest.raises(engine.EngineError, match=r"(?s)did not complete: exit 1.*no_such_module_here"):
        check_fault_tolerance("no_such_module_here:train", [Fault("split_end", 1, "raise")], work_dir=str(tmp_path))
