"""Where a torchrun job's progress words live on a node (engine.watchdog.board): one directory per
launch (its torchrun agent), so that a job requeued under the same rendezvous id and port never
reads the words a predecessor killed whole left in /dev/shm, and those words are removed."""

from __future__ import annotations

import os
import subprocess
import sys

from engine.watchdog import phases
from engine.watchdog.board import BOARD_VARIABLE, NodeBoard, shared_directory
from engine.watchdog.settings import Watchdog
from engine.watchdog.tracker import PhaseTracker
from engine.watchdog.word import REPORTED

TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "job", "MASTER_PORT": "29500", "GROUP_RANK": "0",
            "TORCHELASTIC_RESTART_COUNT": "0"}


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_two_launches_of_one_job_have_two_directories_and_a_launcher_keeps_its_own(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("engine.watchdog.board.tempfile.gettempdir", lambda: str(tmp_path))
    first, second = shared_directory(TORCHRUN, agent=100), shared_directory(TORCHRUN, agent=200)
    assert first is not None and second is not None and first != second
    assert first.endswith("job-29500-0-a100-0")
    launched = {**TORCHRUN, BOARD_VARIABLE: str(tmp_path)}
    assert shared_directory(launched, agent=100) == shared_directory(launched) == str(tmp_path / "splitloop-watchdog-job-29500-0-0")


def test_the_words_of_a_launch_killed_whole_are_neither_read_nor_left(tmp_path) -> None:
    dead, alive = dead_pid(), os.getpid()
    parent = tmp_path / "shm"
    parent.mkdir()

    def directory(agent: int, environment: dict[str, str] = TORCHRUN) -> str:
        found = shared_directory(environment, agent=agent)
        assert found is not None
        return str(parent / os.path.basename(found))

    # The killed launch's rank 1 had reported itself hung (its word stays for the others to read).
    killed = NodeBoard(directory(dead), 1, keep=True)
    PhaseTracker(Watchdog(), killed.buffer, 1).set_flag(REPORTED)
    killed.buffer.close()
    running_elsewhere = directory(alive)  # another live agent (a pid in use: kept, the safe side)
    NodeBoard(running_elsewhere, 1, keep=True).buffer.close()
    other_job = directory(dead, {**TORCHRUN, "TORCHELASTIC_RUN_ID": "other"})
    NodeBoard(other_job, 0, keep=True).buffer.close()

    board = NodeBoard(directory(dead + 1_000_000), 0)  # the requeued launch: a new agent
    try:
        PhaseTracker(Watchdog(), board.buffer, 0).mark(phases.STARTING)
        assert [(word.rank, word.flags & REPORTED) for word in board.words()] == [(0, 0)]
        left = sorted(os.listdir(parent))
        assert os.path.basename(directory(dead)) not in left
        assert os.path.basename(running_elsewhere) in left and os.path.basename(other_job) in left
    finally:
        board.close()


AGENT = """
import os, subprocess, sys
environment = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
command = [sys.executable, "-c", sys.argv[2]]
if sys.argv[1] == "wrapped":  # a wrapper script between the agent and Python, started with the worker's environment
    command = ["sh", "-c", '"$0" -c "$1"; exit $?', *command[:1], sys.argv[2]]
child = subprocess.run(command, env={**environment, "LOCAL_RANK": "0"}, capture_output=True, text=True, check=True)
print(os.getpid(), child.stdout.strip())
"""
RANK = "from engine.watchdog.board import torchrun_agent; print(torchrun_agent())"


def test_the_agent_is_found_above_a_wrapper_script() -> None:
    for how in ("direct", "wrapped"):
        environment = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
        output = subprocess.run([sys.executable, "-c", AGENT, how, RANK], env=environment, capture_output=True,
                                text=True, check=True).stdout.split()
        assert output[0] == output[1], (how, output)


def test_a_board_whose_directory_another_rank_removed_still_reads_its_own_word(tmp_path) -> None:
    # A rank that ends on a hang removes the node's words (engine.watchdog.session): the other
    # ranks' monitors and exception paths read on without an error.
    board = NodeBoard(str(tmp_path / "words"), 1)
    PhaseTracker(Watchdog(), board.buffer, 1).mark(phases.STEP)
    other = NodeBoard(str(tmp_path / "words"), 0)
    other.remove_all()
    assert [(word.rank, word.phase) for word in board.words()] == [(1, "step")]
    board.close()
