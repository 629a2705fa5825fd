"""Saving an FSDP2-sharded model: splitloop's per-rank shard files against
``torch.distributed.checkpoint.save`` (DCP), 2 ranks (gloo, CPU) under torchrun, in one run.

A stack of linear layers of about 100M parameters is ``fully_shard``-ed over 2 ranks; AdamW holds
its moments (one step taken). Each rank saves the same state dict (model and optimizer, DTensors)
twice per round, alternating which goes first:

* **sharded save**: what a rank's part of a splitloop checkpoint costs: the state encoded by
  the checkpoint codec (each DTensor as its local shard and its placement, nothing gathered),
  written through the run directory's Storage with a CRC-32C of every byte, and fsynced;
* **sharded save with an asynchronous snapshot**: the same, the state first copied into one
  snapshot buffer as ``CheckpointConfig(writer="thread")`` does (so training can go on);
* **DCP save**: ``torch.distributed.checkpoint.save`` of the same state dict into its own
  directory (its default FileSystemWriter, fsync on).

Each rank measures its save time and its peak extra resident memory while saving (RSS sampled
every millisecond by a thread, minus the RSS just before the save), and the size of its shard
(the bytes of its local tensors). Medians over ``--repeats`` rounds.

Reproduce (from the repository root)::

    python benchmarks/sharded_checkpoint.py               # about 1-2 minutes, < 4 GiB of RAM
    python benchmarks/sharded_checkpoint.py --layers 6    # a 25M model, quicker

The last lines are ``sharded save / DCP save: X`` (goal <= 1.0) and
``peak extra memory per rank / shard size: Y`` (goal <= 1.2), the worst rank of each.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

REPOSITORY = pathlib.Path(__file__).resolve().parents[1]
WIDTH = 2048


def resident_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measured(save: Callable[[], None]) -> tuple[float, int]:
    """(seconds, peak extra resident bytes) of ``save``."""
    import gc
    gc.collect()
    before, peak, done = resident_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], resident_bytes())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    save()
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    return seconds, max(0, max(peak[0], resident_bytes()) - before)  # memory freed meanwhile is no saving


def sharded_save(state: dict[str, Any], directory: str, rank: int, snapshot: bool = False) -> None:
    from engine.checkpoint.format.codec import EncodedState, encode_state
    from engine.checkpoint.format.rank_files import rank_files
    from engine.checkpoint.store.storage import Storage
    from engine.checkpoint.writers.buffers import SnapshotBuffers
    storage = Storage(directory)
    encoded = encode_state(state)
    if snapshot:  # as CheckpointConfig(writer="thread") does: one copy, so training can go on
        buffers = SnapshotBuffers()
        copies = buffers.capture(encoded.tensors, encoded.layout)
        encoded = EncodedState(encoded.header, copies, encoded.layout, flat=buffers.flat)
    tensors_file, header_file = rank_files(rank)
    storage.write(tensors_file, encoded.tensor_chunks(), durable=False)
    storage.write(header_file, [encoded.header], durable=False)
    storage.sync([tensors_file, header_file])


def dcp_save(state: dict[str, Any], directory: str) -> None:
    import torch.distributed.checkpoint as dcp
    dcp.save(state, checkpoint_id=directory)


def worker(directory: str, layers: int, repeats: int, report: str) -> None:
    """One rank (started by torchrun)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import engine.checkpoint.store.storage  # noqa: F401 - imported before the clock starts, as in a run
    import torch.distributed.checkpoint  # noqa: F401

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    state = {"module": model.state_dict(), "optimizers": [optimizer.state_dict()]}
    shard_bytes = sum(getattr(value, "to_local", lambda v=value: v)().nbytes for value in _tensors(state))
    parameters = sum(parameter.numel() for parameter in model.parameters())
    results: dict[str, list[tuple[float, int]]] = {"sharded": [], "dcp": [], "snapshot": []}
    for round_ in range(repeats):
        order = ["sharded", "dcp", "snapshot"] if round_ % 2 == 0 else ["dcp", "snapshot", "sharded"]
        for kind in order:
            target = os.path.join(directory, f"{kind}-{round_}")
            dist.barrier()
            if kind == "dcp":
                results[kind].append(measured(lambda: dcp_save(state, target)))
            else:
                results[kind].append(measured(lambda: sharded_save(state, target, rank, snapshot=kind == "snapshot")))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(target, ignore_errors=True)
    summary = {kind: {"seconds": statistics.median(s for s, _ in runs), "peak": statistics.median(p for _, p in runs)}
               for kind, runs in results.items()}
    pathlib.Path(f"{report}.{rank}").write_text(json.dumps({"shard_bytes": shard_bytes, "parameters": parameters,
                                                             **summary}))
    dist.destroy_process_group()


def _tensors(value: Any) -> list[Any]:
    import torch
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="sharded_checkpoint.py")
    parser.add_argument("--layers", type=int, default=24, help=f"linear layers of {WIDTH}x{WIDTH} (24: ~100M parameters)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (each saves both ways; medians reported)")
    parser.add_argument("--directory", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.directory) as directory:
        report = os.path.join(directory, "report")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
                   "--worker", directory, str(args.layers), str(args.repeats), report]
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": f"{REPOSITORY}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        subprocess.run(command, env=env, check=True)
        ranks = [json.loads(pathlib.Path(f"{report}.{rank}").read_text()) for rank in range(2)]
    print(f"model: {ranks[0]['parameters'] / 1e6:.1f}M parameters, AdamW, sharded over 2 ranks")
    for rank, figures in enumerate(ranks):
        shard = figures["shard_bytes"]
        print(f"rank {rank}: shard {shard / 2**20:.0f} MiB; sharded save {figures['sharded']['seconds']:.3f}s, "
              f"peak extra {figures['sharded']['peak'] / 2**20:.0f} MiB; DCP save {figures['dcp']['seconds']:.3f}s, "
              f"peak extra {figures['dcp']['peak'] / 2**20:.0f} MiB; sharded save with an asynchronous snapshot "
              f"{figures['snapshot']['seconds']:.3f}s, peak extra {figures['snapshot']['peak'] / 2**20:.0f} MiB")
    time_ratio = max(figures["sharded"]["seconds"] / figures["dcp"]["seconds"] for figures in ranks)
    memory_ratio = max(figures["sharded"]["peak"] / figures["shard_bytes"] for figures in ranks)
    dcp_memory_ratio = max(figures["dcp"]["peak"] / figures["shard_bytes"] for figures in ranks)
    snapshot_ratio = max(figures["snapshot"]["peak"] / figures["shard_bytes"] for figures in ranks)
    print(f"(DCP's peak extra memory per rank / shard size: {dcp_memory_ratio:.3f}; with an asynchronous snapshot, "
          f"splitloop's: {snapshot_ratio:.3f})")
    print(f"sharded save / DCP save: {time_ratio:.3f}")
    print(f"peak extra memory per rank / shard size: {memory_ratio:.3f}")


if __name__ == "__main__":
    main()
