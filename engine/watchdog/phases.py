"""The phases a rank reports in its progress word, and the exit codes of a hang and a crash loop.

A phase is where the rank is: the monitor times each phase on its own (a checkpoint takes longer
than a forward pass) and, in a collective, blames the rank that has not arrived rather than the
ranks waiting for it (engine.watchdog.verdict).
"""

from __future__ import annotations

# Exit status of every rank of a job the watchdog ended on a hang: restart me (torchrun's
# --max-restarts, a scheduler's requeue). Beside the preemption code 75 (EX_TEMPFAIL).
HANG_EXIT_CODE = 86
# Exit status of a job that failed the same way again (engine.watchdog.crash_loop): do not
# requeue, a restart would fail again.
CRASH_LOOP_EXIT_CODE = 87

STARTING = "starting"  # joining the process group, restoring a checkpoint, starting the writer
DATA = "data"  # drawing the next batch
STEP = "step"  # the user's training step (forward; with manual optimization, everything it does)
BACKWARD = "backward"  # backward of the step's loss (DDP all-reduces the gradients inside it)
OPTIMIZER = "optimizer"  # the optimizer step
COLLECTIVE = "collective"  # an engine collective: every rank must arrive
BOUNDARY = "boundary"  # the split boundary's own work: metrics, callbacks, stop checks
CHECKPOINT = "checkpoint"  # a snapshot and its hand-over to the writer
WRITER = "waiting for the writer"  # blocked until the checkpoint writer frees a slot or commits
VALIDATION = "validation"  # a validation pass
FINISHING = "finishing"  # the last commit and the writer's close at the end of fit

# Details of the start where a rank waits for the others: it has arrived (engine.watchdog.arrival).
# The phase stays "starting", with its first allowance: a wait to join may last as long as the
# slowest rank's start.
JOINING = "joining the process group"
START_BARRIER = "waiting for every rank to start"
ARRIVED_AT_START: frozenset[str] = frozenset({JOINING, START_BARRIER})

# Codes in the shared word; the order is fixed (a word is read by other processes).
PHASES: tuple[str, ...] = (STARTING, DATA, STEP, BACKWARD, OPTIMIZER, COLLECTIVE, BOUNDARY, CHECKPOINT, WRITER, VALIDATION,
                           FINISHING)
CODE_OF: dict[str, int] = {name: code for code, name in enumerate(PHASES)}

# Phases that keep the first allowance until their own durations are learned, however many splits
# ran: a restore, a whole validation pass, the last commit, the first waits for a checkpoint
# writer (a writer process starting after a restart; a first write to a cold object store).
FIRST_ALLOWANCE: frozenset[str] = frozenset({STARTING, VALIDATION, FINISHING, WRITER})

# Phases where a rank waits for others (not its own work): left out of its busy time per split.
WAITS: frozenset[str] = frozenset({COLLECTIVE, BACKWARD, WRITER})
