"""The start of a writer process (``CheckpointConfig(writer="process")``): its CPU and wall time.

Starts ``python -m engine.checkpoint.writers.process.main`` as engine.checkpoint.writers.process.writer does (an
events pipe passed to it, its stdin a pipe) and closes its stdin at once: the process imports
its modules, reads the end of its input and exits without committing anything. Reported: the
median over ``--repeats`` starts of the CPU time of one start (user + system, from
``resource.getrusage(RUSAGE_CHILDREN)`` around it) and of its wall time. A short run waits for
this start at its end (``fit`` waits for the last commit), so it is a fixed cost per ``fit``.

With ``--baseline DIR`` (the root of another checkout of the repository), the starts alternate
between this checkout's engine and that one's (``PYTHONPATH``), in the same conditions: a side by
side comparison on a shared machine. Reproduce (from the repository root)::

    python benchmarks/writer_process_start.py
    mkdir /tmp/before && git archive COMMIT | tar -x -C /tmp/before
    python benchmarks/writer_process_start.py --baseline /tmp/before
"""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import time

REPOSITORY = pathlib.Path(__file__).resolve().parent.parent


def child_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def start_writer_process(root: pathlib.Path) -> tuple[float, float]:
    """Start a writer process from the checkout ``root`` and let it exit; (CPU, wall) seconds."""
    events_read, events_write = os.pipe()
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    cpu, wall = child_cpu_seconds(), time.perf_counter()
    try:
        process = subprocess.Popen([sys.executable, "-m", "engine.checkpoint.writers.process.main", str(events_write)],
                                   stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, pass_fds=[events_write],
                                   env=environment, cwd=root)
        os.close(events_write)
        assert process.stdin is not None
        process.stdin.close()  # nothing to commit: the process exits once it has read the end
        if process.wait() != 0:
            raise SystemExit(f"the writer process of {root} exited with {process.returncode}")
    finally:
        os.close(events_read)
    return child_cpu_seconds() - cpu, time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="starts per checkout (default 7)")
    parser.add_argument("--baseline", type=pathlib.Path, default=None,
                        help="the root of another checkout to compare with, started alternately")
    options = parser.parse_args()
    roots = {"this checkout": REPOSITORY}
    if options.baseline is not None:
        roots["baseline"] = options.baseline.resolve()
    measured: dict[str, list[tuple[float, float]]] = {label: [] for label in roots}
    for _ in range(options.repeats):
        for label, root in roots.items():
            measured[label].append(start_writer_process(root))
    for label, samples in measured.items():
        cpu = statistics.median(sample[0] for sample in samples)
        wall = statistics.median(sample[1] for sample in samples)
        print(f"writer process start ({label}, {roots[label]}): CPU {cpu:.3f} s, wall {wall:.3f} s "
              f"(medians of {len(samples)})")


if __name__ == "__main__":
    main()
