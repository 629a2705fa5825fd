"""Ranks that never arrive (engine.watchdog.arrival), from the words alone: a worker still without a
word, or still starting, past the timeout while a rank of its try waits for it; nobody blamed on a
node where no rank arrived, nor a rank of another try; and where the words live under the launcher."""

from __future__ import annotations

import os

from engine.watchdog import phases
from engine.watchdog.arrival import Worker, arrived, never_arrived
from engine.watchdog.board import BOARD_VARIABLE, shared_directory
from engine.watchdog.word import FINISHED, Word


def word(rank: int, phase: str, flags: int = 0, detail: str = "") -> Word:
    return Word(1, 0, 0, 300.0, 0.0, 0.0, 0.0, 100 + rank, rank, phases.CODE_OF[phase], flags, detail)


def worker(rank: int, directory: str = "try-0", appeared_s: float = 0.0) -> Worker:
    return Worker(100 + rank, rank, directory, appeared_s)


def test_a_rank_has_arrived_once_its_word_leaves_the_start() -> None:
    assert not arrived(None) and not arrived(word(0, phases.STARTING))
    assert arrived(word(0, phases.COLLECTIVE)) and arrived(word(0, phases.DATA))
    assert arrived(word(0, phases.STARTING, detail=phases.JOINING))  # waiting for the others to join
    assert arrived(word(0, phases.STARTING, detail=phases.START_BARRIER))
    assert not arrived(word(0, phases.STARTING, detail="restoring"))
    assert arrived(word(0, phases.STARTING, flags=FINISHED))  # a fit that ended at once


def test_the_rank_without_a_word_is_named_after_the_timeout_not_before() -> None:
    workers = [worker(0), worker(1)]
    found = {100: word(0, phases.COLLECTIVE), 101: None}
    assert never_arrived(workers, found, {100}, now_s=9.9, timeout_s=10.0) == []
    late = never_arrived(workers, found, {100}, now_s=10.5, timeout_s=10.0)
    assert [(item.worker.rank, item.word, item.waiting) for item in late] == [(1, None, (0,))]
    assert "published no progress word" in late[0].line("node")


def test_a_rank_still_starting_is_named_with_its_word() -> None:
    starting = word(2, phases.STARTING)
    late = never_arrived([worker(0), worker(1), worker(2)], {100: None, 101: None, 102: starting}, {100, 101}, 60.0, 10.0)
    assert [(item.worker.rank, item.word, item.waiting) for item in late] == [(2, starting, (0, 1))]
    assert "still says 'starting'" in late[0].line("node")


def test_nobody_is_blamed_where_no_rank_arrived() -> None:
    # Every local rank still starting or silent: the one they would wait for is on another node.
    assert never_arrived([worker(0), worker(1)], {100: word(0, phases.STARTING), 101: None}, set(), 600.0, 10.0) == []


def test_a_rank_of_another_try_is_not_waited_for() -> None:
    workers = [worker(0, "try-0"), worker(1, "try-1", appeared_s=0.0)]
    assert never_arrived(workers, {100: word(0, phases.COLLECTIVE), 101: None}, {100}, 60.0, 10.0) == []


def test_the_launcher_board_holds_the_words_even_of_a_job_of_one(tmp_path) -> None:
    torchrun = {"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "job", "MASTER_PORT": "1",
                "TORCHELASTIC_RESTART_COUNT": "2"}
    assert shared_directory(torchrun) is None
    directory = shared_directory({**torchrun, BOARD_VARIABLE: str(tmp_path)})
    assert directory is not None and directory.startswith(str(tmp_path)) and directory.endswith("job-1-0-2")
    assert shared_directory({**torchrun, BOARD_VARIABLE: "relative/path"}) is None  # not the launcher's: ignored


def test_a_restart_removes_the_words_its_killed_predecessors_left_on_the_node(tmp_path):
    from engine.watchdog.board import NodeBoard

    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "job", "MASTER_PORT": "29500",
                "GROUP_RANK": "0", BOARD_VARIABLE: str(tmp_path)}
    left = []
    for restart in ("0", "1"):  # two tries SIGKILLed with their words in place
        directory = shared_directory({**torchrun, "TORCHELASTIC_RESTART_COUNT": restart})
        NodeBoard(directory, 0, keep=True).buffer.close()
        left.append(directory)
    other_node = shared_directory({**torchrun, "GROUP_RANK": "1", "TORCHELASTIC_RESTART_COUNT": "0"})
    NodeBoard(other_node, 1, keep=True).buffer.close()
    current = shared_directory({**torchrun, "TORCHELASTIC_RESTART_COUNT": "2"})
    board = NodeBoard(current, 0)
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(path) for path in (current, other_node))
    board.close()
