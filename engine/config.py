"""Trainer configuration: dataclasses validated on construction.

Every error names the field, the value received and what was expected.
"""

from __future__ import annotations

import dataclasses
import math
import re
import signal
from typing import Literal, Sequence

from engine.checkpoint.plan import CheckpointPlan
from engine.errors import ConfigError, warn
from engine.field_checks import bool_field, one_of, positive_int_or_none, positive_number_or_none
from engine.loggers.base import Logger
from engine.unknown_keywords import LIGHTNING_CHECKPOINT, LIGHTNING_TRAINER, from_lightning, refuse_unknown_fields
from engine.watchdog.settings import Watchdog

Precision = Literal["32", "bf16-mixed", "16-mixed"]
PRECISIONS = ("32", "bf16-mixed", "16-mixed")
_DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d{1,3})?")

# Seconds every rank of a torchrun group has to arrive (TrainerConfig.start_timeout).
DEFAULT_START_TIMEOUT = 180.0

AccumulateOver = Literal["batches", "splits"]
ClipAlgorithm = Literal["norm", "value"]


@dataclasses.dataclass(frozen=True)
class Rollback:
    """Roll back past a numerical anomaly (docs/faults.md): never step the optimizer with bad
    gradients, restore an earlier checkpoint in the same process, skip the batches that caused
    it, and replay exactly.

    Args:
        factor: also an anomaly: a split loss above ``factor`` times the median of the last
            ``window`` split losses (a spike). None: only non-finite losses and gradients.
        window: how many recent split losses the median of ``factor`` looks at.
        back: go back to the newest checkpoint at least ``back`` optimizer steps before the
            anomalous split (0: the newest checkpoint before it).
        skip_batches: how many batches to skip, from the anomalous one on (within its epoch).
        max_rollbacks: after this many rollbacks the next anomaly stops the run with
            ``engine.AnomalyError``.

    Example::

        engine.TrainerConfig(run_dir="runs/lm", anomaly=engine.Rollback(factor=10.0, window=50))
    """

    factor: float | None = None
    window: int = 20
    back: int = 0
    skip_batches: int = 1
    max_rollbacks: int = 3

    def __post_init__(self) -> None:
        owner = "Rollback"
        if self.factor is not None:
            positive_number_or_none(owner, "factor", self.factor)
            if self.factor <= 1:
                raise ConfigError(f"{owner}.factor: expected a number above 1 (times the median loss) or None, "
                                  f"got {self.factor!r}")
        positive_int_or_none(owner, "window", self.window)
        positive_int_or_none(owner, "skip_batches", self.skip_batches)
        positive_int_or_none(owner, "max_rollbacks", self.max_rollbacks)
        for name in ("window", "skip_batches", "max_rollbacks"):
            if getattr(self, name) is None:
                raise ConfigError(f"{owner}.{name}: expected a positive int, got None")
        if isinstance(self.back, bool) or not isinstance(self.back, int) or self.back < 0:
            raise ConfigError(f"{owner}.back: expected an int >= 0 (optimizer steps), got {self.back!r}")


@refuse_unknown_fields(from_lightning(LIGHTNING_CHECKPOINT))
@dataclasses.dataclass
class CheckpointConfig:
    """When and how checkpoints are written.

    Args:
        every_n_splits: checkpoint after every N completed splits (a batch counts as one split
            when TBPTT is off). 1 gives split-level fault tolerance. ``"auto"`` chooses N online
            to keep the whole cost of checkpoints within ``max_overhead`` (between 1 and 64
            splits; see engine/checkpoint/budget.py); the interval reached is reported in
            ``FitResult.checkpoint_interval`` and the progress log.
        max_overhead: with ``every_n_splits="auto"``, the fraction of training time that
            checkpoints may cost (0.05: 5%): the time they block the training thread plus the
            time their background writes slow down the splits that run meanwhile, measured
            against splits that overlap no write.
        mtbf_seconds: with ``every_n_splits="auto"``, the job's mean time between failures in
            seconds of training (kills, preemptions, hangs of the whole job), or None: no
            failure rate weighed. With it the interval also minimizes the expected waste,
            checkpoint cost plus the work a failure loses (Young/Daly: about
            ``sqrt(2 x cost x MTBF)`` of training), never shorter than ``max_overhead`` allows
            nor longer than 64 splits; see docs/performance.md. A number is a prior: once the
            run's goodput ledger has seen a failure, the rate it observed replaces it at the next
            start. ``"observed"``: the ledger's rate only (none until a failure is seen).
        every_n_steps: checkpoint when the optimizer-step count crosses a multiple of N.
        every_seconds: checkpoint at the first split boundary T seconds after the last one.
        at_epoch_end: checkpoint after each epoch's end-of-epoch work (an epoch end that
            produced a new ``monitor`` value is checkpointed whatever this says).
        keep_last: how many valid checkpoints to keep (older ones are deleted only after a
            newer one is committed). None keeps all.
        writer: who writes checkpoints. ``"sync"`` (the default): the training thread encodes,
            writes, fsyncs and commits each one before training goes on. ``"thread"``: the
            training thread only takes a snapshot (a bulk copy of the state's tensors); a
            background thread of the training process encodes and writes it. ``"process"``: the
            snapshot is copied into shared memory and a writer process the engine starts encodes
            nothing, writes, fsyncs and commits under the lease, and still commits the last
            snapshot it received when the training process is killed (a local run dir, one
            process; docs/guarantees.md, "A writer process").
        asynchronous: deprecated: ``asynchronous=True`` is ``writer="thread"`` (a warning says so).
        max_in_flight: with ``writer="thread"`` or ``"process"``, how many snapshots may exist at
            once (being written or queued); each holds a reusable copy of the state's tensors.
            This field, ``when_behind``, ``mode``, ``keep_best`` and ``max_overhead`` are refused
            at a non-default value when what they apply to (a background writer, ``monitor``,
            ``every_n_splits="auto"``) is not set.
        when_behind: with a background writer and ``max_in_flight`` snapshots in flight: ``"wait"``
            blocks training until the writer frees one; ``"skip"`` never blocks: the newest
            snapshot replaces the oldest queued one, or, when every snapshot is being written,
            this checkpoint is skipped. A run's last checkpoint, a preemption checkpoint and one
            that records a ``monitor`` value always wait; a queued one of the latter is never
            replaced.
        monitor: a metric name (``val_loss``, or one logged with ``Module.log``) whose best
            checkpoints are kept besides the newest ones: the checkpoint of the boundary that
            produced a new value of it (always written) records that value in its manifest.
        mode: ``"min"`` (lower is better) or ``"max"``, for ``monitor``.
        keep_best: how many best checkpoints (by ``monitor``) retention never deletes; they do
            not count towards ``keep_last``.
        on_io_error: ``"raise"`` stops training with CheckpointWriteError when a write fails;
            ``"warn"`` warns and trains on (earlier checkpoints stay intact either way). A writer
            that hangs past the watchdog's timeout: with ``"raise"`` a hang exit (86, restart);
            with ``"warn"``, in a process alone with a thread or process writer, that checkpoint
            is abandoned and the writer replaced (docs/faults.md, "A hung writer").
        lease_expiry_seconds: on filesystems without file locks (object stores), how long a
            writer lease must stay unchanged, timed by the process that wants it, before that
            process may take it over (the holder's heartbeat rewrites it every third of that).
            Local disks use a lock that dies with its process and ignore this.
        local_tier: a node-local directory (under ``/dev/shm`` or on a local SSD) for a fast
            checkpoint tier: every checkpoint is committed there without fsync (it survives the
            death of the process, not of the node), and copied to the run dir (the durable tier)
            in the background every ``durable_every_n_splits`` splits and/or
            ``durable_every_seconds`` seconds, and always for the run's last checkpoint, a
            preemption checkpoint and one that records a ``monitor`` value. Resume takes the newest valid checkpoint of either tier. One
            directory per run, outside ``run_dir``: ``fit`` refuses one inside it or holding another
            run's checkpoints (the fast tier deletes checkpoints it did not write); see
            docs/checkpoint-format.md.
        durable_every_n_splits: with ``local_tier``, copy a checkpoint to the run dir when the
            count of completed splits crosses a multiple of N.
        durable_every_seconds: with ``local_tier``, copy a checkpoint to the run dir when T
            seconds passed since the last copy.
        peer_copies: under torchrun with ``local_tier`` (the memory tier: every rank commits
            its part of each checkpoint into node memory), ``1`` also keeps a verified copy of
            each rank's part on the same local rank of the next node, so that a lost node's
            parts come back from its peer at restart; ``0`` keeps none. See
            docs/distributed.md, "Memory-first checkpoints".
    """

    every_n_splits: int | Literal["auto"] | None = 1
    every_n_steps: int | None = None
    every_seconds: float | None = None
    at_epoch_end: bool = True
    keep_last: int | None = 2
    asynchronous: bool | None = None
    max_in_flight: int = 1
    when_behind: Literal["wait", "skip"] = "wait"
    on_io_error: Literal["raise", "warn"] = "raise"
    monitor: str | None = None
    mode: Literal["min", "max"] = "min"
    keep_best: int = 1
    # True only for the policy TrainerConfig creates by default, so that a policy the user
    # passed explicitly can be told apart (it needs a run_dir).
    _implied_by_default: bool = dataclasses.field(default=False, init=False, repr=False, compare=False)
    lease_expiry_seconds: float = 60.0
    local_tier: str | None = None
    durable_every_n_splits: int | None = None
    durable_every_seconds: float | None = None
    peer_copies: int = 0
    max_overhead: float = 0.05
    mtbf_seconds: float | Literal["observed"] | None = None
    # A key of engine.checkpoint.writers.choice.WRITER_KINDS (checked by CheckpointPlan).
    writer: str = "sync"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field and their combinations; ``Trainer.fit`` checks them again (building
        its run's :meth:`plan`), so that a field changed after construction is checked too.

        Raises:
            ConfigError: naming the field, the value and what was expected.
        """
        self.plan()

    def plan(self) -> CheckpointPlan:
        """This configuration checked and resolved (engine.checkpoint.plan holds the rules that
        tie fields together): ``Trainer.fit`` builds its run's plan once, with this.

        Raises:
            ConfigError: naming the field, the value and what was expected.
        """
        self._check_each_field()
        self._resolve_asynchronous()
        return CheckpointPlan.from_config(self)

    def _check_each_field(self) -> None:
        owner = "CheckpointConfig"
        if isinstance(self.every_n_splits, str) and self.every_n_splits != "auto":
            raise ConfigError(f"{owner}.every_n_splits: expected a positive int, 'auto' or None, got {self.every_n_splits!r}")
        if self.every_n_splits != "auto":
            positive_int_or_none(owner, "every_n_splits", self.every_n_splits)
        if isinstance(self.max_overhead, bool) or not isinstance(self.max_overhead, (int, float)) \
                or not 0 < self.max_overhead < 1:
            raise ConfigError(f"{owner}.max_overhead: expected a fraction of training time between 0 and 1 "
                              f"(0.05 for 5%), got {self.max_overhead!r}")
        if self.mtbf_seconds != "observed":
            positive_number_or_none(owner, "mtbf_seconds", self.mtbf_seconds)
        positive_int_or_none(owner, "every_n_steps", self.every_n_steps)
        positive_number_or_none(owner, "every_seconds", self.every_seconds)
        bool_field(owner, "at_epoch_end", self.at_epoch_end)
        positive_int_or_none(owner, "keep_last", self.keep_last)
        positive_int_or_none(owner, "max_in_flight", self.max_in_flight)
        if self.max_in_flight is None:
            raise ConfigError(f"{owner}.max_in_flight: expected a positive int, got None")
        one_of(owner, "when_behind", self.when_behind, ["wait", "skip"])
        one_of(owner, "on_io_error", self.on_io_error, ["raise", "warn"])
        if self.monitor is not None and (not isinstance(self.monitor, str) or not self.monitor):
            raise ConfigError(f"{owner}.monitor: expected a metric name or None, got {self.monitor!r}")
        one_of(owner, "mode", self.mode, ["min", "max"])
        if isinstance(self.keep_best, bool) or not isinstance(self.keep_best, int) or self.keep_best < 0:
            raise ConfigError(f"{owner}.keep_best: expected an int >= 0, got {self.keep_best!r}")
        positive_number_or_none(owner, "lease_expiry_seconds", self.lease_expiry_seconds)
        if self.lease_expiry_seconds is None:
            raise ConfigError(f"{owner}.lease_expiry_seconds: expected a positive number of seconds, got None")
        positive_int_or_none(owner, "durable_every_n_splits", self.durable_every_n_splits)
        positive_number_or_none(owner, "durable_every_seconds", self.durable_every_seconds)
        if self.local_tier is not None and (not isinstance(self.local_tier, str) or not self.local_tier
                                            or "://" in self.local_tier or "::" in self.local_tier):
            raise ConfigError(f"{owner}.local_tier: expected a local directory path such as '/dev/shm/my-run', "
                              f"got {self.local_tier!r}")
        if type(self.peer_copies) is not int or self.peer_copies not in (0, 1):
            raise ConfigError(f"{owner}.peer_copies: expected 0 or 1 (copies of each rank's memory part on "
                              f"other nodes), got {self.peer_copies!r}")
        if not isinstance(self.writer, str):
            raise ConfigError(f"{owner}.writer: expected a writer's name such as 'thread', got {self.writer!r}")

    def _resolve_asynchronous(self) -> None:
        """The deprecated ``asynchronous`` spelling, turned into ``writer`` once, with a warning:
        ``asynchronous=True`` is a background writer (``"thread"`` unless ``writer`` names
        another), ``asynchronous=False`` the synchronous one (``writer="thread"``, the old
        default, included)."""
        owner = "CheckpointConfig"
        if self.asynchronous is None:
            return
        bool_field(owner, "asynchronous", self.asynchronous)
        if self.asynchronous and self.writer == "sync":
            self.writer = "thread"
        elif not self.asynchronous and self.writer == "thread":
            self.writer = "sync"
        elif not self.asynchronous and self.writer != "sync":
            raise ConfigError(f"{owner}.writer={self.writer!r} writes in the background, but asynchronous is False; "
                              "drop asynchronous (deprecated: writer alone says who writes)")
        self.asynchronous = None
        warn(f"{owner}(asynchronous=...) is deprecated: say writer={self.writer!r} alone "
             "(writer='sync', 'thread' or 'process')", FutureWarning)


def _default_checkpoint_policy() -> CheckpointConfig:
    policy = CheckpointConfig()
    policy._implied_by_default = True
    return policy


@refuse_unknown_fields(from_lightning(LIGHTNING_TRAINER))
@dataclasses.dataclass
class TrainerConfig:
    """What to run and where.

    Args:
        max_epochs: stop after this many epochs.
        max_steps: stop at the first split boundary where the optimizer-step count (all
            optimizers together; applied steps: a step the "16-mixed" gradient scaler skips is
            not counted) reaches this.
        max_time: stop at the first split boundary after this many seconds of training
            (summed over resumed runs).
        accumulate_grad: optimizer step every N units (see ``accumulate_over``); the loss is
            divided by N before backward. A window still open at epoch end is stepped then.
        accumulate_over: ``"batches"`` or ``"splits"`` (the same thing when TBPTT is off).
        gradient_clip_val: clip gradients before each step; None disables.
        gradient_clip_algorithm: ``"norm"`` (``clip_grad_norm_``) or ``"value"``.
        run_dir: where metrics.jsonl and checkpoints go; a path or any fsspec URL. None keeps
            nothing on disk (no checkpoints, no metrics file).
        checkpoint: checkpoint policy; None disables checkpoints. The default policy applies
            when ``run_dir`` is set; a policy given explicitly without ``run_dir`` is a
            ConfigError (it could write nothing).
        progress_bar: "auto" (a bar on a terminal, log lines otherwise), "bar", "log" or "off".
        log_every_seconds: interval of the plain log lines.
        preemption_signals: signals that request a graceful stop (finish the split, checkpoint, exit).
        preemption_exit_code: exit status of a preempted run (see docs/preemption.md).
        requeue_command: optional shell command run after the preemption checkpoint commits.
        exit_on_preemption: after a preemption checkpoint, end the process with
            ``preemption_exit_code`` (SystemExit); False makes ``fit`` return with
            ``FitResult.preempted`` set instead.
        save_on_exception: when an exception or Ctrl-C ends ``fit``, commit a checkpoint of
            the last completed split if no checkpoint holds it and its state can still be
            reconstructed exactly, then re-raise (docs/faults.md).
        anomaly: :class:`Rollback` to roll back past a non-finite or spiking loss; None
            trains on whatever the loss is.
        device: where the module and every batch go: ``"auto"`` (CUDA when available, else
            the CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``. Under torchrun (``LOCAL_RANK``
            set), ``"auto"`` and ``"cuda"`` mean ``cuda:LOCAL_RANK``. See docs/devices.md.
        precision: ``"32"`` (no autocast), ``"bf16-mixed"`` (autocast to bfloat16) or
            ``"16-mixed"`` (autocast to float16 with a gradient scaler).
        val_every_n_steps: with ``val_data``, validate whenever the optimizer-step count
            crosses a multiple of N (mid-epoch); None validates only at epoch ends.
        val_at_epoch_end: with ``val_data``, validate after each epoch.
        distributed_sampler: under torchrun, give each rank its shard of a map-style
            DataLoader through an inserted ``DistributedSampler`` (a loader that has one is
            kept); False leaves the data as given. See docs/distributed.md.
        elastic: let a run started on one process grow to several later: it orders a
            map-style DataLoader the way a torchrun job does (the engine's sampler with one
            replica: each step takes the samples a W-rank run of the same data takes) and its
            checkpoints record the global batch. Off, a single process keeps its loader's own
            order. Runs under torchrun always order their data so (``WORLD_SIZE=1`` included);
            ``distributed_sampler=False`` turns that off and cannot be combined with it.
            See docs/distributed.md.
        start_timeout: under torchrun, the seconds every rank has to arrive when the process
            group starts (the ranks meet, then join the group and the engine's writer group).
            When it runs out each rank raises ``engine.errors.GroupStartTimeout`` naming the
            ranks that did not arrive, and exits, so that torchrun restarts the group; torch's
            own bound is 30 minutes. See docs/distributed.md.
        loggers: ``engine.loggers`` objects (``TensorBoard``, ``CSV``, or a ``Logger`` subclass)
            that receive every row of metrics.jsonl on rank 0, kept in agreement with it across
            resumes. See docs/loggers.md.
        watchdog: :class:`Watchdog` (on by default) detects a hung rank, reports it and ends
            the process with a documented exit code so that it is restarted; None turns it off.
    """

    max_epochs: int | None = 1
    max_steps: int | None = None
    max_time: float | None = None
    accumulate_grad: int = 1
    accumulate_over: AccumulateOver = "splits"
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: ClipAlgorithm = "norm"
    run_dir: str | None = None
    checkpoint: CheckpointConfig | None = dataclasses.field(default_factory=_default_checkpoint_policy)
    progress_bar: Literal["auto", "bar", "log", "off"] = "auto"
    log_every_seconds: float = 10.0
    preemption_signals: tuple[int, ...] = (int(signal.SIGTERM), int(signal.SIGUSR1))
    preemption_exit_code: int = 75
    requeue_command: str | None = None
    exit_on_preemption: bool = True
    save_on_exception: bool = True
    anomaly: Rollback | None = None
    device: str = "auto"
    precision: Precision = "32"
    val_every_n_steps: int | None = None
    val_at_epoch_end: bool = True
    distributed_sampler: bool = True
    loggers: Sequence[Logger] = ()
    elastic: bool = False
    start_timeout: float = DEFAULT_START_TIMEOUT
    watchdog: Watchdog | None = dataclasses.field(default_factory=Watchdog)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (and the checkpoint policy's); ``Trainer.fit`` calls it again, so
        that a field changed after construction is checked too.

        Raises:
            ConfigError: naming the field, the value and what was expected.
        """
        owner = "TrainerConfig"
        if not isinstance(self.device, str) or not _DEVICE_PATTERN.fullmatch(self.device):
            raise ConfigError(f"{owner}.device: expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        one_of(owner, "precision", self.precision, PRECISIONS)
        positive_int_or_none(owner, "max_epochs", self.max_epochs)
        positive_int_or_none(owner, "max_steps", self.max_steps)
        positive_number_or_none(owner, "max_time", self.max_time)
        if self.max_epochs is None and self.max_steps is None and self.max_time is None:
            raise ConfigError(
                f"{owner}: no stop condition (max_epochs, max_steps and max_time are all None); "
                "set at least one so the run can end"
            )
        positive_int_or_none(owner, "accumulate_grad", self.accumulate_grad)
        if self.accumulate_grad is None:
            raise ConfigError(f"{owner}.accumulate_grad: expected a positive int, got None")
        one_of(owner, "accumulate_over", self.accumulate_over, ["batches", "splits"])
        positive_number_or_none(owner, "gradient_clip_val", self.gradient_clip_val)
        one_of(owner, "gradient_clip_algorithm", self.gradient_clip_algorithm, ["norm", "value"])
        one_of(owner, "progress_bar", self.progress_bar, ["auto", "bar", "log", "off"])
        positive_int_or_none(owner, "val_every_n_steps", self.val_every_n_steps)
        bool_field(owner, "val_at_epoch_end", self.val_at_epoch_end)
        bool_field(owner, "distributed_sampler", self.distributed_sampler)
        bool_field(owner, "elastic", self.elastic)
        positive_number_or_none(owner, "start_timeout", self.start_timeout)
        if self.start_timeout is None:
            raise ConfigError(f"{owner}.start_timeout: expected a positive finite number of seconds, got None")
        if self.elastic and not self.distributed_sampler:
            raise ConfigError(f"{owner}.elastic: True needs the engine's sampler, which distributed_sampler=False "
                              "turns off; set one of them")
        bool_field(owner, "exit_on_preemption", self.exit_on_preemption)
        _loggers(owner, self.loggers)
        bool_field(owner, "save_on_exception", self.save_on_exception)
        if self.watchdog is not None and not isinstance(self.watchdog, Watchdog):
            raise ConfigError(f"{owner}.watchdog: expected engine.Watchdog(...) or None, got {self.watchdog!r}")
        if self.anomaly is not None and not isinstance(self.anomaly, Rollback):
            raise ConfigError(f"{owner}.anomaly: expected engine.Rollback(...) or None, got {self.anomaly!r}")
        if self.anomaly is not None and self.checkpoint is None:
            raise ConfigError(f"{owner}.anomaly: Rollback needs checkpoints to roll back to; set run_dir (and keep "
                              "a checkpoint policy)")
        positive_number_or_none(owner, "log_every_seconds", self.log_every_seconds)
        if self.log_every_seconds is None:
            raise ConfigError(f"{owner}.log_every_seconds: expected a positive number of seconds, got None")
        if self.run_dir is not None and (not isinstance(self.run_dir, str) or not self.run_dir.strip()):
            raise ConfigError(f"{owner}.run_dir: expected a non-empty path or URL string, got {self.run_dir!r}")
        if self.run_dir is not None and any(ord(character) < 32 or ord(character) == 127 for character in self.run_dir):
            raise ConfigError(f"{owner}.run_dir: {self.run_dir!r} contains a control character (a NUL, newline or tab?); "
                              "pass the directory path without it")
        if self.requeue_command is not None and (not isinstance(self.requeue_command, str) or not self.requeue_command.strip()):
            raise ConfigError(f"{owner}.requeue_command: expected a shell command string or None, got {self.requeue_command!r}")
        if self.checkpoint is not None and not isinstance(self.checkpoint, CheckpointConfig):
            raise ConfigError(f"{owner}.checkpoint: expected a CheckpointConfig or None, got {self.checkpoint!r}")
        if self.checkpoint is not None:
            self.checkpoint.validate()
        if self.checkpoint is not None and self.run_dir is None and not self.checkpoint._implied_by_default:
            raise ConfigError(
                f"{owner}.checkpoint: {self.checkpoint!r} was given but run_dir is None, so no checkpoint "
                "would be written; set run_dir to a directory path or fsspec URL (or leave checkpoint out)"
            )
        if isinstance(self.preemption_exit_code, bool) or not isinstance(self.preemption_exit_code, int) or not 0 <= self.preemption_exit_code <= 255:
            raise ConfigError(f"{owner}.preemption_exit_code: expected an int in 0..255, got {self.preemption_exit_code!r}")
        if not isinstance(self.preemption_signals, (tuple, list)):
            raise ConfigError(f"{owner}.preemption_signals: expected a tuple of signal numbers such as "
                              f"(signal.SIGTERM,) (or () for none), got {self.preemption_signals!r}")
        valid_signals = {int(s) for s in signal.valid_signals()}
        for number in self.preemption_signals:
            if isinstance(number, bool) or not isinstance(number, int):
                raise ConfigError(f"{owner}.preemption_signals: {number!r} is not a signal number; "
                                  "give signal.SIGTERM-style ints")
            if int(number) not in valid_signals or int(number) in (int(signal.SIGKILL), int(signal.SIGSTOP)):
                raise ConfigError(f"{owner}.preemption_signals: {number!r} is not a catchable signal")



def _loggers(owner: str, loggers: object) -> None:
    if not isinstance(loggers, (list, tuple)):
        raise ConfigError(f"{owner}.loggers: expected a list of engine.loggers objects (TensorBoard, CSV), got {loggers!r}")
    for logger in loggers:
        if not isinstance(logger, Logger):
            raise ConfigError(f"{owner}.loggers: {logger!r} is not an engine.loggers.Logger (use "
                              "engine.loggers.TensorBoard(dir), engine.loggers.CSV(path) or a Logger subclass)")
    if len({id(logger) for logger in loggers}) != len(loggers):
        raise ConfigError(f"{owner}.loggers: the same logger is given twice; give each once")
