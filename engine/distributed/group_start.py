"""How the ranks of one try of a torchrun group meet, within a bound.

torchrun's agents keep one TCPStore (the agent store, ``TORCHELASTIC_USE_AGENT_STORE``) across
the restarts of the group, so every key a try wrote is still there for the next: a process
group joined on it reads the dead try's addresses ("Gloo connectFullMesh failed ... Connection
refused") or connects to a port someone else took since (a hang). Each try therefore needs a
namespace of its own, the same on every rank of the try.

No value torchrun hands its workers tells the tries apart the same way on every node:
``TORCHELASTIC_RESTART_COUNT`` is each agent's own count (an agent whose worker did not fail
counts nothing), ``TORCHELASTIC_RUN_ID``, ``MASTER_ADDR`` and ``MASTER_PORT`` stay the same, and
the rendezvous round is the agents' (not in the workers' environment). What the ranks of one
try do share is the store, their ``RANK`` and the fact that each of them is a new process. So
rank 0 draws a fresh token and hands it over in a handshake in which every message is named by
something fresh (:func:`agree_on_token`): a stale key of an earlier try can never be mistaken for
this try's. The handshake also tells, when the bound runs out, which ranks did not arrive.
"""

from __future__ import annotations

import datetime
import secrets
import time

import torch.distributed as dist

from engine.errors import GroupStartTimeout

# Under the agent store's root; every key below names the try's fresh values.
HANDSHAKE_PREFIX = "splitloop/start"
_POLL_SECONDS = (0.005, 0.1)  # rank 0's first and longest wait between looks at the store


def agree_on_token(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta) -> str:
    """The token rank 0 drew for this try, on every rank of it.

    Rank r > 0 writes a fresh nonce under ``hello/<r>``; rank 0 answers each nonce it sees there
    with its token under ``reply/<nonce>`` (an answer to a stale nonce is never read); rank r
    reads the answer to its own nonce and acknowledges under ``ack/<token>/<r>``. Rank 0 returns
    once every rank acknowledged. Raises :class:`GroupStartTimeout` naming the ranks that did
    not arrive within ``timeout``."""
    handshake = dist.PrefixStore(HANDSHAKE_PREFIX, store)
    if rank == 0:
        return _hand_out_token(handshake, world_size, timeout)
    return _receive_token(handshake, rank, timeout)


def _hand_out_token(store: dist.Store, world_size: int, timeout: datetime.timedelta) -> str:
    token = secrets.token_hex(16)
    answered: dict[int, bytes] = {}
    waiting = set(range(1, world_size))
    deadline = time.monotonic() + timeout.total_seconds()
    pause = _POLL_SECONDS[0]
    while waiting:
        for rank in sorted(waiting):
            if store.check([f"hello/{rank}"]):
                nonce = store.get(f"hello/{rank}")
                if answered.get(rank) != nonce:
                    store.set(f"reply/{nonce.decode()}", token)
                    answered[rank] = nonce
            if store.check([f"ack/{token}/{rank}"]):
                waiting.discard(rank)
        if not waiting:
            break
        if time.monotonic() > deadline:
            raise GroupStartTimeout(
                f"the process group did not start within {timeout.total_seconds():g} s "
                f"(TrainerConfig.start_timeout): rank(s) {sorted(waiting)} of {world_size} did not arrive; this rank "
                "exits so that torchrun restarts the group (raise start_timeout if the ranks start that slowly)")
        time.sleep(pause)
        pause = min(2 * pause, _POLL_SECONDS[1])
    return token


def _receive_token(store: dist.Store, rank: int, timeout: datetime.timedelta) -> str:
    nonce = secrets.token_hex(16)
    store.set(f"hello/{rank}", nonce)
    try:
        store.wait([f"reply/{nonce}"], timeout)
    except dist.DistStoreError as error:
        raise GroupStartTimeout(
            f"the process group did not start within {timeout.total_seconds():g} s (TrainerConfig.start_timeout): "
            f"rank {rank} got no answer from rank 0, which did not arrive; this rank exits so that torchrun "
            "restarts the group (raise start_timeout if the ranks start that slowly)") from error
    token = store.get(f"reply/{nonce}").decode()
    store.set(f"ack/{token}/{rank}", "1")
    return token
