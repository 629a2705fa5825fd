"""What each CLI command does (argument parsing lives in engine/cli/main.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from engine import faults
from engine.checkpoint.format.state_keys import CALLBACKS, HYPERPARAMETERS
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.config import CheckpointConfig, TrainerConfig, Watchdog
from engine.distributed.state_parts import saved_world_size
from engine.errors import ConfigError
from engine.checkpoint.format.fingerprint import fingerprint
from engine.checkpoint.store.storage import Storage
from engine.data.mixture import source_positions
from engine.run.run_dir import check_existing_run_dir
from engine.run import state as run_state
from engine.run.rollback import anomaly_row
from engine.watchdog.crash_loop import read_attempts, verdict as crash_loop_verdict
from engine.watchdog.phases import CRASH_LOOP_EXIT_CODE
from engine.watchdog.report import describe_hang, read_hangs
from engine.trainer import Trainer


def run_demo(args: argparse.Namespace) -> int:
    from engine.demo import build_demo

    if args.epochs <= 0 or args.checkpoint_every <= 0:
        print("error: --epochs and --checkpoint-every must be positive", file=sys.stderr)
        return 2
    module, loader = build_demo(args.seed)
    config = TrainerConfig(
        max_epochs=args.epochs,
        run_dir=args.dir,
        checkpoint=CheckpointConfig(every_n_splits=args.checkpoint_every, writer="thread" if args.async_checkpoints else "sync"),
        progress_bar=args.progress,
    )
    result = Trainer(config).fit(module, loader, resume="off" if args.fresh else "auto")
    if result.resumed_from:
        print(f"resumed from {result.resumed_from}")
    print(f"finished: {result.epochs_completed} epochs, {result.optimizer_steps} optimizer steps, last split {result.cursor}")
    optimizers = module.optimizers()
    optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
    print(f"fingerprint: {fingerprint(module.state_dict(), [o.state_dict() for o in optimizers])}")
    return 0


def data_position(data: dict[str, Any]) -> dict[str, Any]:
    """The latest checkpoint's data position: batches of the epoch consumed and, for a Mixture
    or several loaders, each source's (items of its current pass, passes begun)."""
    return {"batches_consumed": data["batches_consumed"], "sources": source_positions(data["loader_state"])}


def inspect_run(url: str) -> dict[str, Any]:
    """The data ``inspect`` prints: every checkpoint, the latest valid one, its fingerprint, and
    the rollbacks past anomalies its progress records (engine.run.rollback)."""
    check_existing_run_dir(url)
    store = CheckpointStore(Storage(url, create=False), create=False)
    entries = store.inspect(run_state.validate)
    latest = next((entry for entry in reversed(entries) if entry.valid), None)
    result: dict[str, Any] = {
        "dir": url,
        "checkpoints": [
            {"name": e.name, "cursor": None if e.cursor is None else e.cursor.to_dict(), "valid": e.valid, "error": e.error,
             "monitor": None if e.monitor is None else dataclasses.asdict(e.monitor),
             "world_size": None if e.signature is None else saved_world_size(e.signature), "anchor": e.anchor}
            for e in entries
        ],
        "latest": None if latest is None else latest.name,
        "best": next(iter(store.best(1)), None),
        "fingerprint": None,
        "anomalies": [],
        "data": None,
        "hangs": read_hangs(store.storage),
        "goodput": _goodput(store.storage),
        "crash_loop": crash_loop_verdict(read_attempts(store.storage), latest.name if latest is not None else None,
                                         Watchdog().max_restarts or 0),
    }
    if latest is not None:
        loaded = store.load(latest.name, run_state.validate)
        state = loaded.state
        result["fingerprint"] = fingerprint(state[run_state.MODULE], state[run_state.OPTIMIZERS])
        result["hyperparameters"] = _hyperparameters(state[CALLBACKS])
        result["anomalies"] = [anomaly_row(anomaly) | {"description": anomaly.describe()}
                               for anomaly in loaded.progress.anomalies]
        result["data"] = data_position(state[run_state.LOOPS]["data"])
    return result


def _hyperparameters(callback_states: dict[str, Any]) -> dict[str, Any] | None:
    """The module's hyperparameters a callback saved (engine.lightning: save_hyperparameters())."""
    return next((state[HYPERPARAMETERS] for state in callback_states.values()
                 if isinstance(state, dict) and isinstance(state.get(HYPERPARAMETERS), dict)), None)


def run_inspect(url: str, as_json: bool, memory_tiers: list[str] | None = None) -> int:
    report = inspect_run(url)
    report["memory_tiers"] = [{"dir": root, "parts": _memory_parts(root)} for root in memory_tiers or []]
    if as_json:
        print(json.dumps(report))
        return 0
    if not report["checkpoints"]:
        print(f"no checkpoints in {url}")
    for entry in report["checkpoints"]:
        cursor = entry["cursor"]
        where = "-" if cursor is None else f"epoch {cursor['epoch']} batch {cursor['batch']} split {cursor['split']}"
        status = "valid" if entry["valid"] else f"INVALID: {entry['error']}"
        monitor = entry["monitor"]
        if monitor is not None:
            status += f"  {monitor['name']}={monitor['value']:.6g}" + ("  BEST" if entry["name"] == report["best"] else "")
        ranks = "" if entry["world_size"] is None else f"  world size {entry['world_size']}"
        anchor = "  anchor" if entry["anchor"] else ""
        print(f"{entry['name']}  {where:<32}  {status}{ranks}{anchor}")
    print(f"latest: {report['latest']}")
    if report["best"]:
        print(f"best: {report['best']}")
    if report["fingerprint"]:
        print(f"fingerprint: {report['fingerprint']}")
    if report.get("hyperparameters"):
        print(f"hyperparameters: {json.dumps(report['hyperparameters'], sort_keys=True)}")
    for anomaly in report["anomalies"]:
        print(f"anomaly: {anomaly['description']}")
    for hang in report["hangs"]:
        print(describe_hang(hang))
    if report["crash_loop"]:
        print(f"crash loop: {report['crash_loop']} (the next start exits {CRASH_LOOP_EXIT_CODE})")
    for tier in report["memory_tiers"]:
        print(f"memory tier {tier['dir']}:" + ("" if tier["parts"] else " no parts"))
        for part in tier["parts"]:
            whose = f"rank {part['rank']}" + (" (copy kept for it)" if part["kind"] == "copy" else "")
            status = "valid" if part["valid"] else f"INVALID: {part['error']}"
            print(f"  {part['name']}  {whose:<28}  {status}")
    if report["goodput"] is not None:
        from engine.cli.goodput import summary_lines
        print("\n".join(summary_lines(report["goodput"])))
    return 0


def _memory_parts(root: str) -> list[dict[str, Any]]:
    """The parts a node's memory tier holds (engine.checkpoint.tiers.node.describe_parts)."""
    from engine.checkpoint.tiers.node import describe_parts
    if not os.path.isdir(root):
        raise ConfigError(f"inspect --memory-tier: {root!r} is not a directory")
    return describe_parts(root)


def _goodput(storage: Storage) -> dict[str, Any] | None:
    """The run's goodput account (engine.goodput), as ``goodput --json`` prints it; None without a ledger."""
    from engine.goodput.account import account
    found = account(storage)
    return None if found is None else found.to_dict()


def run_list_faults() -> int:
    print("fault points:")
    for name, description in faults.POINTS.items():
        print(f"  {name:<30} {description}")
    print("fault kinds: " + ", ".join(faults.KINDS))
    print(f"arm with {faults.ENVIRONMENT_VARIABLE}=POINT:HIT:KIND[,POINT:HIT:KIND...]")
    return 0


def run_chaos(args: argparse.Namespace) -> int:
    from engine.faults.chaos import chaos_faults
    from engine.testing.harness import FaultReport, Trial, check_fault_tolerance, check_work_dir

    if (args.trials is not None and args.trials <= 0) or args.epochs <= 0:
        print("error: --trials and --epochs must be positive", file=sys.stderr)
        return 2
    fault_list = chaos_faults(args.trials, args.seed)
    check_work_dir(args.dir, "chaos --dir")
    print(f"chaos: a reference run, then {len(fault_list)} trials; one row per trial as it finishes", flush=True)
    rows_printed = 0

    def print_row(trial: Trial) -> None:
        nonlocal rows_printed
        if rows_printed == 0:
            print(FaultReport.header())
        print(FaultReport.row(trial), flush=True)
        rows_printed += 1

    report = check_fault_tolerance("engine.demo:train", fault_list, work_dir=args.dir,
                                   args=[str(args.epochs), "0", str(args.hang_timeout)], on_trial=print_row)
    print(report.summary())
    return 0 if report.all_exact else 1


def run_plot(run_dir: str, out: str | None) -> int:
    """``plot``: draw the run's curves into a PNG file."""
    from engine.cli.plot import plot_run

    if out is None:
        if "://" in run_dir:
            raise ConfigError(f"plot: {run_dir} is not a local directory; name the picture with --out FILE.png")
        out = os.path.join(run_dir, "metrics.png")
    check_existing_run_dir(run_dir)
    drawn = plot_run(run_dir, out)
    anomalies = f", {drawn['anomalies']} rollback(s) past an anomaly" if drawn["anomalies"] else ""
    hangs = f", {drawn['hangs']} hang(s)" if drawn["hangs"] else ""
    print(f"wrote {out}: {drawn['train']} training rows, {drawn['val']} validation rows, {drawn['resumes']} resume(s)"
          f"{anomalies}{hangs}")
    return 0
