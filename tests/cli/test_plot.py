"""``python -m engine plot``: a PNG of training loss and validation metrics, with resume markers."""

import json
import struct

import pytest

import engine
import engine.testing
from engine.cli.plot import plot_run, read_rows
from engine.checkpoint.storage import Storage
from validation_scenarios import train_validated


def png_size(path):
    with open(path, "rb") as handle:
        header = handle.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("run"))
    engine.testing.inject([engine.testing.Fault("split_end", 7, "raise")])
    try:
        with pytest.raises(engine.InjectedFault):
            train_validated(run_dir, epochs=1, every_steps=4)
    finally:
        engine.testing.clear()
    train_validated(run_dir, epochs=1, every_steps=4)
    return run_dir


def test_a_resume_is_recorded_outside_metrics_jsonl(resumed_run):
    resumes = read_rows(Storage(resumed_run), "resumes.jsonl")
    assert len(resumes) == 1 and resumes[0]["checkpoint"].startswith("ckpt-")
    assert resumes[0]["step"] == 6  # the last checkpoint before the failure at split 7
    stages = {json.loads(line)["stage"] for line in open(f"{resumed_run}/metrics.jsonl")}
    assert stages == {"train", "val", "train_epoch"}


def test_plot_renders_a_png_with_every_row(resumed_run, tmp_path):
    out = str(tmp_path / "run.png")
    drawn = plot_run(resumed_run, out)
    assert drawn == {"train": 12, "val": 3, "resumes": 1}  # 12 splits; val at steps 4, 8, 12 (= the epoch end)
    width, height = png_size(out)
    assert width > 300 and height > 300


def test_plot_of_a_directory_without_metrics_is_refused(tmp_path):
    with pytest.raises(engine.CheckpointNotFound, match="metrics.jsonl"):
        plot_run(str(tmp_path), str(tmp_path / "x.png"))


def test_plot_without_matplotlib_says_how_to_install(resumed_run, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(engine.EngineError, match=r"splitloop\[plot\]"):
        plot_run(resumed_run, str(tmp_path / "x.png"))
