"""Progress display on stderr: where the run starts, how it goes, how it ended.

* At start, one line: ``starting fresh in <run dir>``, or ``resuming from <checkpoint>`` with
  the position it continues after, the checkpoint's age and what the checkpoint decides for
  this run (a finished run trains nothing more unless a limit was raised; settings the
  checkpoint overrides).
* While training: on a terminal a tqdm bar per epoch (completed batches of the epoch, with
  total, rate and ETA; batch, split, loss and optimizer step as postfix), which starts at the
  resumed position after a resume; otherwise (a log file, SLURM) one timestamped line every
  ``log_every_seconds`` with elapsed time, percentage, rate and ETA, and one per finished epoch.
* At the end, one summary line: epochs, optimizer steps, checkpoints written, time.

``"off"`` prints nothing. Numbering is the cursor's everywhere: epoch, batch and split
*indices* count from 0 (as in ``metrics.jsonl`` and ``inspect``); "3/6 batches" is a *count*
of completed batches.
"""

from __future__ import annotations

import io
import os
import sys
import time
from typing import Sequence, TextIO

from tqdm import tqdm

from engine.checkpoint.store.checkpoint_store import LoadedCheckpoint
from progress import Cursor

PREFIX = "splitloop: "
BAR_REFRESH_SECONDS = 0.1


def format_age(seconds: float) -> str:
    """``"45 s"``, ``"3 min"``, ``"2.5 h"``, ``"4 days"``: how long ago something happened."""
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.0f} days"


def _width_options(stream: TextIO) -> dict[str, object]:
    """Follow the terminal's size; a pty that reports none (size 0) would make tqdm print
    nothing, so assume 100 x 24 there."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return {"ncols": 100, "nrows": 24}
    return {"dynamic_ncols": True} if size.columns > 0 and size.lines > 0 else {"ncols": 100, "nrows": 24}


def describe_cursor(cursor: Cursor) -> str:
    return f"epoch {cursor.epoch} batch {cursor.batch} split {cursor.split}"


class Display:
    """What one ``fit`` call shows (see the module docstring).

    Args:
        mode: ``"auto"`` (a bar when ``stream`` is a terminal, log lines otherwise), ``"bar"``,
            ``"log"`` or ``"off"``.
        log_every_seconds: interval of the log lines.
        total_batches: batches per epoch, or None when the data has no length (no ETA then).
        stream: where to write (stderr by default).
        tbptt: True when a batch is cut into several splits; a split then does not complete
            its batch, and the bar counts a batch once its last split has run.
    """

    def __init__(self, mode: str, log_every_seconds: float, total_batches: int | None,
                 stream: TextIO | None = None, tbptt: bool = False) -> None:
        self._stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if self._stream.isatty() else "log"
        self._mode = mode
        self._interval = BAR_REFRESH_SECONDS if mode == "bar" else log_every_seconds
        self._total = total_batches
        self._split_completes_batch = not tbptt
        self._started = time.monotonic()
        self._next_time = 0.0
        self._bar: tqdm | None = None
        self._bar_epoch = -1
        self._resumed_at: Cursor | None = None
        self._batches_in_earlier_epochs = 0  # completed in this call, for the log lines' rate
        self._last: tuple[Cursor, float, int] | None = None
        self._last_shown: tuple[Cursor, float, int] | None = None
        self.checkpoints_written = 0
        self.checkpoint_interval: int | None = None

    # ---- events -------------------------------------------------------------------------
    def start(self, run_dir: str | None, resumed: LoadedCheckpoint | None, notes: Sequence[str] = ()) -> None:
        """Say where the run starts: fresh in ``run_dir``, or from the ``resumed`` checkpoint,
        followed by ``notes`` (what the checkpoint's end or its settings mean for this run)."""
        self._started = time.monotonic()
        if resumed is None:
            where = f"in {run_dir}" if run_dir is not None else "(run_dir is None: no checkpoints, no metrics file)"
            self._line(f"starting fresh {where}")
            return
        self._resumed_at = resumed.progress.cursor
        age = format_age(time.time() - resumed.manifest.created_unix)
        after = "" if self._resumed_at is None else f", continuing after {describe_cursor(self._resumed_at)}"
        said = "".join(f"; {note}" for note in notes)
        self._line(f"resuming from {resumed.name} in {run_dir} (written {age} ago){after}{said}")

    def update(self, cursor: Cursor, loss: float, optimizer_steps: int) -> None:
        """A split (a batch without TBPTT) completed; cheap unless a refresh is due."""
        if self._mode == "off":
            return
        self._last = (cursor, loss, optimizer_steps)
        now = time.monotonic()
        if now < self._next_time:
            return
        self._next_time = now + self._interval
        self._show(cursor, loss, optimizer_steps)

    def note_checkpoint(self, written: bool, interval: int | None = None) -> None:
        """A checkpoint was committed or queued (``written``), or skipped; ``interval`` is the
        split interval ``every_n_splits="auto"`` chose (shown in the log lines), or None."""
        self.checkpoints_written += bool(written)
        self.checkpoint_interval = interval

    def end_epoch(self, epoch: int) -> None:
        """Epoch ``epoch`` finished: complete and close its bar, or log one line for it."""
        if self._mode == "off" or self._last is None or self._last[0].epoch != epoch:
            return  # nothing of this epoch ran in this call
        cursor, loss, steps = self._last
        done = self._total or self._done(cursor)
        if self._mode == "bar":
            self._refresh_bar(cursor, loss, steps, done)
            self._close_bar()
        else:
            self._log_line(cursor, loss, steps, done, finished=True)
        self._batches_in_earlier_epochs += max(0, done - self._initial(epoch))
        self._next_time = 0.0  # show the next epoch's first split at once

    def finish(self, epochs_completed: int, optimizer_steps: int, stop_reason: str | None) -> None:
        """The summary line of a ``fit`` call that returned."""
        self.close()
        elapsed = tqdm.format_interval(time.monotonic() - self._started)
        stopped = f"; stopped: {stop_reason}" if stop_reason else ""
        interval = f" (every {self.checkpoint_interval} splits)" if self.checkpoint_interval is not None else ""
        self._line(f"done in {elapsed}: {epochs_completed} epochs completed, {optimizer_steps} optimizer steps, "
                   f"{self.checkpoints_written} checkpoints written{interval}{stopped}")

    def close(self) -> None:
        """Close a bar left open (a stop or an exception inside an epoch)."""
        if self._bar is not None:
            if self._last is not None and self._last != self._last_shown:
                self._refresh_bar(*self._last, done=self._done(self._last[0]))
            self._close_bar()

    # ---- output -------------------------------------------------------------------------
    def _done(self, cursor: Cursor) -> int:
        """Batches of ``cursor``'s epoch completed once its split has run."""
        return cursor.batch + 1 if self._split_completes_batch else cursor.batch

    def _show(self, cursor: Cursor, loss: float, steps: int) -> None:
        self._last_shown = (cursor, loss, steps)
        if self._mode == "bar":
            self._refresh_bar(cursor, loss, steps, self._done(cursor))
        else:
            self._log_line(cursor, loss, steps, self._done(cursor), finished=False)

    def _refresh_bar(self, cursor: Cursor, loss: float, steps: int, done: int) -> None:
        if self._bar is None or self._bar_epoch != cursor.epoch:
            self._close_bar()
            self._bar = tqdm(total=self._total, initial=self._initial(cursor.epoch), desc=f"epoch {cursor.epoch}",
                             unit="batch", file=self._stream, leave=True, **_width_options(self._stream),
                             mininterval=0, miniters=0, smoothing=0.1)
            self._bar_epoch = cursor.epoch
        self._bar.set_postfix_str(f"batch {cursor.batch} split {cursor.split} loss {loss:.4f} step {steps}", refresh=False)
        if done > self._bar.n:
            self._bar.update(done - self._bar.n)
        else:
            self._bar.refresh()

    def _initial(self, epoch: int) -> int:
        """Where a resumed epoch's bar starts: the batches completed before the checkpoint."""
        resumed = self._resumed_at
        return self._done(resumed) if resumed is not None and resumed.epoch == epoch else 0

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _log_line(self, cursor: Cursor, loss: float, steps: int, done: int, finished: bool) -> None:
        seconds = time.monotonic() - self._started
        batches_in_call = self._batches_in_earlier_epochs + max(0, done - self._initial(cursor.epoch))
        rate = batches_in_call / seconds if seconds > 0 else 0.0
        parts = [f"epoch {cursor.epoch} finished" if finished else describe_cursor(cursor)]
        if self._total:
            parts.append(f"{done}/{self._total} batches ({100 * done // self._total}%)")
        else:
            parts.append(f"{done} batches")
        parts += [f"loss {loss:.4f}", f"step {steps}", f"elapsed {tqdm.format_interval(seconds)}",
                  f"{rate:.2f} batches/s"]
        if self.checkpoint_interval is not None:
            parts.append(f"checkpoint every {self.checkpoint_interval} splits")
        if self._total and not finished:
            eta = tqdm.format_interval((self._total - done) / rate) if rate > 0 else "?"
            parts.append(f"epoch ETA {eta}")
        self._line(" | ".join(parts))

    def _line(self, text: str) -> None:
        if self._mode == "off":
            return
        stamp = time.strftime("%Y-%m-%d %H:%M:%S ") if self._mode == "log" else ""
        self._stream.write(f"{stamp}{PREFIX}{text}\n")
        self._stream.flush()
