"""A training function that submitit preempts gracefully and resubmits.

submitit signals a job before its time limit or a preemption (SIGUSR2 unless
``SUBMITIT_PREEMPT_SIGNAL`` says otherwise) and, in that signal's handler, calls the job
function's ``checkpoint()`` to learn what to resubmit, then requeues the job. Saving from
inside a signal handler is unsafe (it can run in the middle of backward or of a checkpoint
write), so :class:`Checkpointable` turns submitit's signal into the engine's own preemption
request (a SIGTERM to the process, one of ``TrainerConfig.preemption_signals`` by default): the
run finishes its split and commits, ``fit`` ends as preempted, and only then does submitit's
handler run, which calls :meth:`Checkpointable.checkpoint` and requeues. The resubmitted job
calls the function again with the same arguments, and ``fit`` resumes from the run directory.
"""

from __future__ import annotations

import os
import signal
from types import FrameType
from typing import Any, Callable, Generic, TypeVar

from engine.errors import ConfigError

T = TypeVar("T")


def _submitit() -> Any:
    try:
        import submitit
    except ImportError as error:
        raise ConfigError("engine.submitit needs submitit: pip install 'splitloop[submitit]'") from error
    return submitit


class Checkpointable(Generic[T]):
    """Wrap ``train_fn`` (which calls ``Trainer.fit`` with a ``run_dir``) for submitit.

    Example::

        def train(run_dir: str) -> float:
            result = engine.Trainer(engine.TrainerConfig(run_dir=run_dir, max_epochs=10)).fit(Model(), loader)
            return result.metrics["loss"]

        executor = submitit.AutoExecutor(folder="logs")
        job = executor.submit(engine.submitit.Checkpointable(train), "runs/lm")

    Keep SIGTERM among ``TrainerConfig.preemption_signals`` and ``exit_on_preemption=True`` (the
    defaults): SIGTERM carries submitit's signal to ``fit``, whose exit after the commit tells
    the wrapper to let submitit requeue. ``train_fn`` and its arguments must be picklable
    (submitit pickles the job).
    """

    def __init__(self, train_fn: Callable[..., T]) -> None:
        if not callable(train_fn):
            raise ConfigError(f"engine.submitit.Checkpointable: expected a callable training function, got {train_fn!r}")
        self.train_fn = train_fn

    def __call__(self, *args: Any, **kwargs: Any) -> T:
        """Run ``train_fn``; on submitit's signal, stop at a boundary, commit, and let submitit
        requeue (its handler calls :meth:`checkpoint`)."""
        number = int(_submitit().JobEnvironment._usr_sig())
        submitit_handler = signal.getsignal(number)
        received: list[int] = []

        def request_stop(signum: int, frame: FrameType | None) -> None:
            received.append(signum)
            os.kill(os.getpid(), signal.SIGTERM)  # the engine's preemption request: finish the split, commit

        signal.signal(number, request_stop)
        try:
            return self.train_fn(*args, **kwargs)
        except SystemExit:
            # fit's exit after its preemption commit: now submitit may checkpoint and requeue.
            if not received or not callable(submitit_handler):
                raise
            submitit_handler(received[0], None)  # calls self.checkpoint(), requeues, exits
            raise
        finally:
            signal.signal(number, submitit_handler)

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """submitit's protocol: the resubmission, the same call again (``fit`` resumes from its
        run directory, whose newest checkpoint the stop just committed)."""
        return _submitit().helpers.DelayedSubmission(self, *args, **kwargs)
