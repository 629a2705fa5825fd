"""Marks on two clocks: the wall clock (comparable across attempts and hosts) and the monotonic
one (exact durations inside a process, immune to clock steps)."""

from __future__ import annotations

import os
import time

# This module loads while the engine's modules are imported: the "imports done" mark.
IMPORTED = (time.time(), time.monotonic())


def now() -> dict[str, float]:
    """The current instant on both clocks, as a ledger row stores it."""
    return {"wall": time.time(), "mono": time.monotonic()}


def process_start() -> tuple[float, float]:
    """(wall, monotonic) instant this process started, from ``/proc/self/stat`` (Linux, to the
    kernel's clock tick); where there is no /proc, the instant the engine was imported."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as uptime:
            up = float(uptime.read().split()[0])
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
    except (OSError, ValueError, IndexError):
        return IMPORTED
    # starttime and /proc/uptime both count on the boot clock; the age is what they agree on.
    age = max(0.0, up - started_after_boot)
    return time.time() - age, time.monotonic() - age
