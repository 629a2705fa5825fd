"""The progress display: a rewritten line on a terminal, plain log lines otherwise."""

import io

from engine.run.display import Display
from progress import Cursor


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_log_mode_prints_lines_when_not_a_terminal():
    stream = io.StringIO()
    display = Display("auto", log_every_seconds=0.000001, total_batches=6, stream=stream)
    display.update(Cursor(0, 1, 2, 0), 1.5, 7)
    display.update(Cursor(0, 1, 3, 0), 1.25, 8)
    display.close()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "epoch 0 batch 2/6 split 2 loss 1.5000 steps 7"
    assert "\r" not in stream.getvalue() and len(lines) == 2


def test_bar_mode_rewrites_one_line_on_a_terminal():
    stream = FakeTerminal()
    display = Display("auto", log_every_seconds=10.0, total_batches=None, stream=stream)
    display.update(Cursor(2, 0, 0, 0), 0.5, 1)
    display.close()
    text = stream.getvalue()
    assert text.startswith("\repoch 2 batch 1 split 0 loss 0.5000 steps 1") and text.endswith("\n")


def test_log_lines_are_throttled():
    stream = io.StringIO()
    display = Display("log", log_every_seconds=3600.0, total_batches=1, stream=stream)
    for split in range(50):
        display.update(Cursor(0, 0, split, 0), 1.0, split)
    assert len(stream.getvalue().splitlines()) == 1


def test_off_prints_nothing():
    stream = FakeTerminal()
    display = Display("off", log_every_seconds=0.000001, total_batches=1, stream=stream)
    display.update(Cursor(0, 0, 0, 0), 1.0, 0)
    display.close()
    assert stream.getvalue() == ""
