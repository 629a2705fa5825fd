"""``python -m engine launch [--marker PATH] [--exit-code N] [--grace SECONDS] [--requeue [--signal NAME]] -- torchrun ...``.

The launcher owns the preemption protocol of a torchrun job, because torchrun cannot: it dies
of SIGUSR1, forwards a repeated SIGTERM into a broken shutdown, and exits 0 or 1 whatever its
workers returned. What the launcher does::

    start torchrun in a session of its own, with the preemption signals ignored
    (so neither a group-wide kill nor a stray SIGUSR1 ends it), and SIGKILLed by the kernel
    when the launcher dies (each worker in fit is asked to stop when its torchrun dies);
    on the first of SIGTERM / SIGINT / SIGUSR1 / SIGUSR2 (later ones change nothing):
        record which one came (the workers' stop reason names it);
        send each worker that registered (in fit, handlers installed) its preemption signal, once;
        keep waiting: the workers agree on a boundary, commit, exit 0; torchrun ends;
        past --grace seconds, SIGKILL whatever of the job is still running;
    when torchrun ends with workers left (it died): the same request, then the same wait;
    every second, read the workers' progress words (engine.watchdog.arrival): a rank that never
    arrived (--arrival-timeout after it started, while a rank of its try waits for it) is named
    and SIGKILLed, so that torchrun restarts the group; a worker's crash-loop verdict ends the
    whole job at once (torchrun would restart it);
    exit --exit-code (75) when rank 0 left this launch's marker (after ``scontrol requeue`` with
    --requeue, engine.distributed.requeue); 87 after a crash-loop verdict (never requeued); 86
    when torchrun failed after a hang (a worker's watchdog or a rank that never arrived;
    requeued with --requeue); else torchrun's status.

Workers left by a torchrun that died are re-parented to the launcher (a child subreaper), so
none escapes it. Linux only: the job's processes are followed in /proc. See docs/preemption.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

from engine.distributed import _prctl
from engine.distributed.preemption_marker import (LAUNCHER_LOCK, MARKER_VARIABLE, WORKERS_VARIABLE, record_launch_request,
                                                  registered_workers)
from engine.distributed.requeue import RequeuePolicy, requeue_after_hang, requeue_after_preemption
from engine.errors import ConfigError
from engine.faults.preemption import PreemptionWatcher
from engine.watchdog.arrival import ArrivalWatch
from engine.watchdog.board import BOARD_VARIABLE
from engine.watchdog.outcomes import read_outcomes
from engine.watchdog.phases import CRASH_LOOP_EXIT_CODE, HANG_EXIT_CODE

LAUNCHER_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
POLL_SECONDS = 0.1
DEFAULT_GRACE_SECONDS = 600.0
# A rank not arrived this long after it started, while another waits for it, never arrived: the
# watchdog's shortest timeout (engine.Watchdog.min_timeout_s), against torch's 30 minutes.
DEFAULT_ARRIVAL_TIMEOUT_SECONDS = 300.0
ARRIVAL_POLL_SECONDS = 1.0
# torchrun handles (and forwards, and dies in the shutdown of) only what it is told to; the
# preemption signals stay ignored in it, inherited from the launcher.
TORCHRUN_SIGNALS_VARIABLE = "PET_SIGNALS_TO_HANDLE"
TORCHRUN_SIGNALS = "SIGHUP,SIGQUIT"


_LAUNCH_PREFIX = "splitloop-launch-"
_BOARD_PREFIX = "splitloop-watchdog-launch-"


def remove_what_dead_launchers_left(parent: str, prefix: str) -> None:
    """Remove the directories ``prefix<pid>-...`` in ``parent`` whose launcher (the pid in the
    name) is no longer alive: a launcher killed with SIGKILL cannot remove its own. A pid in use
    again keeps its directory (the safe side)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        pid = name[len(prefix):].split("-", 1)[0]
        if name.startswith(prefix) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


@dataclass(frozen=True)
class LaunchFiles:
    """The files of one launch: a private directory (workers register in it), the marker, and
    the board of the workers' progress words (in the node's shared memory where there is one)."""

    directory: str
    marker: str
    board: str

    @classmethod
    def create(cls, marker: str | None) -> "LaunchFiles":
        remove_what_dead_launchers_left(tempfile.gettempdir(), _LAUNCH_PREFIX)
        directory = tempfile.mkdtemp(prefix=f"{_LAUNCH_PREFIX}{os.getpid()}-")
        os.mkdir(os.path.join(directory, "workers"))
        shared = "/dev/shm" if os.path.isdir("/dev/shm") else None
        if shared is not None:
            remove_what_dead_launchers_left(shared, _BOARD_PREFIX)
        board = tempfile.mkdtemp(prefix=f"{_BOARD_PREFIX}{os.getpid()}-", dir=shared or directory)
        files = cls(directory, marker if marker is not None else os.path.join(directory, "preempted.json"), board)
        files.remove_marker()  # a marker of an earlier launch must not turn this one into a preemption
        return files

    @property
    def workers(self) -> str:
        return os.path.join(self.directory, "workers")

    def remove_marker(self) -> None:
        try:
            os.remove(self.marker)
        except FileNotFoundError:
            pass

    def remove(self) -> None:
        self.remove_marker()
        shutil.rmtree(self.board, ignore_errors=True)
        shutil.rmtree(self.directory, ignore_errors=True)


def launch(command: Sequence[str], marker: str | None = None, exit_code: int = 75,
           grace_seconds: float = DEFAULT_GRACE_SECONDS, requeue: RequeuePolicy | None = None,
           arrival_timeout: float = DEFAULT_ARRIVAL_TIMEOUT_SECONDS) -> int:
    """Run ``command`` (torchrun ...) under the launcher's preemption protocol and watch its
    workers' arrival (module docstring).

    Returns ``exit_code`` when the run committed a preemption checkpoint, CRASH_LOOP_EXIT_CODE
    (87) after a worker's crash-loop verdict, HANG_EXIT_CODE (86) when the command failed after
    a hang, else the command's exit status (128 + N for a death by signal N). With ``requeue``,
    a committed preemption or a hang also puts the SLURM job back in the queue
    (engine.distributed.requeue).
    """
    if not command:
        raise ConfigError("launch: no command given; usage: python -m engine launch -- torchrun ... train.py")
    if grace_seconds <= 0:
        raise ConfigError(f"launch: --grace must be a positive number of seconds, got {grace_seconds}")
    if not arrival_timeout > 0:
        raise ConfigError(f"launch: --arrival-timeout must be a positive number of seconds, got {arrival_timeout}")
    if not sys.platform.startswith("linux"):
        raise ConfigError(f"launch: needs Linux (it follows the job's processes in /proc), this is {sys.platform}; "
                          "run torchrun directly here")
    files = LaunchFiles.create(marker)
    try:
        with PreemptionWatcher(LAUNCHER_SIGNALS) as watcher, _subreaper(), _alive(files):
            earlier_children = set(_children(os.getpid(), process_table()))
            job = Job(_start(command, files), command[0], earlier_children, ArrivalWatch(arrival_timeout))
            status = job.supervise(watcher, files, grace_seconds)
        return _outcome(status, watcher, files, exit_code, requeue, job)
    finally:
        files.remove()


def _start(command: Sequence[str], files: LaunchFiles) -> subprocess.Popen[bytes]:
    environment = {**os.environ, MARKER_VARIABLE: files.marker, WORKERS_VARIABLE: files.workers,
                   BOARD_VARIABLE: files.board}
    environment.setdefault(TORCHRUN_SIGNALS_VARIABLE, TORCHRUN_SIGNALS)
    _prctl.load()
    launcher = os.getpid()
    try:
        return subprocess.Popen(list(command), env=environment, start_new_session=True,
                                preexec_fn=lambda: _prepare_child(launcher))
    except OSError as error:
        raise ConfigError(f"launch: cannot start {command[0]!r}: {error}") from error


def _prepare_child(launcher: int) -> None:
    # Runs in the child before exec. An ignored signal stays ignored across exec, a handler
    # does not: the engine's fit installs its own handlers in each worker. The parent-death
    # signal survives exec too: a SIGKILLed launcher takes torchrun with it (torch starts the
    # workers in sessions of their own and never stops them when it dies; each worker in fit
    # asks for its preemption signal on torchrun's death, engine.distributed.preemption_marker).
    for number in LAUNCHER_SIGNALS:
        signal.signal(number, signal.SIG_IGN)
    _prctl.set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != launcher:  # the launcher died before the line above
        os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def _subreaper() -> Iterator[None]:
    """Orphaned descendants (workers of a torchrun that died) become the launcher's children
    while the job runs."""
    _prctl.set_child_subreaper(True)
    try:
        yield
    finally:
        _prctl.set_child_subreaper(False)


@contextlib.contextmanager
def _alive(files: LaunchFiles) -> Iterator[None]:
    """Hold the launch's lock while the job runs: a worker entering fit that can take it knows
    that no launcher supervises it any more (the kernel releases it when the launcher dies,
    SIGKILL included; no pid is trusted)."""
    descriptor = os.open(os.path.join(files.workers, LAUNCHER_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)


class Job:
    """The command and every process it started, re-parented orphans included."""

    def __init__(self, process: subprocess.Popen[bytes], name: str, earlier_children: set[int],
                 arrivals: ArrivalWatch) -> None:
        self.process, self.name = process, name
        self.earlier_children = earlier_children  # the caller's own children: not ours to reap
        self.status: int | None = None
        self.arrivals = arrivals
        self.hangs: list[str] = []  # what the launcher said of the ranks that never arrived
        self.crash_loop: str | None = None  # a worker's crash-loop verdict line
        self._next_look = 0.0

    def supervise(self, watcher: PreemptionWatcher, files: LaunchFiles, grace_seconds: float) -> int:
        """Wait until the command and every process of the job have ended; the command's status."""
        requested: set[int] = set()
        deadline: float | None = None
        while True:
            table = process_table()
            reaped = self._reap(table)  # read before it: a process that ended since is still listed running
            running = {pid for pid in self.members(table) - reaped if table[pid][1] not in ZOMBIE_STATES}
            if self.status is not None and not running:
                return self.status
            if self.status is not None and watcher.received is None:
                watcher.received = signal.SIGTERM  # the command died and left workers: stop them too
                print(f"splitloop launch: {self.name} ended with {len(running)} process(es) left; "
                      "stopping them", file=sys.stderr, flush=True)
            self._watch(running, table, files, arrivals=watcher.received is None)  # a stopping job is left to stop
            if watcher.received is not None:
                if deadline is None:
                    deadline = time.monotonic() + grace_seconds
                    record_launch_request(files.workers, watcher.received)
                _request_stop(registered_workers(files.workers), running, requested)
                if time.monotonic() > deadline:
                    _send(running, signal.SIGKILL)
            time.sleep(POLL_SECONDS)

    def _watch(self, running: set[int], table: dict[int, tuple[int, str]], files: LaunchFiles, arrivals: bool) -> None:
        """Once a second: end the attempt of a rank that never arrived; end the job at a crash loop."""
        now = time.monotonic()
        if now < self._next_look:
            return
        self._next_look = now + ARRIVAL_POLL_SECONDS
        if self.crash_loop is None:
            self.crash_loop = crash_loop_verdict(files)
            if self.crash_loop is not None:
                _say(f"a worker stopped a crash loop; ending the job ({len(running)} process(es)) so that torchrun "
                     "does not restart it")
        if self.crash_loop is not None:
            _send(running, signal.SIGKILL)
            return
        if not arrivals:
            return
        for late in self.arrivals.look(running, {pid: table[pid][0] for pid in running}, now):
            line = late.line(socket.gethostname())
            self.hangs.append(line)
            _say(f"{line}; ending this attempt (SIGKILL of rank {late.worker.rank}) so that torchrun restarts the group")
            _send({late.worker.pid} | (descendants(late.worker.pid, table) & running), signal.SIGKILL)

    def members(self, table: dict[int, tuple[int, str]]) -> set[int]:
        roots = [pid for pid in _children(os.getpid(), table) if pid not in self.earlier_children]
        return set(roots) | {pid for root in roots for pid in descendants(root, table)}

    def _reap(self, table: dict[int, tuple[int, str]]) -> set[int]:
        """Reap the job's children that have ended; their pids."""
        reaped = set()
        for pid in _children(os.getpid(), table):
            if pid in self.earlier_children:
                continue
            try:
                ended, wait_status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue
            if ended == 0:
                continue
            reaped.add(ended)
            if ended == self.process.pid:
                self.process.returncode = self.status = os.waitstatus_to_exitcode(wait_status)
        return reaped


def _request_stop(workers: dict[int, int], running: set[int], requested: set[int]) -> None:
    """One preemption request (the signal it registered) per running worker of the job; the
    engine agrees the stop across the ranks."""
    for pid, number in workers.items():
        if pid in running and pid not in requested:
            _send({pid}, number)
            requested.add(pid)


def _send(pids: set[int], number: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            pass


ZOMBIE_STATES = ("Z", "X")


def process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) of every process, read from /proc."""
    table: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as handle:
                fields = handle.read().rpartition(")")[2].split()
        except OSError:
            continue  # it ended meanwhile
        if len(fields) >= 2:
            table[int(entry)] = (int(fields[1]), fields[0])
    return table


def _children(parent: int, table: dict[int, tuple[int, str]]) -> list[int]:
    return [pid for pid, (ppid, _) in table.items() if ppid == parent]


def descendants(root: int, table: dict[int, tuple[int, str]] | None = None) -> set[int]:
    """Every descendant of process ``root`` (zombies included)."""
    table = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found: set[int] = set()
    pending = [root]
    while pending:
        for child in children.get(pending.pop(), []):
            if child not in found:
                found.add(child)
                pending.append(child)
    return found


def _outcome(status: int, watcher: PreemptionWatcher, files: LaunchFiles, exit_code: int,
             requeue: RequeuePolicy | None, job: Job) -> int:
    if os.path.exists(files.marker):
        with open(files.marker, encoding="utf-8") as handle:
            record = json.load(handle)
        if requeue is not None:
            requeue_after_preemption(requeue, watcher.received, record.get("reason"))
        print(f"splitloop launch: the run was preempted ({record.get('reason')}); checkpoint "
              f"{record.get('checkpoint')} committed; exiting with {exit_code}", file=sys.stderr, flush=True)
        return exit_code
    status = status if status >= 0 else 128 - status
    job.crash_loop = job.crash_loop or crash_loop_verdict(files)  # the job may have ended before a look
    if job.crash_loop is not None:
        _say(f"{job.crash_loop.removeprefix('splitloop: ')}; exiting with {CRASH_LOOP_EXIT_CODE}: do not requeue, a "
             "restart would fail the same way")
        return CRASH_LOOP_EXIT_CODE
    hangs = job.hangs + [str(row.get("line")) for row in read_outcomes(files.board) if row["exit_code"] == HANG_EXIT_CODE]
    if status != 0 and hangs:
        _say(f"{command_name(job)} failed after {len(hangs)} hang report(s), the first: {hangs[0]}; exiting with "
             f"{HANG_EXIT_CODE} so that the job is started again from its newest checkpoint")
        if requeue is not None:
            requeue_after_hang()
        return HANG_EXIT_CODE
    if watcher.received is not None:
        print(f"splitloop launch: {watcher.reason}, but the run committed no preemption checkpoint (it ended "
              f"before fit, or after its last boundary); exiting with the command's status {status}",
              file=sys.stderr, flush=True)
    return status


def crash_loop_verdict(files: LaunchFiles) -> str | None:
    """The line of the first crash-loop verdict a worker left, if any."""
    verdicts = [row for row in read_outcomes(files.board) if row["exit_code"] == CRASH_LOOP_EXIT_CODE]
    return str(verdicts[0].get("line", "crash loop")) if verdicts else None


def command_name(job: Job) -> str:
    return os.path.basename(job.name)


def _say(text: str) -> None:
    print(f"splitloop launch: {text}", file=sys.stderr, flush=True)
