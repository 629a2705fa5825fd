"""Check that a training function survives faults: run it under each fault, resume until it
finishes, and compare the result with an uninterrupted reference, bit for bit.

Usable from pytest in a user's own project::

    from engine.testing import Fault, check_fault_tolerance

    def test_my_training_survives_faults(tmp_path):
        report = check_fault_tolerance("mypackage.train:main", [
            Fault("split_end", 7, "sigkill"),
            Fault("checkpoint_before_manifest", 3, "sigkill"),
            Fault("filesystem_write", 40, "enospc"),
        ], work_dir=str(tmp_path))
        assert report.all_exact, report.table()

``"mypackage.train:main"`` names a function ``main(run_dir, *args) -> engine.FitResult`` that
builds its model and data from a fixed seed and calls ``Trainer.fit`` with
``TrainerConfig(run_dir=run_dir, ...)``. It runs in a fresh subprocess for every attempt
(``python -m engine.testing MODULE:FUNCTION RUN_DIR ARGS...``), so SIGKILL faults work. A Python
callable instead of a string runs in this process (faults of kind ``sigkill`` are then refused).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import subprocess
import sys
from typing import Any, Callable, Sequence

import fsspec
import torch

from engine import faults
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.errors import ConfigError, EngineError
from engine.faults import Fault
from engine.checkpoint.store.metrics_log import METRICS_FILE
from engine.result import FitResult
from engine.run.state import COMPARED_KEYS
from engine.checkpoint.store.storage import Storage

RESULT_PREFIX = "SPLITLOOP_RESULT "
TrainFunction = Callable[..., FitResult]


@dataclasses.dataclass
class Trial:
    """One fault: what happened when it fired, where the run resumed, whether it was exact."""

    fault: Fault
    outcome: str
    resumed_from: str | None
    resumed_cursor: tuple[int, int, int, int] | None
    attempts: int
    differences: list[str]

    @property
    def exact(self) -> bool:
        return self.outcome != "never fired" and not self.differences


@dataclasses.dataclass
class FaultReport:
    reference_dir: str
    trials: list[Trial]

    @property
    def all_exact(self) -> bool:
        return all(trial.exact for trial in self.trials)

    def table(self) -> str:
        """A header line and one :meth:`row` per trial."""
        return "\n".join([self.header(), *(self.row(trial) for trial in self.trials)])

    @staticmethod
    def header() -> str:
        return f"{'fault':<44} {'outcome':<28} {'resumed at':<26} exact"

    @staticmethod
    def row(trial: Trial) -> str:
        """One line of :meth:`table`: fault, outcome, where the run resumed, exact or the differences."""
        where = "-" if trial.resumed_cursor is None else "epoch {} batch {} split {}".format(*trial.resumed_cursor[:3])
        verdict = "yes" if trial.exact else "NO: " + "; ".join(trial.differences[:3] or [trial.outcome])
        return f"{trial.fault.encode():<44} {trial.outcome:<28} {where:<26} {verdict}"

    def summary(self) -> str:
        exact = sum(trial.exact for trial in self.trials)
        return f"chaos: {len(self.trials)} trials, {exact} exact, {len(self.trials) - exact} failed"


def check_fault_tolerance(train: str | TrainFunction, fault_list: Sequence[Fault | str] | str | Fault, work_dir: str,
                          args: Sequence[str] = (), max_attempts: int = 20, timeout: float = 600.0,
                          on_trial: Callable[[Trial], None] | None = None) -> FaultReport:
    """Run ``train`` once without faults (the reference), then once per fault: with the fault
    armed, then again without it until it finishes; compare each final state with the
    reference (:func:`compare_runs`). ``fault_list``: :class:`Fault` objects and/or specs
    (``"point:hit:kind"``, comma-separated for several), or one of them alone.

    ``on_trial`` is called with each :class:`Trial` as soon as it is finished (to report
    progress: a full matrix takes a long time); the returned report holds them all."""
    if isinstance(fault_list, (str, Fault)):  # one spec ("point:hit:kind[,...]") or one Fault
        fault_list = [fault_list]
    parsed = [f for item in fault_list for f in ([item] if isinstance(item, Fault) else faults.parse_faults(item))]
    if not parsed:
        raise ConfigError("check_fault_tolerance: no fault given")
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
        raise ConfigError(f"check_fault_tolerance: max_attempts must be a positive int, got {max_attempts!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ConfigError(f"check_fault_tolerance: timeout must be a positive number of seconds, got {timeout!r}")
    check_work_dir(work_dir)
    if callable(train) and any(fault.kind == "sigkill" for fault in parsed):
        raise ConfigError("faults of kind 'sigkill' need train given as 'module:function' (a subprocess)")

    last_stderr = [""]  # of the last subprocess: explains a reference run that failed

    def attempt(run_dir: str, fault: Fault | None) -> tuple[str, dict[str, Any] | None]:
        if isinstance(train, str):
            outcome, result, last_stderr[0] = _subprocess_attempt(train, run_dir, fault, args, timeout)
            return outcome, result
        return _in_process_attempt(train, run_dir, fault, args, timeout)

    reference = os.path.join(work_dir, "reference")
    outcome, _ = attempt(reference, None)
    if outcome != "completed":
        raise EngineError(f"the reference run did not complete: {outcome}"
                          + (f"; the end of its stderr:\n{last_stderr[0]}" if last_stderr[0] else ""))
    trials = []
    for index, fault in enumerate(parsed):
        run_dir = os.path.join(work_dir, f"trial-{index:03d}")
        outcome, first = attempt(run_dir, fault)
        resumed: dict[str, Any] | None = None
        attempts = 1
        last = outcome
        while last != "completed" and attempts < max_attempts:
            last, result = attempt(run_dir, None)
            resumed = resumed or result
            attempts += 1
        if outcome == "completed":
            outcome = "tolerated" if _fired(first) else "never fired"
        differences = compare_runs(reference, run_dir) if last == "completed" else [f"did not finish: {last}"]
        resumed_from, cursor = _resume_point(resumed)
        trials.append(Trial(fault, outcome, resumed_from, cursor, attempts, differences))
        if on_trial is not None:
            on_trial(trials[-1])
    return FaultReport(reference, trials)


def check_work_dir(work_dir: str, field: str = "check_fault_tolerance: work_dir") -> None:
    """Refuse a ``work_dir`` that is a file or not empty (runs in it would resume old ones)."""
    if os.path.exists(work_dir) and not os.path.isdir(work_dir):
        raise ConfigError(f"{field} {work_dir!r} is a file; pass a new or empty directory")
    if os.path.isdir(work_dir) and os.listdir(work_dir):
        raise ConfigError(f"{field} {work_dir!r} is not empty (runs in it would resume "
                          "old ones); pass a new or empty directory")


def _fired(result: dict[str, Any] | None) -> bool:
    return bool(result and result.get("fired"))


def _resume_point(result: dict[str, Any] | None) -> tuple[str | None, tuple[int, int, int, int] | None]:
    if result is None:
        return None, None
    cursor = result.get("resumed_cursor")
    return result.get("resumed_from"), None if cursor is None else tuple(cursor)


def _in_process_attempt(train: TrainFunction, run_dir: str, fault: Fault | None, args: Sequence[str],
                        timeout: float) -> tuple[str, dict[str, Any] | None]:
    faults.inject([fault] if fault else [])
    saved = os.environ.pop(faults.ENVIRONMENT_VARIABLE, None)
    try:
        result = train(run_dir, *args)
        outcome = "preempted" if getattr(result, "preempted", False) else "completed"
        cursor = getattr(result, "resumed_cursor", None)
        return outcome, {"fired": [f.encode() for f in faults.fired()],
                         "resumed_from": getattr(result, "resumed_from", None),
                         "resumed_cursor": None if cursor is None else list(cursor.as_tuple())}
    except SystemExit as exit_info:
        return f"exit {exit_info.code}", None
    except (EngineError, OSError) as error:
        return f"raised {type(error).__name__}", None
    finally:
        faults.clear()
        if saved is not None:
            os.environ[faults.ENVIRONMENT_VARIABLE] = saved


def _subprocess_attempt(train: str, run_dir: str, fault: Fault | None, args: Sequence[str],
                        timeout: float) -> tuple[str, dict[str, Any] | None, str]:
    """Returns the outcome, the result line the run printed (None if none) and the end of its
    stderr."""
    env = dict(os.environ)
    env.pop(faults.ENVIRONMENT_VARIABLE, None)
    if fault is not None:
        env[faults.ENVIRONMENT_VARIABLE] = fault.encode()
    process = subprocess.run([sys.executable, "-m", "engine.testing", train, run_dir, *args],
                             env=env, capture_output=True, text=True, timeout=timeout)
    result = None
    for line in process.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])
    stderr = process.stderr[-3000:]
    if process.returncode == 0:
        return "completed", result, stderr
    if process.returncode < 0:
        return f"killed by signal {-process.returncode}", result, stderr
    return f"exit {process.returncode}", result, stderr


def compare_runs(reference_dir: str, other_dir: str) -> list[str]:
    """Differences between the final states of two runs (empty when bit-identical): model,
    optimizers, schedulers, loop states, RNG, callbacks, progress counters, metrics.jsonl."""
    loaded = []
    for run_dir in (reference_dir, other_dir):
        latest = CheckpointStore(Storage(run_dir, create=False), create=False).latest()
        if latest is None:
            return [f"{run_dir} holds no valid checkpoint"]
        loaded.append(latest)
    differences: list[str] = []
    for key in COMPARED_KEYS:
        _compare(loaded[0].state[key], loaded[1].state[key], key, differences)
    if loaded[0].progress.to_dict() != loaded[1].progress.to_dict():
        differences.append("progress counters differ")
    if _read_metrics(reference_dir) != _read_metrics(other_dir):
        differences.append(f"{METRICS_FILE} differs")
    return differences


def _read_metrics(run_dir: str) -> bytes:
    fs, root = fsspec.core.url_to_fs(run_dir)
    path = f"{root.rstrip('/')}/{METRICS_FILE}"
    return fs.cat_file(path) if fs.exists(path) else b""


def _compare(a: Any, b: Any, path: str, differences: list[str]) -> None:
    if len(differences) >= 20:
        return
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b)):
            differences.append(f"{path} differs")
    elif isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            differences.append(f"{path}: keys differ")
            return
        for key in a:
            _compare(a[key], b[key], f"{path}.{key}", differences)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            differences.append(f"{path}: lengths or types differ")
            return
        for index, (x, y) in enumerate(zip(a, b)):
            _compare(x, y, f"{path}[{index}]", differences)
    elif a != b:
        differences.append(f"{path}: {a!r} != {b!r}")


def _load_function(spec: str) -> TrainFunction:
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise ConfigError(f"train function {spec!r}: expected 'module:function'")
    return getattr(importlib.import_module(module_name), function_name)


def main(argv: Sequence[str]) -> int:
    """Subprocess entry: ``python -m engine.testing MODULE:FUNCTION RUN_DIR [ARGS...]``."""
    if len(argv) < 2:
        print("usage: python -m engine.testing MODULE:FUNCTION RUN_DIR [ARGS...]", file=sys.stderr)
        return 2
    result = _load_function(argv[0])(argv[1], *argv[2:])
    if isinstance(result, FitResult):
        cursor = None if result.resumed_cursor is None else list(result.resumed_cursor.as_tuple())
        print(RESULT_PREFIX + json.dumps({"resumed_from": result.resumed_from, "resumed_cursor": cursor,
                                          "fired": [f.encode() for f in faults.fired()]}), flush=True)
        if result.preempted:
            return 75
    return 0

