"""A torchrun rank whose training process is forked from the tests' fork server::

    torchrun ... tests/distributed/rank_relay.py SERVER_SOCKET SCRIPT ARGS...

Each fresh rank of a torchrun job spends seconds importing torch (and torch._dynamo, which
the optimizers import). This relay imports no torch: it asks the fork server of the test that
started the job (tests/forkserver.py, ``SERVER_SOCKET``) to fork ``python SCRIPT ARGS`` with
the relay's environment (torchrun's RANK, WORLD_SIZE, MASTER_PORT, TORCHELASTIC_RESTART_COUNT,
...), working directory, stdout and stderr, then stands for it towards torchrun:

- a signal the relay receives (torchrun's SIGTERM to the rank's process group, a test's
  signal) is passed on to the training process;
- the relay ends as the training process ended: with its exit code, or killed by the same
  signal (a SIGKILL at a fault point, or a test's SIGKILL of the pid the rank wrote, is seen by
  torchrun as its rank killed by SIGKILL); the training process is reaped first.

If the relay itself is SIGKILLed, the fork server SIGKILLs the training process (its
connection closed). The training process is not a child of torchrun's: tests that look at the
job's process tree or signal its process group start their ranks fresh (torchrun_helpers'
``forked_ranks=False``, the default of ``torchrun_command``).
"""

from __future__ import annotations

import os
import signal
import sys

if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])  # tests/, where forkserver.py is; not tests/distributed

import forkserver

PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT)


def main(server_address: str, script: str, *args: str) -> None:
    forkserver.attach(server_address)
    # A signal that comes while the training process is being forked waits, then is passed on.
    signal.pthread_sigmask(signal.SIG_BLOCK, PASSED_ON)
    # In a session of its own, as torchrun starts each rank.
    child = forkserver.popen([sys.executable, script, *args], env=dict(os.environ), start_new_session=True)
    for number in PASSED_ON:
        signal.signal(number, lambda received, _frame: child.send_signal(received))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PASSED_ON)
    end_as(child.wait())


def end_as(returncode: int) -> None:
    """Exit with ``returncode``, or die of the signal ``-returncode`` as the training process did."""
    if returncode < 0:
        number = -returncode
        if number not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
        os._exit(128 + number)  # a signal whose default action is not to end the process
    os._exit(returncode)


if __name__ == "__main__":
    main(*sys.argv[1:])
