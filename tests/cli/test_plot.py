"""``python -m engine plot``: a PNG of training loss and validation metrics, with resume markers."""

import json
import struct

import pytest

import engine
import engine.testing
from engine.cli.plot import draw, plot_run, read_curves, read_rows
from engine.checkpoint.store.storage import Storage
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
    assert drawn == {"train": 12, "val": 3, "resumes": 1, "anomalies": 0, "hangs": 0}  # 12 splits; val at steps 4, 8, 12 (= the epoch end)
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


def test_the_plot_command_writes_metrics_png_into_the_run_dir(resumed_run, capsys):
    from engine.cli import main

    assert main(["plot", resumed_run]) == 0
    assert "1 resume(s)" in capsys.readouterr().out
    width, _ = png_size(f"{resumed_run}/metrics.png")
    assert width > 300


def test_the_plot_command_needs_out_for_a_url(capsys):
    from engine.cli import main

    assert main(["plot", "memory://somewhere"]) == 1
    assert "--out" in capsys.readouterr().err


# ---- what the picture shows: panels per family, a smoothed curve, labelled resumes --------------
SPLITS_PER_BATCH = 4
RESUMES = [(8, "ckpt-0000000002"), (24, "ckpt-0000000006"), (24, "ckpt-0000000006"), (40, "ckpt-0000000010"),
           (56, "ckpt-0000000014")]


def write_run(run_dir):
    """A TBPTT run as the engine writes it: a batch's first split has the higher loss (it starts
    from no hidden state), validation logs a loss and a perplexity; five resumes, two of them
    from one checkpoint."""
    rows = []
    for step in range(1, 65):
        split = (step - 1) % SPLITS_PER_BATCH
        rows.append({"stage": "train", "epoch": 0, "batch": (step - 1) // SPLITS_PER_BATCH, "split": split,
                     "loss": 3.0 if split == 0 else 2.0, "step": step})
        if step % 16 == 0:
            rows.append({"stage": "val", "epoch": 0, "step": step, "metrics": {"val_loss": 2.5, "val_ppl": 280.0 - step}})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (run_dir / "resumes.jsonl").write_text("".join(json.dumps({"checkpoint": name, "step": step}) + "\n"
                                                   for step, name in RESUMES))


@pytest.fixture
def figure(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    write_run(tmp_path)
    figure = draw(read_curves(str(tmp_path)), pyplot, "run")
    yield figure
    pyplot.close(figure)


def labels(panel):
    return [line.get_label() for line in panel.get_lines() if not line.get_label().startswith("_")]


def test_each_metric_family_has_its_own_panel(figure):
    loss, perplexity = figure.axes
    assert (loss.get_ylabel(), perplexity.get_ylabel()) == ("loss", "ppl")
    assert "val_loss" in labels(loss) and "val_ppl" not in labels(loss)
    assert labels(perplexity) == ["val_ppl"]


def test_the_training_loss_is_smoothed_over_whole_batches(figure):
    loss = figure.axes[0]
    (raw,) = [line for line in loss.get_lines() if line.get_label() == "train loss (per split)"]
    (smoothed,) = [line for line in loss.get_lines() if line.get_label().startswith("train loss (mean of")]
    assert set(raw.get_ydata()) == {2.0, 3.0}  # the zig-zag is still shown, faint
    assert set(smoothed.get_ydata()) == {2.25}  # every window holds whole batches: no zig-zag


def test_every_resume_is_a_labelled_marker(figure):
    steps = sorted({step for step, _ in RESUMES})
    for panel in figure.axes:
        markers = [line for line in panel.get_lines() if line.get_linestyle() == "--" and len(set(line.get_xdata())) == 1]
        assert sorted(line.get_xdata()[0] for line in markers) == steps
    texts = sorted((text.xy[0], text.get_text()) for text in figure.axes[0].texts)
    assert texts == [(8, "resumed from ckpt-2"), (24, "resumed from ckpt-6 (2 times)"), (40, "resumed from ckpt-10"),
                     (56, "resumed from ckpt-14")]


def test_each_hang_is_a_labelled_marker_at_the_step_of_its_last_split(tmp_path, capsys):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    from engine.cli import main

    write_run(tmp_path)
    rows = [{"rank": 1, "phase": "step", "last_split": 21, "reported_by": 1},
            {"rank": 0, "phase": "boundary", "last_split": 0, "reported_by": 1},
            {"rank": None, "phase": "collective (culprit on another node)"}]  # names no split: not drawn
    (tmp_path / "hangs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"torn')
    curves = read_curves(str(tmp_path))
    # the training rows are one per split: split 21 ended at the step of the 21st row (step 21 here)
    assert curves.hangs == [(21.0, "hang: rank 1 in step after split 21"), (0.0, "hang: rank 0 in boundary after split 0")]
    figure = draw(curves, pyplot, "run")
    try:
        for panel in figure.axes:
            marks = [line for line in panel.get_lines() if line.get_linestyle() == "-."]
            assert sorted(line.get_xdata()[0] for line in marks) == [0.0, 21.0]
        assert "hang: rank 1 in step after split 21" in [text.get_text() for text in figure.axes[0].texts]
        assert "hang (watchdog)" in labels(figure.axes[0])
    finally:
        pyplot.close(figure)
    assert main(["plot", str(tmp_path)]) == 0
    assert "2 hang(s)" in capsys.readouterr().out
