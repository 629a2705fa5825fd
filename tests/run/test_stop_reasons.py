"""Why a run stopped: a preemption is never masked by another stop request in the same split."""

import os
import signal

import engine
from scenarios import train_with_checkpoints


class StopAndSignal(engine.Callback):
    """At split ``at``, asks to stop and then (or first) receives SIGTERM."""

    def __init__(self, at, signal_first):
        self.at, self.signal_first, self.seen = at, signal_first, 0

    def on_split_end(self, view):
        self.seen += 1
        if self.seen != self.at:
            return
        if self.signal_first:
            os.kill(os.getpid(), signal.SIGTERM)
            view.request_stop("callback asked")
        else:
            view.request_stop("callback asked")
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_callback_stop_in_the_same_split_does_not_mask_a_preemption(tmp_path):
    for signal_first in (False, True):
        run_dir = str(tmp_path / f"run-{signal_first}")
        result = train_with_checkpoints("tbptt", run_dir, every=4, exit_on_preemption=False,
                                        callbacks=(StopAndSignal(3, signal_first),))
        assert result.preempted is True
        assert result.stop_reason == "preempted by SIGTERM"
        assert result.cursor.as_tuple()[:3] == (0, 0, 2)


def test_a_callback_stop_alone_is_not_a_preemption(tmp_path):
    class Stop(engine.Callback):
        def on_split_end(self, view):
            view.request_stop("enough")

    result = train_with_checkpoints("tbptt", str(tmp_path / "run"), callbacks=(Stop(),))
    assert result.preempted is False and result.stop_reason == "enough"


def test_the_cursor_names_the_last_optimizer_of_the_split(tmp_path):
    several = train_with_checkpoints("tbptt_several_optimizers", str(tmp_path / "several"), epochs=1)
    single = train_with_checkpoints("tbptt", str(tmp_path / "single"), epochs=1)
    assert several.cursor.optimizer == 1
    assert single.cursor.optimizer == 0
