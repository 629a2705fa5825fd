"""Who is to blame, from the words alone (engine.watchdog.verdict): the stalled rank furthest
behind, never a rank waiting in a collective for it, nor a finished or dead rank."""

from __future__ import annotations

from engine.watchdog import phases
from engine.watchdog.verdict import judge
from engine.watchdog.word import FINISHED, REPORTED, WRITER_WAITS_FOR_PEERS, Word

SECOND = 1_000_000_000
NOW = 1000 * SECOND


def word(rank: int, phase: str, stalled_s: float, splits: int = 10, timeout_s: float = 5.0, flags: int = 0) -> Word:
    return Word(1, splits, NOW - int(stalled_s * SECOND), timeout_s, 0.0, 0.0, 0.0, 100 + rank, rank,
                phases.CODE_OF[phase], flags, "")


def everyone_alive(word: Word) -> bool:
    return True


def test_nothing_is_hung_within_the_timeouts() -> None:
    assert judge([word(0, phases.STEP, 4.9), word(1, phases.COLLECTIVE, 1.0)], NOW, everyone_alive) is None


def test_the_rank_that_has_not_arrived_is_blamed_not_the_one_waiting_in_the_collective() -> None:
    waiting, late = word(0, phases.COLLECTIVE, 9.0), word(1, phases.BOUNDARY, 8.0)
    hang = judge([waiting, late], NOW, everyone_alive)
    assert hang is not None and hang.culprit == late and hang.waiting == (waiting,)


def test_a_collective_waiting_for_a_slow_rank_within_its_timeout_is_no_hang() -> None:
    slow = word(1, phases.STEP, 30.0, timeout_s=60.0)
    assert judge([word(0, phases.COLLECTIVE, 29.0), slow], NOW, everyone_alive) is None


def test_among_stalled_ranks_the_one_furthest_behind_is_blamed() -> None:
    # DDP: rank 0 waits for the gradients' all-reduce inside backward while rank 1 is still in its step.
    in_backward, in_step = word(0, phases.BACKWARD, 7.0), word(1, phases.STEP, 6.0)
    hang = judge([in_backward, in_step], NOW, everyone_alive)
    assert hang is not None and hang.culprit == in_step
    fewer_splits = word(0, phases.CHECKPOINT, 6.0, splits=9)
    hang = judge([fewer_splits, word(1, phases.STEP, 7.0)], NOW, everyone_alive)
    assert hang is not None and hang.culprit == fewer_splits


def test_a_stopped_process_is_blamed_among_equals() -> None:
    first, second = word(0, phases.STEP, 7.0), word(1, phases.STEP, 6.0)
    hang = judge([first, second], NOW, everyone_alive, stopped=lambda w: w == second)
    assert hang is not None and hang.culprit == second


def test_a_stopped_process_is_blamed_even_when_its_word_is_ahead() -> None:
    # With a writer thread, rank 0 waits in the next split's backward (DDP's all-reduce) for rank
    # 1, stopped in its checkpoint's handover: same split count, a later phase, and the culprit.
    waiting, frozen = word(0, phases.BACKWARD, 9.0), word(1, phases.CHECKPOINT, 8.0)
    assert judge([waiting, frozen], NOW, everyone_alive).culprit == waiting  # type: ignore[union-attr]
    hang = judge([waiting, frozen], NOW, everyone_alive, stopped=lambda w: w == frozen)
    assert hang is not None and hang.culprit == frozen and hang.waiting == (waiting,)
    # A stopped process within its timeout is not a hang yet: the one furthest behind is blamed.
    hang = judge([waiting, word(1, phases.CHECKPOINT, 1.0)], NOW, everyone_alive, stopped=lambda w: w.rank == 1)
    assert hang is not None and hang.culprit == waiting


def test_a_rank_whose_writer_waits_for_peers_waits_in_a_collective() -> None:
    # Writer threads: rank 0's training thread waits for its writer, which waits in the commit's
    # gather for rank 1's report; rank 1's own writer is stuck in a storage write (no flag).
    gathering = word(0, phases.WRITER, 9.0, flags=WRITER_WAITS_FOR_PEERS)
    writing = word(1, phases.WRITER, 8.0)
    hang = judge([gathering, writing], NOW, everyone_alive)
    assert hang is not None and hang.culprit == writing and hang.waiting == (gathering,)
    # Alone on its node: the rank it waits for is elsewhere (judged with the other nodes' words).
    hang = judge([gathering], NOW, everyone_alive)
    assert hang is not None and hang.culprit is None and "another node" in hang.describe()
    # Past where another rank waits in the fit's collective (the boundary's agreement of the same
    # split): it skipped that all-reduce and went on to its checkpoint, whose gather waits for a
    # writer that never gets the checkpoint. The ranks called different collectives: it is blamed.
    agreeing = word(0, phases.COLLECTIVE, 9.0)
    skipped = word(1, phases.WRITER, 8.0, flags=WRITER_WAITS_FOR_PEERS)
    hang = judge([agreeing, skipped], NOW, everyone_alive)
    assert hang is not None and hang.culprit == skipped
    # Behind it (the previous split's checkpoint): both wait for a rank elsewhere.
    hang = judge([word(0, phases.COLLECTIVE, 9.0, splits=11), skipped], NOW, everyone_alive)
    assert hang is not None and hang.culprit is None
    # Without the flag, a rank waiting for its writer is the one stuck (its writer hangs).
    alone = judge([word(0, phases.WRITER, 9.0)], NOW, everyone_alive)
    assert alone is not None and alone.culprit is not None and alone.culprit.rank == 0


def test_every_rank_in_a_collective_blames_another_node() -> None:
    hang = judge([word(0, phases.COLLECTIVE, 9.0), word(1, phases.COLLECTIVE, 8.0)], NOW, everyone_alive)
    assert hang is not None and hang.culprit is None and "another node" in hang.describe()


def test_a_rank_stopped_inside_the_collective_the_others_wait_in_is_blamed() -> None:
    # SIGSTOP landed while rank 1 was in the all-reduce: every word says "collective", but a
    # stopped process waits for nobody.
    waiting, frozen = word(0, phases.COLLECTIVE, 9.0), word(1, phases.COLLECTIVE, 8.0)
    hang = judge([waiting, frozen], NOW, everyone_alive, stopped=lambda w: w == frozen)
    assert hang is not None and hang.culprit == frozen and hang.waiting == (waiting,)


def test_finished_and_dead_ranks_are_never_blamed() -> None:
    finished = word(1, phases.FINISHING, 50.0, flags=FINISHED)
    assert judge([finished], NOW, everyone_alive) is None
    dead = word(1, phases.STEP, 50.0)
    assert judge([dead, word(0, phases.BOUNDARY, 1.0)], NOW, alive=lambda w: w != dead) is None


def test_a_rank_that_reported_itself_stays_the_culprit() -> None:
    reported = word(1, phases.STEP, 9.0, flags=REPORTED)
    hang = judge([word(0, phases.COLLECTIVE, 2.0), reported], NOW, alive=lambda w: False)
    assert hang is not None and hang.culprit == reported
