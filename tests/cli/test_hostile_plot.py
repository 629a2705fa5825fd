"""``python -m engine plot`` over a metrics.jsonl holding rows the engine never writes: they
are skipped like torn lines, instead of a KeyError or TypeError traceback."""

import json
import os

import pytest

from engine.cli.main import main

GOOD = [
    {"stage": "train", "epoch": 0, "batch": 0, "split": 0, "loss": 2.0, "step": 1},
    {"stage": "train", "epoch": 0, "batch": 0, "split": 1, "loss": 1.5, "step": 2},
    {"stage": "val", "epoch": 0, "step": 2, "metrics": {"val_loss": 1.7}},
]
BAD = [
    {"stage": "train", "loss": 1.0},  # no step
    {"stage": "train", "loss": "low", "step": 3},
    {"stage": "train", "loss": 1.0, "step": [3]},
    {"stage": "val", "step": 3, "metrics": 5},
    {"stage": "val", "step": 3, "metrics": {"val_loss": "x"}},
    {"stage": "val", "metrics": {"val_loss": 1.0}},
]


@pytest.mark.parametrize("bad", BAD, ids=[json.dumps(row) for row in BAD])
def test_plot_skips_rows_of_another_shape(bad, tmp_path, capsys):
    rows = [GOOD[0], bad, *GOOD[1:]]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "out.png")]) == 0
    assert "2 training rows, 1 validation rows" in capsys.readouterr().out
    assert (tmp_path / "out.png").stat().st_size > 0


@pytest.mark.timeout(60)  # the reader used to block in open() on a FIFO
def test_plot_of_a_metrics_file_that_is_a_fifo_is_an_error_line(tmp_path, capsys):
    os.mkfifo(tmp_path / "metrics.jsonl")
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "out.png")]) == 1
    assert "not a regular file" in capsys.readouterr().err
