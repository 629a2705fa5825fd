"""What a worker tells ``python -m engine launch`` when the watchdog ends it.

torchrun exits 1 whatever its workers returned, so a worker's hang code (86) or crash-loop code
(87) never reaches the launcher through torchrun. A worker under the launcher therefore leaves a
small JSON file in the launcher's board directory (engine.watchdog.board.BOARD_VARIABLE) before
it exits: its pid, its exit code and the line it said. The launcher reads them to end a crash
loop at once (torchrun would restart it) and to exit with the code that says what happened.
Nothing is written outside the launcher.
"""

from __future__ import annotations

import json
import os
from typing import Any

from engine.watchdog.board import launcher_board

OUTCOMES_DIRECTORY = "outcomes"
_MAX_BYTES = 64 * 1024  # an outcome is a line; a bigger file is not one of ours


def record_outcome(exit_code: int, line: str) -> None:
    """Leave this process's outcome for the launcher (nothing without one; never raises: the
    process is ending and its own report on stderr matters more)."""
    root = launcher_board(os.environ)
    if root is None:
        return
    directory = os.path.join(root, OUTCOMES_DIRECTORY)
    path = os.path.join(directory, f"{os.getpid()}.json")
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        with open(f"{path}.tmp", "w", encoding="utf-8") as handle:
            json.dump({"pid": os.getpid(), "rank": os.environ.get("RANK"), "exit_code": exit_code, "line": line}, handle)
        os.replace(f"{path}.tmp", path)
    except OSError:
        pass


def read_outcomes(root: str) -> list[dict[str, Any]]:
    """The outcomes the workers left under ``root`` (unreadable or foreign files are skipped)."""
    directory = os.path.join(root, OUTCOMES_DIRECTORY)
    try:
        names = sorted(name for name in os.listdir(directory) if name.endswith(".json"))
    except OSError:
        return []
    found = []
    for name in names:
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as handle:
                row = json.loads(handle.read(_MAX_BYTES))
        except (OSError, ValueError):
            continue
        if isinstance(row, dict) and isinstance(row.get("exit_code"), int):
            found.append(row)
    return found
