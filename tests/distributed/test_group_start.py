"""The ranks of one try of a torchrun group meet on torchrun's agent store
(engine.distributed.group_start), in this process: a TCPStore standing for the agent's and one
thread per rank. Whatever restart count each rank's agent gave it, the ranks of a try share one
namespace, a later try another, and a rank that does not arrive is named within the bound."""

from __future__ import annotations

import concurrent.futures
import datetime
import pathlib
import subprocess
import sys
import time
import warnings
from typing import Callable, TypeVar

import pytest
import torch
import torch.distributed as dist

from engine.config import TrainerConfig
from engine.distributed import environment, group_start
from engine.errors import ConfigError, GroupStartTimeout

import forkserver
import torchrun_helpers as helpers

BOUND = datetime.timedelta(seconds=20)  # a regression fails within it, never in torch's 30 minutes
Result = TypeVar("Result")


@pytest.fixture
def agent_store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=BOUND)


def torchrun_environment(store: dist.TCPStore, rank: int, world_size: int, restart: int) -> dict[str, str]:
    """A worker's environment as torchrun's agent sets it (the variables the engine reads)."""
    return {"WORLD_SIZE": str(world_size), "RANK": str(rank), "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port), "TORCHELASTIC_RESTART_COUNT": str(restart),
            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "job"}


def on_every_rank(work: Callable[[int], Result], ranks: list[int], stagger: float = 0.0) -> dict[int, Result]:
    """``work(rank)`` for each rank in a thread of its own, started in the order of ``ranks``,
    ``stagger`` seconds apart."""
    with concurrent.futures.ThreadPoolExecutor(len(ranks)) as pool:
        futures = {}
        for rank in ranks:
            futures[rank] = pool.submit(work, rank)
            time.sleep(stagger)
        return {rank: future.result(timeout=2 * BOUND.total_seconds()) for rank, future in futures.items()}


def handshake(store: dist.TCPStore, ranks: list[int], stagger: float = 0.0) -> dict[int, str]:
    def work(rank: int) -> str:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=BOUND)
        return group_start.agree_on_token(client, rank, len(ranks), BOUND)
    return on_every_rank(work, ranks, stagger)


def test_every_rank_of_a_try_takes_one_token_and_the_next_try_another_whatever_the_stale_keys(
        agent_store: dist.TCPStore) -> None:
    tries = [handshake(agent_store, [0, 1, 2]),
             # rank 0 first: it finds the hello keys of the first try's ranks, answers them (nobody
             # reads those answers) and waits for this try's
             handshake(agent_store, [0, 2, 1], stagger=0.2),
             # rank 0 last: the others must not take the earlier tries' answers for its
             handshake(agent_store, [2, 1, 0], stagger=0.2)]
    tokens = [set(tokens_of_try.values()) for tokens_of_try in tries]
    assert [len(agreed) for agreed in tokens] == [1, 1, 1]
    assert len(set.union(*tokens)) == 3


def test_ranks_whose_agents_counted_different_restarts_share_the_namespace_of_their_try(
        agent_store: dist.TCPStore) -> None:
    # Two nodes after one worker was SIGKILLed: its agent counts a restart, the other none.
    restarts = {0: 0, 1: 1}

    def store_of(rank: int) -> dist.Store:
        store = environment._store_of_this_try(torchrun_environment(agent_store, rank, 2, restarts[rank]), BOUND)
        assert store is not None
        return store

    stores = on_every_rank(store_of, [0, 1])
    stores[0].set("seen", "rank 0's value")
    stores[1].wait(["seen"], datetime.timedelta(seconds=5))  # the same namespace, or this times out
    assert stores[1].get("seen") == b"rank 0's value"


@pytest.mark.parametrize("rank, message", [
    (0, r"did not start within 0.5 s \(TrainerConfig.start_timeout\): rank\(s\) \[1, 2\] of 3 did not arrive"),
    (2, r"did not start within 0.5 s \(TrainerConfig.start_timeout\): rank 2 got no answer from rank 0"),
], ids=["rank-0-alone", "rank-2-alone"])
def test_a_rank_that_does_not_arrive_is_named_within_the_start_timeout(agent_store: dist.TCPStore, rank: int,
                                                                      message: str) -> None:
    started = time.monotonic()
    with pytest.raises(GroupStartTimeout, match=message):
        environment.join(torch.device("cpu"), torchrun_environment(agent_store, rank, 3, 0), start_timeout=0.5)
    assert time.monotonic() - started < 10
    assert not dist.is_initialized()


def test_start_timeout_must_be_a_positive_number_of_seconds() -> None:
    with pytest.raises(ConfigError, match=r"TrainerConfig.start_timeout: expected a positive finite number"):
        TrainerConfig(start_timeout=0)


def test_a_group_torch_started_on_torchruns_store_is_warned_of_and_the_engines_is_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    shared_store = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
    monkeypatch.setattr(environment, "_warned", False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.warns(UserWarning, match=r"after a restart, joining it .* can read a dead rank's address and fail "
                                             r"or hang\. Start it with engine.distributed.init_process_group\(\)"):
            environment._warn_of_a_group_on_the_shared_store(shared_store)
    finally:
        dist.destroy_process_group()
    monkeypatch.setattr(environment, "_warned", False)
    environment.init_process_group(environ={})  # one rank, no network
    try:
        assert dist.get_world_size() == 1
        with pytest.raises(ConfigError, match="already initialised; call it once, before fit"):
            environment.init_process_group(environ={})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            environment._warn_of_a_group_on_the_shared_store(shared_store)
    finally:
        dist.destroy_process_group()


WRITER_GROUP_NOT_JOINED = """
import os, sys, time
import torch
from engine.distributed import environment
from engine.errors import GroupStartTimeout
if os.environ["RANK"] == "1":
    environment.init_process_group(start_timeout=20)  # joins the training group, never the writer group
    time.sleep(30)
try:
    environment.join(torch.device("cpu"), start_timeout=2)
except GroupStartTimeout as error:
    print(error)
    sys.exit(3)
"""


def test_a_writer_group_a_rank_does_not_join_ends_within_the_start_timeout(tmp_path: pathlib.Path) -> None:
    # Two processes of a job started without torchrun's agent store (env://, rank 0 hosts it).
    script, port = tmp_path / "rank.py", helpers.free_port()
    script.write_text(WRITER_GROUP_NOT_JOINED)
    ranks = [forkserver.popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**helpers.environment(), "WORLD_SIZE": "2", "RANK": str(rank),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for rank in (0, 1)]
    try:
        stdout, _ = ranks[0].communicate(timeout=60)
    finally:
        ranks[1].kill()
        ranks[1].wait()
    assert ranks[0].returncode == 3, stdout
    assert "the engine's writer group did not start within 2 s (TrainerConfig.start_timeout) on rank 0 of 2" in stdout
