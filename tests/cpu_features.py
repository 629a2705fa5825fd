"""What this CPU can run, for tests that need more than the engine promises everywhere.

oneDNN (PyTorch's CPU kernels) has a bfloat16 LSTM only on CPUs with AVX-512 (``avx512bw``,
its "avx512_core" level and up): on an AVX2-only CPU a bf16 LSTM forward under autocast fails
with ``could not create a primitive descriptor for the LSTM forward propagation primitive``.
Tests that run one are marked ``cpu_bf16_lstm``; tests/conftest.py skips them where the probe
below fails, with a reason naming what the CPU lacks, so the guarantee stays tested wherever it
can run. (``ONEDNN_MAX_CPU_ISA=AVX2`` makes any x86 CPU behave like an AVX2-only one.)
"""

from __future__ import annotations

import functools
import os

import torch

# The CPU flags (``/proc/cpuinfo``) of oneDNN's avx512_core level, the least a bf16 LSTM needs.
AVX512_CORE_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq")


@functools.lru_cache(maxsize=None)
def bf16_lstm_unavailable() -> str | None:
    """None when a bfloat16 LSTM runs on this CPU under autocast; else why not, in one line."""
    try:
        with torch.random.fork_rng(devices=[]):  # the LSTM's initialisation draws nothing the tests see
            lstm = torch.nn.LSTM(2, 2, batch_first=True)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            lstm(torch.zeros(1, 2, 2))
        return None
    except RuntimeError as error:
        oneDNN = str(error).split(".")[0] if str(error) else type(error).__name__
    missing = [flag for flag in AVX512_CORE_FLAGS if flag not in _cpu_flags()]
    if missing:
        lacks = f"this CPU lacks {', '.join(missing)} (AVX-512)"
    elif os.environ.get("ONEDNN_MAX_CPU_ISA"):
        lacks = f"ONEDNN_MAX_CPU_ISA={os.environ['ONEDNN_MAX_CPU_ISA']} hides this CPU's AVX-512"
    else:
        lacks = "this CPU lacks what oneDNN needs for it"
    return f"no bfloat16 LSTM on this CPU: {lacks}, so oneDNN has none ({oneDNN})"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()
