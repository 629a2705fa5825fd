"""What the tests read of the process table (/proc): the writer processes a process started."""

from __future__ import annotations

import os

WRITER_MODULE = "engine.checkpoint.writers.process.main"


def writer_processes_of(parent: int) -> list[int]:
    """The pids of the writer processes whose parent is ``parent``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat, open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                # The parent's pid follows the command's name, which is in parentheses.
                parent_of_entry = int(stat.read().rpartition(b")")[2].split()[1])
                arguments = cmdline.read().split(b"\0")
        except (OSError, ValueError, IndexError):  # it ended meanwhile
            continue
        if parent_of_entry == parent and WRITER_MODULE.encode() in arguments:
            found.append(int(entry))
    return found
