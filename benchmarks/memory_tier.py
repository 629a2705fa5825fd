"""Memory-first checkpoints under torchrun: their cost beside no checkpoints and beside durable
ones, and what a lost node costs in replayed splits.

Two "nodes" (two torchrun agents on 127.0.0.1, one rank each, each with its own memory-tier
directory under /dev/shm) train the same model three ways, alternating over ``--repeats``
rounds, each rank 0 timing its ``fit``:

* ``memory``: a checkpoint every split into node memory with a peer copy on the other node,
  durable copies every 1,000 splits (and the last one);
* ``memory-process``: the same, written by writer processes (``writer="process"``);
* ``local``: the same without peer copies (what the copy itself costs);
* ``durable``: a checkpoint every split into the run dir (the commit across ranks, fsynced);
* ``none``: no checkpoint.

Then one more ``memory`` job is SIGKILLed whole after some splits, node 1's tier deleted, and
started again: the splits replayed are the splits done before the kill minus those the restart
resumed at (the ledger's ``restored`` row). Last, a small model's training-thread CPU per
snapshot (``time.thread_time`` around each save, memory tier) is measured in a 2-rank job on
one node, with a writer thread and with writer processes.

Reproduce (from the repository root)::

    python benchmarks/memory_tier.py              # 25M parameters per rank; minutes on 2 shared cores
    python benchmarks/memory_tier.py --quick      # one round, 4M parameters
    python benchmarks/memory_tier.py --smoke      # everything once, tiny (the figures mean nothing)

The last four lines are the figures ``memory tier + peer copy every split / no checkpoints: X``,
``durable every split / no checkpoints: Y``, ``splits replayed after a node loss: Z`` and
``training thread CPU per snapshot: W ms``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

REPOSITORY = pathlib.Path(__file__).resolve().parents[1]


def worker(mode: str, run_dir: str, tier: str, width: int, splits: int, report: str, slow: float) -> None:
    """One rank of a job (started by torchrun)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import engine

    class Model(engine.Module):
        """``width`` x ``width`` x 1: 25M parameters at width 5000 (no TBPTT: one split per batch)."""

        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(width, width)
            self.head = torch.nn.Linear(width, 1)

        def training_step(self, batch):
            x, y = batch
            if slow:
                time.sleep(slow)
            return torch.nn.functional.mse_loss(self.head(torch.tanh(self.body(x))), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-4, momentum=0.9)

    torch.manual_seed(0)
    model = Model()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(splits * 4, width, generator=generator)
    loader = DataLoader(TensorDataset(x, x[:, :1]), batch_size=2, shuffle=True)
    node = os.environ.get("GROUP_RANK", "0")
    writer = "process" if mode.endswith("-process") else "thread"
    if mode == "none":
        policy = None
    elif mode == "durable":
        policy = engine.CheckpointConfig(every_n_splits=1, at_epoch_end=False, keep_last=2, writer="thread")
    else:
        policy = engine.CheckpointConfig(every_n_splits=1, at_epoch_end=False, keep_last=2, writer=writer,
                                         local_tier=f"{tier}-{node}", durable_every_n_splits=1000,
                                         peer_copies=0 if mode.startswith(("snapshot", "local")) else 1)
    config = engine.TrainerConfig(max_epochs=1, run_dir=run_dir, checkpoint=policy, progress_bar="off", device="cpu")
    trainer = engine.Trainer(config)
    cpu: list[float] = []
    if mode.startswith("snapshot"):
        from engine.checkpoint.policy import RunCheckpointer
        save = RunCheckpointer.save

        def timed_save(self, *args, **kwargs):
            started = time.thread_time()
            try:
                return save(self, *args, **kwargs)
            finally:
                cpu.append(time.thread_time() - started)

        RunCheckpointer.save = timed_save  # type: ignore[method-assign]
    started = time.perf_counter()
    trainer.fit(model, loader)
    seconds = time.perf_counter() - started
    if os.environ["RANK"] == "0":
        # The first saves lay out buffers and warm caches: the steady state is what repeats.
        steady = cpu[len(cpu) // 4:] or cpu
        pathlib.Path(report).write_text(json.dumps({"seconds": seconds,
                                                    "cpu_ms": 1000 * statistics.median(steady) if steady else None}))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _environment() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": f"{REPOSITORY}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def start_nodes(directory: pathlib.Path, name: str, mode: str, tier: str, width: int, splits: int,
                slow: float = 0.0) -> tuple[list[subprocess.Popen], pathlib.Path]:
    """Two agents of one job (node 0, the rendezvous host, first); its report file."""
    port, report = _free_port(), directory / f"{name}.json"
    agents = []
    for node in range(2):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
                   "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                   f"--rdzv-id=bench-{port}", f"--rdzv-conf=is_host={'true' if node == 0 else 'false'}",
                   __file__, "--worker", mode, str(directory / name / "run"), tier, str(width), str(splits),
                   str(report), str(slow)]
        agents.append(subprocess.Popen(command, env=_environment(), stdout=subprocess.DEVNULL,
                                       stderr=open(directory / f"{name}-node{node}.log", "ab"), start_new_session=True))
    return agents, report


def job(directory: pathlib.Path, name: str, mode: str, tier: str, width: int, splits: int) -> dict:
    agents, report = start_nodes(directory, name, mode, tier, width, splits)
    for node, agent in enumerate(agents):
        if agent.wait() != 0:
            raise SystemExit(f"{name}: node {node} failed:\n" + (directory / f"{name}-node{node}.log").read_text()[-3000:])
    return json.loads(report.read_text())


def one_node_job(directory: pathlib.Path, name: str, mode: str, tier: str, width: int, splits: int) -> dict:
    report = directory / f"{name}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
               "--worker", mode, str(directory / name / "run"), tier, str(width), str(splits), str(report), "0"]
    subprocess.run(command, env=_environment(), check=True, capture_output=True, text=True)
    return json.loads(report.read_text())


def splits_replayed_after_a_node_loss(directory: pathlib.Path, tier: str, width: int, splits: int) -> int:
    """Kill the whole job once rank 1 committed a few splits, empty node 1's tier, start again."""
    run_dir = directory / "loss" / "run"
    agents, _ = start_nodes(directory, "loss", "memory", tier, width, splits, slow=0.2)
    ledger = run_dir / "ledger" / "rank-00001.jsonl"
    deadline = time.monotonic() + 600
    while _commits(ledger) < splits // 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    done = _commits(ledger)
    for agent in agents:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()
    subprocess.run(["pkill", "-9", "-f", "--", f"--worker memory {run_dir}"], check=False)
    shutil.rmtree(f"{tier}-1", ignore_errors=True)
    restarted, _ = start_nodes(directory, "loss", "memory", tier, width, splits)
    for agent in restarted:
        agent.wait()
    rows = [json.loads(line) for line in ledger.read_text().splitlines()]
    resumed = [row["units"] for row in rows if row["event"] == "restored"][-1]
    return max(0, done - resumed)


def _commits(ledger: pathlib.Path) -> int:
    """Splits whose save the ledger recorded (rows are flushed with each later one)."""
    try:
        return sum(1 for line in ledger.read_text().splitlines() if '"event":"commit"' in line)
    except FileNotFoundError:
        return 0


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        mode, run_dir, tier, width, splits, report, slow = sys.argv[2:9]
        worker(mode, run_dir, tier, int(width), int(splits), report, float(slow))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=5000, help="the model is width x width (+ width): 25M at 5000")
    parser.add_argument("--splits", type=int, default=24, help="splits per rank of each timed job")
    parser.add_argument("--quick", action="store_true", help="one round, a 4M-parameter model")
    parser.add_argument("--smoke", action="store_true", help="everything once, tiny")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.width = 1, 2000
    if args.smoke:
        args.repeats, args.width, args.splits = 1, 64, 8
    tier = f"/dev/shm/splitloop-bench-{uuid.uuid4().hex[:12]}"
    times: dict[str, list[float]] = {"memory": [], "memory-process": [], "local": [], "durable": [], "none": []}
    try:
        with tempfile.TemporaryDirectory(dir=".") as temporary:
            directory = pathlib.Path(temporary)
            for round_index in range(args.repeats):
                modes = list(times) if round_index % 2 == 0 else list(reversed(times))
                for mode in modes:
                    seconds = job(directory, f"{mode}-{round_index}", mode, f"{tier}-{mode}-{round_index}",
                                  args.width, args.splits)["seconds"]
                    times[mode].append(seconds)
                    print(f"round {round_index}: {mode:8s} {seconds:.3f} s", flush=True)
            replayed = splits_replayed_after_a_node_loss(directory, f"{tier}-loss", min(args.width, 256),
                                                         max(args.splits, 16))
            cpu_ms = one_node_job(directory, "snapshot", "snapshot", f"{tier}-snapshot", 64, 64)["cpu_ms"]
            cpu_process_ms = one_node_job(directory, "snapshot-process", "snapshot-process", f"{tier}-snapshot-process",
                                          64, 64)["cpu_ms"]
    finally:
        for leftover in pathlib.Path("/dev/shm").glob(pathlib.Path(tier).name + "*"):
            shutil.rmtree(leftover, ignore_errors=True)
    memory, memory_process, local, durable, none = (
        statistics.median(times[mode]) for mode in ("memory", "memory-process", "local", "durable", "none"))
    parameters = args.width * args.width + 2 * args.width + 1
    print(f"(2 nodes x 1 rank, gloo on CPU, {parameters / 1e6:.1f}M parameters, {args.splits} splits per rank, "
          f"median of {args.repeats}: memory {memory:.2f} s, memory with writer processes {memory_process:.2f} s, "
          f"memory without peer copies {local:.2f} s, "
          f"durable {durable:.2f} s, none {none:.2f} s)")
    print(f"memory tier without peer copies every split / no checkpoints: {local / none:.3f}")
    print(f"memory tier + peer copy every split, writer processes / no checkpoints: {memory_process / none:.3f}")
    print(f"memory tier + peer copy every split / no checkpoints: {memory / none:.3f}")
    print(f"durable every split / no checkpoints: {durable / none:.3f}")
    print(f"splits replayed after a node loss: {replayed:.0f} ")
    print(f"training thread CPU per snapshot, writer process: {cpu_process_ms:.3f} ms (64x64 model, memory tier)")
    print(f"training thread CPU per snapshot: {cpu_ms:.3f} ms (64x64 model, writer thread, memory tier)")


if __name__ == "__main__":
    main()
