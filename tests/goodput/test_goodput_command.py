"""``python -m engine goodput``'s refusals (one ``error:`` line, exit status 1) and its outputs on a
hand-written ledger."""

from __future__ import annotations

import json
import pathlib

import pytest

from engine.cli.main import main
from ledger_rows import AttemptWriter, write


@pytest.mark.parametrize("argv, message", [
    (["goodput"], "give a run directory, or --simulate"),
    (["goodput", "--simulate"], "give --gpus N"),
    (["goodput", "--simulate", "--gpus", "8"], "give --checkpoint-s, a --profile"),
    (["goodput", "--simulate", "--gpus", "8", "--checkpoint-s", "1", "--hang-share", "2"], "a share between 0 and 1"),
    (["goodput", "--simulate", "--gpus", "8", "--profile", "fast"], "--profile: one of"),
    (["goodput", "--simulate", "--gpus", "100000", "--mtbf-gpu-hours", "1", "--checkpoint-s", "1"],
     "more than the model draws"),
], ids=["nothing", "no-gpus", "no-cost", "share", "profile", "hopeless-job"])
def test_bad_requests_are_refused_in_one_line(argv: list[str], message: str, capsys) -> None:
    assert main(argv) == 1
    error = capsys.readouterr().err
    assert error.startswith("error: ") and message in error and error.count("\n") == 1


def test_a_directory_without_a_ledger_is_refused(tmp_path: pathlib.Path, capsys) -> None:
    assert main(["goodput", str(tmp_path)]) == 1
    assert "has no goodput ledger" in capsys.readouterr().err


def test_the_json_account_and_model(tmp_path: pathlib.Path, capsys) -> None:
    first = AttemptWriter("a1", process_start=0.0).start(1.0).restored(2.0).row("training", 3.0)
    first.commit(5.0, 1, 1.0, {"0": [[0, 12]]}, epochs=1).row("beat", 6.0, units=2)
    second = AttemptWriter("a2", process_start=10.0).start(11.0).restored(12.0, units=1).row("training", 13.0)
    second.commit(15.0, 2, 1.0, epochs=2).end(16.0, "finished")
    write(tmp_path, first, second)
    assert main(["goodput", str(tmp_path), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["causes"] == {"killed": 1, "finished": 1} and found["wall_s"] == pytest.approx(16.0)
    assert [attempt["cause"] for attempt in found["timeline"]] == ["killed", "finished"]
    assert main(["goodput", "--simulate", "--from", str(tmp_path), "--json", "--trials", "5"]) == 0
    model = json.loads(capsys.readouterr().out)
    assert model["model"]["checkpoint_s"] == pytest.approx(1.0) and model["model"]["gpus"] == 1
    # Attempt 1 is placed dead at its last row (6) + a beat (1) + a unit (3 s for 2 units): it trained
    # from 3 to 8.5, attempt 2 from 13 to 16; one failure: 8.5 s of training per failure, on its one GPU.
    assert model["model"]["job_mtbf_s"] == pytest.approx(8.5)
    assert model["horizon_s"] == pytest.approx(16.0) and len(model["intervals"]) == 7


def test_plot_draws_the_attempts_under_the_curves(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("matplotlib")
    from engine.cli.plot import read_curves

    first = AttemptWriter("a1", process_start=0.0).start(1.0).restored(2.0).row("training", 3.0)
    first.commit(5.0, 1, 1.0, {"0": [[0, 12]]}, epochs=1).row("beat", 6.0, units=2)
    second = AttemptWriter("a2", process_start=10.0).start(11.0).restored(12.0, units=1).row("training", 13.0)
    second.commit(15.0, 2, 1.0, epochs=2).end(16.0, "finished")
    write(tmp_path, first, second)
    (tmp_path / "metrics.jsonl").write_text('{"stage": "train", "epoch": 0, "batch": 0, "split": 0, "loss": 1.0, "step": 1}\n')
    # Attempt 1: start-up 0..3, kept until its commit at 5, lost until 8.5 (see above), down until 10.
    assert read_curves(str(tmp_path)).timeline == [
        ("start-up", 0.0, 3.0), ("productive", 3.0, 5.0), ("lost", 5.0, 8.5), ("down", 8.5, 10.0),
        ("start-up", 10.0, 13.0), ("productive", 13.0, 16.0), ("lost", 16.0, 16.0)]
