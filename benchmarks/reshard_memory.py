"""Memory of resharding a sharded checkpoint onto another world size, in one process.

A stack of linear layers (``--layers`` x 2048 x 2048 float32, 4.2M parameters each) and
their two Adam moments are saved as 2 ranks would (each rank's Shard(0) rows, encoded by the
checkpoint codec, as the bytes the store reads and verifies), then resharded onto a model
``fully_shard``-ed on a one-rank mesh (``engine.distributed.sharded.live_shards``, the step a
restore runs). The process's peak resident memory is reset just before and read after
(``/proc/self/clear_refs``, Linux), so the extra peak is what resharding itself holds beyond the
checkpoint's bytes, already in memory as the store hands them over.

Reproduce (from the repository root)::

    python benchmarks/reshard_memory.py              # 4 layers: 192 MiB of checkpoint
    python benchmarks/reshard_memory.py --layers 8

The last line is ``peak extra memory while resharding / new shard size: Y`` (goal <= 1.2; the
new shards are the state the run keeps; the checkpoint's bytes come on top, read whole by every
rank: the store verifies every file whole).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from engine.checkpoint.format.codec import encode_state  # noqa: E402
from engine.checkpoint.format.shards import TensorShard  # noqa: E402
from engine.checkpoint.format.state_keys import MODULE, OPTIMIZERS, SIGNATURE  # noqa: E402
from engine.distributed.sharded import live_shards  # noqa: E402

WIDTH = 2048


def rss_bytes(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (the peak since the last reset) of this process."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> None:
    pathlib.Path("/proc/self/clear_refs").write_text("5")


def saved_state(layers: int) -> tuple[dict, dict[str, bytearray], int]:
    """Rank 0's state tree, rank 1's files (as bytes read), and the checkpoint's tensor bytes."""
    half = WIDTH // 2

    def part(rank: int) -> dict:
        def shard(seed: int) -> TensorShard:
            rows = torch.randn(half, WIDTH, generator=torch.Generator().manual_seed(seed * 2 + rank))
            return TensorShard(rows, (WIDTH, WIDTH), (rank * half, 0), (2,), ("shard:0",))
        module = {f"{index}.weight": shard(index) for index in range(layers)}
        moments = {index: {"step": torch.tensor(1.0), "exp_avg": shard(100 + index), "exp_avg_sq": shard(200 + index)}
                   for index in range(layers)}
        return {MODULE: module, OPTIMIZERS: [{"state": moments, "param_groups": [{"lr": 0.1, "params": list(range(layers))}]}]}

    rank_1 = encode_state(part(1))
    files = {"rank-00001.bin": bytearray(b"".join(bytes(chunk) for chunk in rank_1.tensor_chunks())),
             "rank-00001.msgpack": bytearray(rank_1.header)}
    return {SIGNATURE: {"world_size": 2, "sharded": True}, **part(0)}, files, 2 * rank_1.tensor_bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # glibc would otherwise reuse the memory freed while the checkpoint was encoded, and the
        # peak RSS would not show what resharding allocates: large blocks are mmapped instead.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(args.layers)))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        state, files, checkpoint_bytes = saved_state(args.layers)
        new_shards = 3 * sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
        reset_peak_rss()
        before = rss_bytes("VmRSS")
        resharded = live_shards("ckpt", state, model, 1, files)
        extra = rss_bytes("VmHWM") - before
        assert torch.equal(resharded[MODULE]["0.weight"].to_local()[:WIDTH // 2], state[MODULE]["0.weight"].local)
        dist.destroy_process_group()
    print(f"checkpoint (every rank's part, read whole by each rank): {checkpoint_bytes / 2**20:.0f} MiB")
    print(f"new shards on this rank (parameters and two moments): {new_shards / 2**20:.0f} MiB")
    print(f"peak extra memory while resharding / new shard size: {max(extra, 0) / new_shards:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
