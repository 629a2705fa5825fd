"""Command line: ``python -m engine {demo,inspect,faults,chaos,plot,goodput,launch} ...``; ``--help`` on each."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Callable, Sequence

from engine.distributed.requeue import RequeuePolicy, parse_signal
from engine.errors import ConfigError, EngineError


def _int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an int in ``low..high``; anything else is a usage error (exit status 2)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range: expected {low}..{high}")
        return value
    parse.__name__ = "int"
    return parse


def _positive_seconds(text: str) -> float:
    """An argparse type: a positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of seconds: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive, finite number of seconds")
    return value


SEED = _int_in(0, 2**32 - 1)  # what torch, random and NumPy all accept
EXIT_STATUS = _int_in(0, 255)


def build_parser(prog: str = "splitloop") -> argparse.ArgumentParser:
    """The argument parser; ``prog`` is the command name its usage lines show (``splitloop``
    for the console script, ``python -m engine`` for the module)."""
    parser = argparse.ArgumentParser(prog=prog, description="splitloop: fault-tolerant training loops with split-level checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="train the demo character LSTM with TBPTT (resumes from --dir)",
                               description="Train a small character-level LSTM with TBPTT on text shipped with the package. "
                                           "Checkpoints every split into DIR; running it again resumes from DIR. "
                                           "The last line printed is 'fingerprint: <sha256 of final parameters and optimizer state>'.")
    demo.add_argument("--dir", required=True, help="run directory (path or fsspec URL) for checkpoints and metrics.jsonl")
    demo.add_argument("--epochs", type=int, default=10, help="number of epochs (default 10)")
    demo.add_argument("--seed", type=SEED, default=0,
                      help="random seed for initialization and dropout, 0..2**32-1 (default 0)")
    demo.add_argument("--checkpoint-every", type=int, default=1, metavar="N", help="checkpoint every N splits (default 1)")
    demo.add_argument("--async-checkpoints", action="store_true", help="write checkpoints in a background thread")
    demo.add_argument("--fresh", action="store_true", help="ignore checkpoints in --dir and start over")
    demo.add_argument("--progress", choices=["auto", "bar", "log", "off"], default="auto", help="progress display (default auto)")

    inspect = commands.add_parser("inspect", help="list the checkpoints of a run directory and verify each",
                                  description="List each checkpoint with its cursor and whether it verifies (and why not), "
                                              "name the latest valid one and print its fingerprint.")
    inspect.add_argument("dir", help="run directory (path or fsspec URL)")
    inspect.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    inspect.add_argument("--memory-tier", action="append", default=[], metavar="DIR",
                         help="a node's memory tier under torchrun (CheckpointConfig.local_tier there): list which "
                              "ranks' parts and peer copies it holds and whether each verifies (repeatable)")

    commands.add_parser("faults", help="list the fault-injection points and kinds",
                        description="List the named fault points and fault kinds of engine.faults.")

    chaos = commands.add_parser("chaos", help="run the demo under a matrix of faults and check each resume",
                                description="Train the demo once without faults (the reference), then once per fault "
                                            "(a fault point x kind with a random arrival count), resuming until it finishes; "
                                            "print a table (fault -> outcome, resumed at, exact?) and a summary line.")
    chaos.add_argument("--dir", required=True, help="work directory (one run directory per trial is made inside)")
    chaos.add_argument("--trials", type=int, default=None, help="number of faults (default: every point x kind pair once)")
    chaos.add_argument("--epochs", type=int, default=2, help="demo epochs per run (default 2)")
    chaos.add_argument("--seed", type=int, default=0, help="seed for the fault order and arrival counts (default 0)")
    chaos.add_argument("--hang-timeout", type=_positive_seconds, default=10.0, metavar="SECONDS",
                       help="the demo's watchdog: a phase stalled this long is a hang (twice as long before the "
                            "phase's durations are learned), so that a 'hang' trial ends in seconds (default 10)")

    plot = commands.add_parser("plot", help="draw training loss and validation metrics of a run as a PNG",
                               description="Training loss per split and validation metrics over optimizer steps, with a "
                                           "dashed line where the run resumed. Needs matplotlib: pip install 'splitloop[plot]'.")
    plot.add_argument("dir", help="run directory (path or fsspec URL)")
    plot.add_argument("--out", default=None, help="PNG file to write (default: metrics.png in a local run directory)")
    from engine.cli.goodput import add_goodput_parser
    add_goodput_parser(commands, _positive_seconds)
    launch = commands.add_parser("launch", help="run torchrun, own its preemption signals, exit 75 when preempted",
                                 description="Run COMMAND (torchrun ...) in a session of its own. The first SIGTERM, SIGINT, "
                                             "SIGUSR1 or SIGUSR2 (later ones change nothing) becomes one stop request to "
                                             "each worker in fit; the launcher waits for their commit and for every "
                                             "process of the job to end (SIGKILL after --grace seconds), then exits with "
                                             "--exit-code (default 75) when rank 0 committed a preemption checkpoint, "
                                             "else with the command's status; 86 when the command failed after a hang "
                                             "(a worker's watchdog, or a rank that never arrived: --arrival-timeout), "
                                             "87 after a crash-loop verdict (do not requeue). If the launcher is killed, torchrun dies with it and "
                                             "each worker commits and ends. See docs/preemption.md and docs/slurm.md.")
    launch.add_argument("--marker", default=None, help="marker file path (default: a file in this launch's own temp "
                                                       "directory; on several nodes give a path on a filesystem rank 0 shares)")
    launch.add_argument("--exit-code", type=EXIT_STATUS, default=75, help="exit status after a preemption, 0..255 (default 75)")
    launch.add_argument("--grace", type=_positive_seconds, default=600.0, metavar="SECONDS",
                        help="after a stop request, SIGKILL what of the job still runs after SECONDS (default 600)")
    launch.add_argument("--requeue", action="store_true",
                        help="after a committed preemption, run 'scontrol requeue $SLURM_JOB_ID' (when scontrol is on "
                             "PATH); the exit status stays --exit-code")
    launch.add_argument("--signal", action="append", default=[], metavar="NAME",
                        help="with --requeue: requeue only a preemption this signal requested (USR1 for SLURM's "
                             "--signal=B:USR1@120; repeat for several; default: any)")
    launch.add_argument("--arrival-timeout", type=_positive_seconds, default=300.0, metavar="SECONDS",
                        help="a worker that has not started training SECONDS after it started, while another rank of "
                             "its node waits for it, is named and killed so that torchrun restarts the group "
                             "(default 300; docs/faults.md, 'Hangs')")
    launch.add_argument("launched", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the command to run")
    return parser


# What to do after Ctrl-C, per command.
_AFTER_INTERRUPT = {
    "demo": "committed checkpoints are kept: run the same command again to resume",
    "chaos": "the trials in --dir are incomplete: start again with a new --dir",
}


def main(argv: Sequence[str] | None = None, prog: str = "splitloop") -> int:
    """Run one command; an engine error, an OS error or Ctrl-C prints one ``error: ...`` line
    on stderr (exit status 1, or 130 for Ctrl-C) instead of a traceback. When the reader of
    stdout goes away (``splitloop inspect DIR | head``) it stops quietly, as Unix tools do."""
    try:
        return _parse_and_run(build_parser(prog), argv)
    except BrokenPipeError:
        return _after_broken_pipe()


def _parse_and_run(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    try:
        args = parser.parse_args(argv)
    finally:
        sys.stdout.flush()  # --help's text: a closed pipe shows here, not at the interpreter's exit
    try:
        status = _run(args)
        sys.stdout.flush()
        return status
    except KeyboardInterrupt:
        print(f"error: interrupted (Ctrl-C); {_AFTER_INTERRUPT.get(args.command, 'nothing was changed')}",
              file=sys.stderr)
        return 130
    except BrokenPipeError:
        raise  # an OSError, but no error of the command: main ends quietly
    except (EngineError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


def _after_broken_pipe() -> int:
    """stdout's reader is gone: print nothing more, and point stdout at /dev/null so that the
    interpreter's last flush does not report the lines it could not write. The status is the
    shell's for a process ended by SIGPIPE (128 + 13), like ``yes | head``."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def _run(args: argparse.Namespace) -> int:
    if args.command == "launch":  # before the other commands' imports: the launcher needs no torch
        from engine.distributed.launch import launch
        command = args.launched[1:] if args.launched[:1] == ["--"] else args.launched
        return launch(command, args.marker, args.exit_code, args.grace, _requeue_policy(args), args.arrival_timeout)
    if args.command == "goodput":  # before the other commands' imports: the account and the model need no torch
        from engine.cli.goodput import run_goodput
        return run_goodput(args)
    from engine.cli.commands import run_chaos, run_demo, run_inspect, run_list_faults, run_plot
    if args.command == "demo":
        return run_demo(args)
    if args.command == "inspect":
        return run_inspect(args.dir, as_json=args.json, memory_tiers=args.memory_tier)
    if args.command == "faults":
        return run_list_faults()
    if args.command == "chaos":
        return run_chaos(args)
    if args.command == "plot":
        return run_plot(args.dir, args.out)
    return 2  # pragma: no cover - argparse rejects unknown commands


def _requeue_policy(args: argparse.Namespace) -> RequeuePolicy | None:
    """``--requeue [--signal NAME ...]`` as a RequeuePolicy (None without --requeue)."""
    if args.signal and not args.requeue:
        raise ConfigError("launch --signal names the signal whose preemption is requeued: it needs --requeue")
    if not args.requeue:
        return None
    return RequeuePolicy(frozenset(parse_signal(name) for name in args.signal))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(prog="python -m engine.cli.main"))
