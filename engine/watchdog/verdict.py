"""Who is hung: a pure function of the local ranks' words and the time.

A rank is *stalled* when its word has not moved for longer than the timeout it published for its
phase. Ranks wait for each other in collectives (the engine's, and DDP's all-reduce inside
backward), so the stalled rank to blame is the one *furthest behind* — fewest splits completed,
then earliest in the split's order of phases: it has not arrived where the others wait. A rank
waiting in a collective (its own, or its checkpoint writer thread's, which it waits for) is
blamed only when every rank on the node waits in one; else the culprit
is on another node, or the ranks disagree on the collective. A stalled rank whose process is
stopped (SIGSTOP, a debugger, a node that stopped publishing) is the culprit before any of
that, wherever its word says it is: it waits for nobody. A rank that finished its fit, or
whose process is gone (torchrun handles deaths), is never blamed; a rank that reported itself
hung is the culprit, whether or not its process has ended yet.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from engine.watchdog import phases
from engine.watchdog.word import FINISHED, REPORTED, WRITER_WAITS_FOR_PEERS, Word

# Where in a split each phase comes: a rank earlier in this order has not reached the others.
_ORDER: dict[str, int] = {phases.STARTING: 0, phases.DATA: 1, phases.STEP: 2, phases.BACKWARD: 3,
                          phases.OPTIMIZER: 4, phases.BOUNDARY: 5, phases.VALIDATION: 5, phases.COLLECTIVE: 6,
                          phases.CHECKPOINT: 7, phases.WRITER: 8, phases.FINISHING: 9}


@dataclasses.dataclass(frozen=True)
class Hang:
    """A hang seen on this node: ``culprit`` (None when every local rank waits in a collective
    for a rank elsewhere) and how long it has been stalled."""

    culprit: Word | None
    stalled_s: float
    waiting: tuple[Word, ...]

    def describe(self) -> str:
        if self.culprit is None:
            ranks = ", ".join(str(word.rank) for word in self.waiting)
            return (f"every rank on this node ({ranks}) has waited in a collective for {self.stalled_s:.1f} s: the rank "
                    "that has not arrived is on another node, or the ranks called different collectives")
        word = self.culprit
        detail = f" ({word.detail})" if word.detail else ""
        return (f"rank {word.rank} (pid {word.pid}) hung in phase {word.phase!r}{detail} for {self.stalled_s:.1f} s, "
                f"timeout {word.timeout_s:.1f} s; last split completed: {word.splits}")


def waiting_in_collectives(words: Sequence[Word]) -> list[Word]:
    """The ranks among ``words`` that wait in a collective: the fit's own (an engine
    collective), or their writer thread's, which their training thread waits for (a checkpoint's
    gather or announcement, a peer copy). A rank waiting for its writer is not counted when it
    is past where another rank waits in the fit's collective: it skipped that collective (the
    ranks called different ones), and the other rank waits for it."""
    in_fit = [word for word in words if word.phase == phases.COLLECTIVE]
    earliest = min((position(word) for word in in_fit), default=None)
    return [word for word in words if word.phase == phases.COLLECTIVE or (
        word.phase == phases.WRITER and bool(word.flags & WRITER_WAITS_FOR_PEERS)
        and (earliest is None or position(word) <= earliest))]


def position(word: Word) -> tuple[int, int]:
    """How far the rank is: (splits completed, place of its phase in a split)."""
    return word.splits, _ORDER.get(word.phase, 0)


def judge(local: Sequence[Word], now_ns: int, alive: Callable[[Word], bool],
          stopped: Callable[[Word], bool] = lambda word: False) -> Hang | None:
    """The hang among ``local`` words at ``now_ns``, if any (see the module docstring).
    ``alive(word)``: whether the word's process still runs; ``stopped(word)``: whether it is
    stopped by a signal (a stalled one is blamed before any other). Both take the word, not its
    pid: ranks on two nodes can share a pid (a container's processes are numbered alike)."""
    reported = [word for word in local if word.flags & REPORTED]
    if reported:  # a rank of the node reported itself hung (and ended, or is ending)
        return Hang(reported[0], reported[0].stalled_s(now_ns),
                    tuple(word for word in local if word is not reported[0]))
    watched = [word for word in local if not word.flags & FINISHED and alive(word)]
    stalled = [word for word in watched if word.stalled_s(now_ns) > word.timeout_s]
    if not stalled:
        return None
    frozen = [word for word in stalled if stopped(word)]
    if frozen:
        # A stopped process (SIGSTOP, a debugger, its node stopped whole) waits for nobody, whatever
        # its word says and however far it got: with a writer thread a rank can stop in its
        # checkpoint's phase while the others already wait in the next split's backward.
        culprit = min(frozen, key=lambda word: (position(word), word.started_ns))
        return Hang(culprit, culprit.stalled_s(now_ns), tuple(word for word in watched if word is not culprit))
    waiting = waiting_in_collectives(watched)
    arrived = [word for word in watched if word not in waiting]
    if not arrived:
        longest = max(word.stalled_s(now_ns) for word in stalled)
        return Hang(None, longest, tuple(watched))
    culprits = [word for word in stalled if word not in waiting]
    if not culprits:
        return None  # the collective waits for a rank that is slow but within its own timeout
    culprit = min(culprits, key=lambda word: (position(word), word.started_ns))
    behind = min(arrived, key=position)
    if position(behind) < position(culprit) and behind not in stalled:
        return None  # a rank further behind still moves: the stalled one may be waiting for it
    return Hang(culprit, culprit.stalled_s(now_ns), tuple(word for word in watched if word is not culprit))
