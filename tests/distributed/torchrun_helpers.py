"""Start tests/distributed/dist_train.py (or another script, such as fsdp_train.py) under a real
torchrun and read what it leaves.

The torchrun agent (``python -m torch.distributed.run``) is forked from the tests' fork server
(tests/forkserver.py: torch imported once) when it is available, as the kill tests' processes
are: a real process, its own pid, signalled and killed as a fresh one. The ranks it starts are
fresh ``python`` processes, as under any torchrun, unless a job asks for ``forked_ranks``
(:func:`torchrun_command`): each rank is then tests/distributed/rank_relay.py, which has its
training process forked from the same server."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import torch

import forkserver

SCRIPT = str(pathlib.Path(__file__).with_name("dist_train.py"))
FSDP_SCRIPT = str(pathlib.Path(__file__).with_name("fsdp_train.py"))
RANK_RELAY = str(pathlib.Path(__file__).with_name("rank_relay.py"))
REPOSITORY = str(pathlib.Path(__file__).resolve().parents[2])
TIMEOUT = 240


def torchrun_command(ranks: int, run_dir: pathlib.Path, out_dir: pathlib.Path, *args: str,
                     max_restarts: int = 0, script: str = SCRIPT, forked_ranks: bool = False) -> list[str]:
    """A torchrun job of ``ranks`` processes on this machine. ``forked_ranks``: each rank's
    training process is forked from this test's fork server (tests/distributed/rank_relay.py),
    for a job that runs to its end by itself (fault points included); a test that signals the
    job, or looks at its processes, keeps fresh ranks (the default)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.2", *rank_entry_point(script, forked_ranks),
            str(run_dir), str(out_dir), *args]


def rank_entry_point(script: str, forked: bool) -> list[str]:
    """``script``, or the relay that has it forked, when ``forked`` and a fork server is available."""
    server = forkserver.address() if forked else None
    return [script] if server is None else [RANK_RELAY, server, script]


def free_port() -> int:
    """A TCP port nothing listens on now (for a rendezvous endpoint)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def node_command(node: int, port: int, run_dir: pathlib.Path, out_dir: pathlib.Path, *args: str,
                 nodes: int = 2, processes_per_node: int = 1, max_restarts: int = 0,
                 forked_ranks: bool = False) -> list[str]:
    """One "node" of a job of ``nodes``: its own torchrun agent, joined to the others by a c10d
    rendezvous on 127.0.0.1:``port`` that node 0 hosts (as ``--rdzv-endpoint=$HEAD:29500`` in
    docs/distributed.md's several-nodes recipe). No restarts by default: a node that dies fails
    the job, and the test restarts every agent, as a scheduler requeues the job; with
    ``max_restarts`` the agents restart their workers after a worker fails. ``forked_ranks``: as
    for :func:`torchrun_command`."""
    host = "true" if node == 0 else "false"
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node-rank={node}",
            f"--nproc-per-node={processes_per_node}", f"--max-restarts={max_restarts}", "--monitor-interval=0.2",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=job-{port}",
            f"--rdzv-conf=is_host={host},join_timeout={TIMEOUT}", *rank_entry_point(SCRIPT, forked_ranks),
            str(run_dir), str(out_dir), *args]


def start_nodes(job: pathlib.Path, *args: str, nodes: int = 2, max_restarts: int = 0, forked_ranks: bool = False,
                **env: str) -> list[subprocess.Popen]:
    """Every node's agent of one try of the job in ``job`` (run/, out/), each in a session of
    its own (a machine of its own), node 0 (the rendezvous host) first; their output is
    appended to ``job/node-<n>.log``."""
    (job / "out").mkdir(parents=True, exist_ok=True)
    port = free_port()
    started = []
    for node in range(nodes):
        command = node_command(node, port, job / "run", job / "out", *args, nodes=nodes, max_restarts=max_restarts,
                               forked_ranks=forked_ranks)
        with open(job / f"node-{node}.log", "a") as log:
            started.append(forkserver.popen(command, env=environment(**env), stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True))
    return started


def kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL a whole node: its agent's process group and its workers (torchrun starts each
    worker in a session of its own), as a machine that loses power."""
    from engine.distributed.launch import descendants
    victims = descendants(agent.pid)
    os.killpg(agent.pid, signal.SIGKILL)
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait(timeout=TIMEOUT)


def wait_for_nodes_releasing_a_stopped_rank(agents: list[subprocess.Popen], out_dir: pathlib.Path,
                                            rank: int) -> list[int]:
    """The agents' exit statuses; whatever happened, no agent left running and ``rank``'s worker
    (stopped by a test) never left behind stopped."""
    try:
        return [agent.wait(timeout=TIMEOUT) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                kill_node(agent)
        stopped = worker_pid(out_dir, rank)
        if stopped is not None:
            for number in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(stopped, number)
                except ProcessLookupError:
                    pass


def node_logs(job: pathlib.Path) -> str:
    return "".join(path.read_text()[-3000:] for path in sorted(job.glob("node-*.log")))


def environment(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if key not in ("SPLITLOOP_FAULTS", "KILLS", "DIVERGE_RANK", "DIVERGE_AT", "VALIDATION_PAUSE")}
    env["PYTHONPATH"] = REPOSITORY + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return forkserver.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT)


def train(tmp: pathlib.Path, name: str, ranks: int, *args: str, max_restarts: int = 0, script: str = SCRIPT,
          **env: str) -> tuple[subprocess.CompletedProcess, pathlib.Path, pathlib.Path]:
    """Run a whole torchrun job, its ranks forked (see :func:`torchrun_command`); (completed
    process, run dir, out dir)."""
    run_dir, out_dir = tmp / name / "run", tmp / name / "out"
    out_dir.mkdir(parents=True)
    process = run(torchrun_command(ranks, run_dir, out_dir, *args, max_restarts=max_restarts, script=script,
                                   forked_ranks=True), environment(**env))
    return process, run_dir, out_dir


def uninterrupted(tmp: pathlib.Path, ranks: int, *args: str, script: str = SCRIPT) -> pathlib.Path:
    """The job dir (run/, out/) of a whole ``ranks``-rank job that must end well: a reference."""
    process, _, _ = train(tmp, "job", ranks, *args, script=script)
    assert process.returncode == 0, process.stderr[-4000:]
    return tmp / "job"


HIDDEN_KEYS = {"hidden.h", "hidden.c"}  # dist_train.py / fsdp_train.py: a process that trained has them


def final_state(out_dir: pathlib.Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(out_dir / f"final-{rank}.pt", weights_only=True)


def assert_same_result(reference: pathlib.Path, other: pathlib.Path, ranks: int) -> None:
    """Every rank's parameters, RNG and carried hidden state, and metrics.jsonl, bit for bit. The
    hidden state is compared when ``other``'s last attempt trained: one killed right after the
    run's last commit is restarted, finds the run finished and trains nothing (no hidden state)."""
    for rank in range(ranks):
        expected, got = final_state(reference / "out", rank), final_state(other / "out", rank)
        if set(expected) - set(got) == HIDDEN_KEYS:
            expected = {key: value for key, value in expected.items() if key not in HIDDEN_KEYS}
        assert set(expected) == set(got), (f"rank {rank}: only in the reference {sorted(set(expected) - set(got))}, "
                                           f"only in this run {sorted(set(got) - set(expected))}")
        for key in expected:
            assert torch.equal(expected[key], got[key]), f"rank {rank}: {key} differs"
    assert (reference / "run" / "metrics.jsonl").read_bytes() == (other / "run" / "metrics.jsonl").read_bytes()


def assert_close_after_resharding(expected: torch.Tensor, got: torch.Tensor, what: str) -> None:
    """Within the tolerance docs/distributed.md gives for a sharded run resumed on another world
    size: the same samples meet the same step, but FSDP reduce-scatters the gradients over
    another number of ranks (another order of float additions), so 1e-5 relative, not equality."""
    scale = expected.abs().max().clamp_min(1e-12)
    assert ((got - expected).abs().max() / scale).item() <= 1e-5, what


def samples_per_step(out: pathlib.Path) -> dict[int, list[int]]:
    """Each optimizer step's sample ids over every rank, from the ``steps-<ATTEMPT>-<rank>.jsonl``
    files elastic_train.py and fsdp_train.py --record-steps write, as trained by the last attempt
    that trained the step (a step redone after a kill replaces the lost one)."""
    by_step: dict[int, dict[int, list[int]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for path in out.glob("steps-*.jsonl"):
        attempt = int(re.fullmatch(r"steps-(\d+)-\d+\.jsonl", path.name).group(1))  # type: ignore[union-attr]
        for line in path.read_text().splitlines():
            row = json.loads(line)
            by_step[row["step"]][attempt].extend(row["ids"])
    return {step: sorted(attempts[max(attempts)]) for step, attempts in by_step.items()}


def wait_for(predicate, what: str, process: subprocess.Popen, limit: float = TIMEOUT) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        if process.poll() is not None:
            raise AssertionError(f"the job ended (status {process.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def metrics_lines(run_dir: pathlib.Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_bytes().count(b"\n") if path.exists() else 0


def splits_done(out_dir: pathlib.Path, rank: int) -> int:
    """Splits the rank has finished in this process (dist_train.py --slow counts them)."""
    try:
        return int((out_dir / f"splits-{rank}").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def worker_pid(out_dir: pathlib.Path, rank: int, restart: int = 0) -> int | None:
    path = out_dir / f"pid-{rank}-{restart}"
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def signal_worker(out_dir: pathlib.Path, rank: int, number: int) -> None:
    pid = worker_pid(out_dir, rank)
    assert pid is not None
    os.kill(pid, number)


def sigkill_a_rank_while_training(command: list[str], run_dir: pathlib.Path, out_dir: pathlib.Path, rank: int,
                                  delay: float, popen=subprocess.Popen) -> None:
    """Start the job ``command`` with ``popen``, SIGKILL rank ``rank``'s worker ``delay``
    seconds after the run logged its second row, and check that the job still ends with exit 0
    (torchrun restarts the group, which resumes)."""
    with popen(command, env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as job:
        wait_for(lambda: metrics_lines(run_dir) >= 2, "training started", job)
        time.sleep(delay)
        signal_worker(out_dir, rank, signal.SIGKILL)
        _, stderr = job.communicate(timeout=TIMEOUT)
    assert job.returncode == 0, f"rank {rank} killed after {delay:.2f}s: " + stderr[-4000:]


__all__ = ["signal"]
