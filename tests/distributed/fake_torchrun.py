"""A stand-in for torchrun that starts in a blink (no torch): ``fake_torchrun.py OUT_DIR
WORKER_KIND AGENT_KIND``. It starts two workers, each in a session of its own as torchrun does,
which register with the launcher as the engine's fit does (a file named by the pid, holding the
signal to send) and write ``OUT_DIR/ready-<pid>``.

WORKER_KIND: ``commit`` (on SIGTERM: write the launcher's marker as rank 0 would, exit 0) or
``stubborn`` (ignore SIGTERM, never end). AGENT_KIND: ``waits`` (wait for the workers, exit 0)
or ``dies`` (exit 1 once the workers are ready, leaving them orphans).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

WORKER = """
import json, os, pathlib, signal, sys, time
out, kind = pathlib.Path(sys.argv[1]), sys.argv[2]
def commit(number, frame):
    marker = os.environ["SPLITLOOP_PREEMPTION_MARKER"]
    with open(marker, "w") as handle:
        json.dump({"reason": "preempted by SIGTERM", "checkpoint": "ckpt-0000000001"}, handle)
    sys.exit(0)
signal.signal(signal.SIGTERM, commit if kind == "commit" else signal.SIG_IGN)
(pathlib.Path(os.environ["SPLITLOOP_LAUNCH_WORKERS"]) / str(os.getpid())).write_text(str(int(signal.SIGTERM)))
(out / f"ready-{os.getpid()}").write_text("")
while True:
    time.sleep(0.05)
"""


def main() -> int:
    out, worker_kind, agent_kind = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, str(out), worker_kind], start_new_session=True)
               for _ in range(2)]
    while len(list(out.glob("ready-*"))) < len(workers):
        time.sleep(0.05)
    (out / "agent").write_text(json.dumps({"pid": os.getpid(), "workers": [w.pid for w in workers]}))
    if agent_kind == "dies":
        return 1
    return max(worker.wait() for worker in workers)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.exit(main())
