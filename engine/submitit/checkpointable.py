"""A training function that submitit preempts gracefully and resubmits.

submitit signals a job before its time limit or a preemption (SIGUSR2 unless
``SUBMITIT_PREEMPT_SIGNAL`` says otherwise) and, in that signal's handler, calls the job
function's ``checkpoint()`` to learn what to resubmit, then requeues the job. Saving from
inside a signal handler is unsafe (it can run in the middle of backward or of a checkpoint
write), so while ``fit`` runs :class:`Checkpointable` turns submitit's signal into the engine's
own preemption request (a SIGTERM to the process, one of ``TrainerConfig.preemption_signals`` by
default): the run finishes its split and commits, ``fit`` ends as preempted (its stop reason
names submitit's signal), and only then does submitit's handler run, which calls
:meth:`Checkpointable.checkpoint` and requeues. Outside ``fit`` (loading data, building the
model, after ``fit`` returned) there is nothing to commit, and SIGTERM would reach submitit's
handler for it, which ignores it: submitit's handler runs at once instead. A signal that
arrived while ``fit`` ran but did not stop it (it came after the last boundary, or
``exit_on_preemption=False``) requeues when the function returns. So every signal received
in the call ends in a requeue. The resubmitted job calls the function again with the same
arguments, and ``fit`` resumes from the run directory (a finished run returns at once).
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any, Callable, Generic, TypeVar

from engine.errors import ConfigError
from engine.faults.preemption import PreemptionWatcher
from engine.run.preemption import forget_passed_on, pass_on

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

    Keep SIGTERM among ``TrainerConfig.preemption_signals`` (the default): SIGTERM carries
    submitit's signal to ``fit``. With ``exit_on_preemption=True`` (the default) ``fit``'s exit
    after the commit lets submitit requeue; with ``False`` the requeue comes when ``train_fn``
    returns. ``train_fn`` and its arguments must be picklable (submitit pickles the job).
    """

    def __init__(self, train_fn: Callable[..., T]) -> None:
        if not callable(train_fn):
            raise ConfigError(f"engine.submitit.Checkpointable: expected a callable training function, got {train_fn!r}")
        self.train_fn = train_fn

    def __call__(self, *args: Any, **kwargs: Any) -> T:
        """Run ``train_fn``; on submitit's signal, stop at a boundary, commit, and let submitit
        requeue (its handler calls :meth:`checkpoint`); outside ``fit``, requeue at once."""
        number = int(_submitit().JobEnvironment._usr_sig())
        relay = _Relay(signal.getsignal(number))
        signal.signal(number, relay.handle)
        try:
            result = self.train_fn(*args, **kwargs)
        except SystemExit:
            relay.requeue()  # fit's exit after its preemption commit: now submitit may requeue (and exits)
            raise
        finally:
            signal.signal(number, relay.submitit_handler)
            forget_passed_on()
        relay.requeue()  # a signal that came too late to stop fit (or outside it) still requeues
        return result

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """submitit's protocol: the resubmission, the same call again (``fit`` resumes from its
        run directory, whose newest checkpoint the stop just committed)."""
        return _submitit().helpers.DelayedSubmission(self, *args, **kwargs)


class _Relay:
    """submitit's signal handler while the wrapped call runs (module docstring)."""

    def __init__(self, submitit_handler: Any) -> None:
        self.submitit_handler = submitit_handler
        self.received: int | None = None
        self.requeued = False

    def handle(self, number: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = number
        if _fit_handles(signal.SIGTERM):
            pass_on(number, signal.SIGTERM)  # the engine's preemption request: finish the split, commit
        else:
            self.requeue()  # nothing to commit now

    def requeue(self) -> None:
        """Run submitit's handler (it calls checkpoint(), requeues and exits) once, when the
        signal came."""
        if self.received is None or self.requeued or not callable(self.submitit_handler):
            return
        self.requeued = True
        self.submitit_handler(self.received, None)


def _fit_handles(number: int) -> bool:
    """Whether a ``fit`` of this process has its preemption handler installed for ``number``."""
    return isinstance(getattr(signal.getsignal(number), "__self__", None), PreemptionWatcher)
