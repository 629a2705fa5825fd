"""chaos streams: check_fault_tolerance reports each trial as soon as it is finished, and
`python -m engine chaos` prints its row then, not at the end."""

import os

import engine.testing.harness as harness
from engine.cli.main import main
from engine.faults import Fault
from engine.testing.harness import FaultReport, Trial, check_fault_tolerance
from scenarios import harness_train


def test_each_trial_is_reported_before_the_next_one_starts(tmp_path):
    reported = []

    def on_trial(trial):
        later_trial_dirs = sorted(name for name in os.listdir(tmp_path) if name > f"trial-{len(reported):03d}")
        reported.append((trial, later_trial_dirs))

    fault_list = [Fault("split_end", 3, "raise"), Fault("epoch_end", 1, "raise")]
    report = check_fault_tolerance(harness_train, fault_list, work_dir=str(tmp_path), on_trial=on_trial)
    assert [trial for trial, _ in reported] == report.trials and len(report.trials) == 2
    assert all(later == [] for _, later in reported)
    assert report.table().splitlines() == [FaultReport.header(), *(FaultReport.row(t) for t in report.trials)]


def test_the_chaos_command_prints_each_row_as_its_trial_finishes(tmp_path, capsys, monkeypatch):
    printed_while_running = []

    def fake_check(train, fault_list, work_dir, args, on_trial):
        trials = []
        for fault in fault_list:
            trials.append(Trial(fault, "killed by signal 9", "ckpt-0000000003", (0, 1, 2, 0), 2, []))
            on_trial(trials[-1])
            printed_while_running.append(capsys.readouterr().out)
        return FaultReport(os.path.join(work_dir, "reference"), trials)

    monkeypatch.setattr(harness, "check_fault_tolerance", fake_check)
    assert main(["chaos", "--dir", str(tmp_path / "work"), "--trials", "2"]) == 0
    first, second = printed_while_running
    assert first.splitlines()[0] == "chaos: a reference run, then 2 trials; one row per trial as it finishes"
    assert len(first.splitlines()) == 3 and first.splitlines()[1] == FaultReport.header()
    for row in (first.splitlines()[2], second):
        assert "killed by signal 9" in row and "epoch 0 batch 1 split 2" in row and row.rstrip().endswith("yes")
    assert len(second.splitlines()) == 1
    assert capsys.readouterr().out == "chaos: 2 trials, 2 exact, 0 failed\n"
