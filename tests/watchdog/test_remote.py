"""Across nodes (engine.watchdog.remote): a node whose ranks all wait in a collective reads the other
nodes' words from the process group's store (a real TCPStore here) and names the rank that has not
arrived there, not its own waiting ranks; a remote rank still within its timeout is waited for; a
malformed publication is ignored."""

from __future__ import annotations

import datetime
import json
import threading
import time

import pytest
import torch.distributed as dist

import engine
from engine.watchdog import phases, tracker as trackers
from engine.watchdog.board import NodeBoard
from engine.watchdog.monitor import Monitor
from engine.watchdog.remote import KEY_PREFIX, RemoteBoard, decode, encode, several_nodes
from engine.watchdog.word import REPORTED, WRITER_WAITS_FOR_PEERS

POLICY = engine.Watchdog(min_timeout_s=0.5, first_timeout_s=0.5, poll_s=0.02)


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))


def node(tmp_path, name: str, placed: dict[int, str]) -> tuple[NodeBoard, dict[int, trackers.PhaseTracker]]:
    """A node's board with a rank in each given phase (every rank one split in)."""
    board = None
    ranks = {}
    for rank, phase in placed.items():
        rank_board = NodeBoard(str(tmp_path / name), rank)
        board = board or rank_board
        ranks[rank] = trackers.PhaseTracker(POLICY, rank_board.buffer, rank)
        ranks[rank].split_done(phase)
    assert board is not None
    return board, ranks


class Appended:
    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}

    def append(self, relative: str, data: bytes) -> None:
        self.files[relative] = self.files.get(relative, b"") + data


def test_the_rank_another_node_waits_for_is_named_across_nodes(tmp_path, store, capsys) -> None:
    board_b, ranks_b = node(tmp_path, "b", {2: phases.COLLECTIVE, 3: phases.STEP})
    RemoteBoard(lambda: store, 2, 4, host="node-b").publish(board_b.words(), time.monotonic_ns())
    board_a, ranks_a = node(tmp_path, "a", {0: phases.COLLECTIVE, 1: phases.COLLECTIVE})
    storage, ended = Appended(), threading.Event()
    monitor = Monitor(POLICY, ranks_a[0], board_a, storage, on_hang=ended.set,
                      remote=RemoteBoard(lambda: store, 0, 4, host="node-a"))
    time.sleep(0.6)  # past every timeout: rank 3's too, though node b published before
    deadline = time.monotonic() + 10
    while not monitor.check(time.monotonic_ns()):
        assert time.monotonic() < deadline
        time.sleep(0.05)  # node b's own monitors get a grace to report rank 3 with its stacks
    assert ended.is_set()
    row = json.loads(storage.files["hangs.jsonl"])
    assert (row["rank"], row["phase"], row["reported_by"], row["last_split"]) == (3, "step", 0, 1), row
    assert sorted(row["waiting_ranks"]) == [0, 1, 2] and "node-b" in row["process_state"]
    assert "rank 3 (pid" in capsys.readouterr().err


def verdict_of_rank_0_alone_on_node_a(tmp_path, store, phase: str, writer_waits_for_peers: bool = False) -> dict:
    """The hangs.jsonl row rank 0's monitor writes, rank 0 alone on node a in ``phase`` (its
    writer thread waiting for peers, with ``writer_waits_for_peers``), with node b's words
    already in the store (two ranks in all)."""
    board_a, ranks_a = node(tmp_path, "a", {0: phase})
    if writer_waits_for_peers:
        ranks_a[0].writer_waits_for_peers(True)
    storage, ended = Appended(), threading.Event()
    monitor = Monitor(POLICY, ranks_a[0], board_a, storage, on_hang=ended.set,
                      remote=RemoteBoard(lambda: store, 0, 2, host="node-a"))
    time.sleep(0.6)
    deadline = time.monotonic() + 10
    while not monitor.check(time.monotonic_ns()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return json.loads(storage.files["hangs.jsonl"])


def test_a_rank_waiting_in_ddps_all_reduce_inside_backward_names_the_remote_rank_it_waits_for(
        tmp_path, store) -> None:
    # Rank 0 is alone on its node, stalled in backward: DDP's gradient all-reduce waits there for
    # rank 1, stopped whole in its step on the other node (its word published before it stopped).
    board_b, _ = node(tmp_path, "b", {1: phases.STEP})
    RemoteBoard(lambda: store, 1, 2, host="node-b").publish(board_b.words(), time.monotonic_ns())
    row = verdict_of_rank_0_alone_on_node_a(tmp_path, store, phases.BACKWARD)
    assert (row["rank"], row["phase"], row["reported_by"]) == (1, "step", 0), row
    assert row["waiting_ranks"] == [0] and "node-b" in row["process_state"], row


def test_a_remote_rank_stopped_inside_the_collective_is_named_once_its_node_stopped_publishing(
        tmp_path, store) -> None:
    # Node b (rank 1) was stopped whole while rank 1 was inside the all-reduce rank 0 waits in: its
    # last publication, 5 s old, says "collective"; a node that no longer publishes is stopped.
    board_b, _ = node(tmp_path, "b", {1: phases.COLLECTIVE})
    store.set(f"{KEY_PREFIX}1", encode(board_b.words(), "node-b", time.monotonic_ns(), time.time() - 5.0))
    row = verdict_of_rank_0_alone_on_node_a(tmp_path, store, phases.COLLECTIVE)
    assert (row["rank"], row["phase"], row["reported_by"]) == (1, "collective", 0), row
    assert "stopped publishing" in row["process_state"], row


def test_a_peer_that_never_answers_its_peer_copy_is_named_not_the_rank_waiting_for_it(tmp_path, store) -> None:
    # The memory tier's peer copy (engine.distributed.memory_commit): rank 0 waits in it
    # (trackers.waiting_for_peers: a collective) for rank 1, stopped whole in its checkpoint on
    # node b before it sent or received anything; node b stopped publishing 5 s ago.
    board_b, _ = node(tmp_path, "b", {1: phases.CHECKPOINT})
    store.set(f"{KEY_PREFIX}1", encode(board_b.words(), "node-b", time.monotonic_ns(), time.time() - 5.0))
    row = verdict_of_rank_0_alone_on_node_a(tmp_path, store, phases.COLLECTIVE)
    assert (row["rank"], row["phase"], row["reported_by"]) == (1, "checkpoint", 0), row
    assert "stopped publishing" in row["process_state"], row


def node_a_after_a_rank_of_node_b_reported_itself(tmp_path, store, b: dict[int, str], reported: int,
                                                  a: dict[int, str], own: int) -> tuple[Monitor, threading.Event]:
    """Node b (ranks ``b``, rank ``reported`` flagged REPORTED) publishes; the monitor of node a's
    rank ``own`` (ranks ``a``), not started, and the event its hang action sets."""
    board_b, ranks_b = node(tmp_path, "b", b)
    ranks_b[reported].set_flag(REPORTED)
    RemoteBoard(lambda: store, min(b), 4, host="node-b").publish(board_b.words(), time.monotonic_ns())
    board_a, ranks_a = node(tmp_path, "a", a)
    ended = threading.Event()
    monitor = Monitor(POLICY, ranks_a[own], board_a, None, on_hang=ended.set,
                      remote=RemoteBoard(lambda: store, own, 4, host="node-a"))
    return monitor, ended


def test_a_remote_rank_that_reported_itself_ends_this_node_at_once(tmp_path, store) -> None:
    monitor, ended = node_a_after_a_rank_of_node_b_reported_itself(
        tmp_path, store, {2: phases.COLLECTIVE, 3: phases.STEP}, 3, {0: phases.COLLECTIVE, 1: phases.COLLECTIVE}, 1)
    time.sleep(0.6)
    assert monitor.check(time.monotonic_ns()) and ended.is_set()


def test_a_remote_rank_within_its_timeout_is_waited_for(tmp_path, store) -> None:
    board_b, ranks_b = node(tmp_path, "b", {2: phases.STEP})
    ranks_b[2].statistics._timeouts[phases.STEP] = 60.0  # a long step, learned as such
    ranks_b[2].mark(phases.STEP, "long")  # publish that timeout
    RemoteBoard(lambda: store, 2, 3, host="node-b").publish(board_b.words(), time.monotonic_ns())
    board_a, ranks_a = node(tmp_path, "a", {0: phases.COLLECTIVE, 1: phases.COLLECTIVE})
    monitor = Monitor(POLICY, ranks_a[0], board_a, None, on_hang=lambda: pytest.fail("no hang"),
                      remote=RemoteBoard(lambda: store, 0, 3, host="node-a"))
    time.sleep(0.6)
    assert not monitor.check(time.monotonic_ns())


def test_a_publication_crosses_nodes_as_durations_and_a_malformed_one_is_ignored(tmp_path) -> None:
    board, ranks = node(tmp_path, "b", {5: phases.DATA})
    now = time.monotonic_ns()
    (word,) = board.words()
    data = encode([word], "node-b", now, wall_s=1000.0)
    elsewhere_now = 123 * 10**9  # another node's monotonic clock
    (remote,) = decode(data, elsewhere_now, wall_s=1002.0)  # read 2 s after it was published
    assert remote.host == "node-b" and remote.age_s == 2.0
    assert remote.word.rank == 5 and remote.word.phase == phases.DATA and remote.word.splits == 1
    assert remote.word.stalled_s(elsewhere_now) == pytest.approx(word.stalled_s(now) + 2.0, abs=1e-6)
    for bad in (b"", b"not json", b'{"host": "x"}', json.dumps({"host": "x", "wall_s": 1, "words": [{"rank": 1}]}).encode()):
        assert decode(bad, elsewhere_now, 1002.0) == []
    assert decode(json.dumps({"host": "x", "wall_s": 1, "words": [{**json.loads(data)["words"][0], "pid": "1"}]})
                  .encode(), elsewhere_now, 1002.0) == []


def test_only_a_job_on_several_nodes_publishes(store) -> None:
    assert not several_nodes({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"})
    assert several_nodes({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"})
    assert not several_nodes({"WORLD_SIZE": "4"})
    RemoteBoard(lambda: store, 1, 4).publish([], time.monotonic_ns())  # no word: nothing to publish
    assert not store.check([f"{KEY_PREFIX}1"])


def test_a_collective_broken_by_a_remote_rank_that_reported_its_hang_ends_with_the_hang_code(tmp_path, store,
                                                                                            capsys) -> None:
    monitor, ended = node_a_after_a_rank_of_node_b_reported_itself(
        tmp_path, store, {2: phases.STEP, 3: phases.COLLECTIVE}, 2, {0: phases.BACKWARD, 1: phases.BACKWARD}, 0)
    monitor.end_if_a_peer_hung(RuntimeError("Connection closed by peer"))
    assert ended.is_set()
    assert "rank 2 on node-b hung and reported it; rank 0 ends too" in capsys.readouterr().err


def test_a_rank_whose_writer_thread_waits_for_a_stopped_peer_names_the_peer(tmp_path, store) -> None:
    # Writer threads: rank 0's training thread waits for its writer, whose peer copy (or commit
    # gather) waits for rank 1, stopped whole in its step on node b (silent for 5 s).
    board_b, _ = node(tmp_path, "b", {1: phases.STEP})
    store.set(f"{KEY_PREFIX}1", encode(board_b.words(), "node-b", time.monotonic_ns(), time.time() - 5.0))
    row = verdict_of_rank_0_alone_on_node_a(tmp_path, store, phases.WRITER, writer_waits_for_peers=True)
    assert (row["rank"], row["phase"], row["reported_by"]) == (1, "step", 0), row
    assert row["waiting_ranks"] == [0] and "stopped publishing" in row["process_state"], row
