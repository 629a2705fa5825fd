"""Gradient clipping over FSDP2-sharded gradients against the same clipping unsharded, started by
torchrun from tests/distributed/test_fsdp.py::

    torchrun --nproc-per-node=2 tests/distributed/fsdp_clip.py OUT_FILE

Both clip with the engine's clipper (TrainerConfig(gradient_clip_val=1.0)) the same gradients,
integers so that every sum of squares is exact: rank 0 saves the total norms and the clipped
gradients (the sharded ones gathered) to OUT_FILE.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # tests/ folders must not shadow the real packages

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import engine
from engine.loops.tree import _clipper


def main() -> int:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    generator = torch.Generator().manual_seed(3)
    shapes = [(15, 8), (5,), (7, 3)]  # uneven over 2 and 4 ranks
    grads = [torch.randint(-3, 4, shape, generator=generator).float() for shape in shapes]
    clip = _clipper(engine.TrainerConfig(gradient_clip_val=1.0, device="cpu"))
    assert clip is not None
    plain = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    sharded = [torch.nn.Parameter(distribute_tensor(torch.zeros(shape), mesh, [Shard(0)])) for shape in shapes]
    for parameter, grad in zip(plain, grads):
        parameter.grad = grad.clone()
    for parameter, grad in zip(sharded, grads):
        parameter.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
    plain_norm, sharded_norm = clip(plain), clip(sharded)
    result = {"plain.norm": plain_norm, "sharded.norm": sharded_norm.full_tensor()}
    for index, (a, b) in enumerate(zip(plain, sharded)):
        result[f"plain.{index}"], result[f"sharded.{index}"] = a.grad, b.grad.full_tensor()
    if dist.get_rank() == 0:
        torch.save(result, sys.argv[1])
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, after the real packages
    from rank_exit import leave

    leave(main())
