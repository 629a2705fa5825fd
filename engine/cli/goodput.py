"""``python -m engine goodput RUN_DIR [--json]`` (the run's account) and ``python -m engine
goodput --simulate --gpus N ...`` (the model). Neither imports torch."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable

from engine.errors import ConfigError
from engine.goodput.report import duration, lines

SIMULATE_TRIALS = 200
DEFAULT_HORIZON_HOURS = 24.0
MAX_FAILURES_PER_TRIAL = 100_000
DRAWS_PER_RUN = 400_000  # failures drawn per interval compared, over all trials: a few seconds of Python


def add_goodput_parser(commands: Any, positive: Callable[[str], float]) -> None:
    """The ``goodput`` subcommand; ``positive``: the argparse type of a positive number."""
    goodput = commands.add_parser(
        "goodput", help="a run's goodput from its ledger, or a model of a large job's (--simulate)",
        description="RUN_DIR: the wall time of every attempt of the run split into buckets that add up to it "
                    "(productive, validation, checkpoint stall, start-up, restore, work lost, hang detection, down), "
                    "goodput = productive / wall, failures by cause, and the samples trained, skipped and seen "
                    "twice. --simulate: a Monte-Carlo model of a job of --gpus GPUs, fed with --from RUN_DIR's "
                    "measured costs or a --profile; prints goodput for fixed checkpoint intervals and the "
                    "Young/Daly one side by side, and the best interval. See docs/goodput.md.")
    goodput.add_argument("dir", nargs="?", default=None, help="run directory (path or fsspec URL)")
    goodput.add_argument("--json", action="store_true", help="print one JSON object")
    goodput.add_argument("--simulate", action="store_true", help="run the model instead of reading a run")
    goodput.add_argument("--from", dest="from_dir", default=None, metavar="RUN_DIR",
                         help="with --simulate: take the costs (checkpoint, restart, hangs, failure rate) from this run")
    goodput.add_argument("--gpus", type=int, default=None, help="with --simulate: GPUs in the job")
    goodput.add_argument("--mtbf-gpu-hours", type=positive, default=None,
                         help="with --simulate: mean time between failures of one GPU, in hours "
                              "(default: the --from run's, else Llama 3's published figure)")
    goodput.add_argument("--profile", default=None,
                         help="with --simulate: published checkpoint costs (sync-dcp-7b, async-dcp-7b, async-dcp-70b-cached)")
    goodput.add_argument("--checkpoint-s", type=positive, default=None, help="with --simulate: blocking seconds per checkpoint")
    goodput.add_argument("--restart-s", type=float, default=None, help="with --simulate: seconds from a restart to the first split")
    goodput.add_argument("--hang-share", type=float, default=None, help="with --simulate: share of failures that hang")
    goodput.add_argument("--hang-detect-s", type=float, default=None, help="with --simulate: seconds to detect a hang")
    goodput.add_argument("--node-share", type=float, default=0.0, help="with --simulate: share of failures that lose a node")
    goodput.add_argument("--requeue-s", type=float, default=0.0, help="with --simulate: wait for a new node, seconds")
    goodput.add_argument("--hours", type=positive, default=None,
                         help=f"with --simulate: wall hours per trial (default {DEFAULT_HORIZON_HOURS:g}, or the --from run's wall time)")
    goodput.add_argument("--trials", type=int, default=SIMULATE_TRIALS, help=f"with --simulate: trials (default {SIMULATE_TRIALS})")
    goodput.add_argument("--seed", type=int, default=0, help="with --simulate: random seed (default 0)")


def run_goodput(args: argparse.Namespace) -> int:
    if args.simulate:
        return run_simulation(args)
    if args.dir is None:
        raise ConfigError("goodput: give a run directory, or --simulate")
    found = read_account(args.dir)
    print(json.dumps(found) if args.json else "\n".join(lines(found)))
    return 0


def read_account(url: str) -> dict[str, Any]:
    from engine.checkpoint.store.storage import Storage
    from engine.goodput.account import account
    found = account(Storage(url, create=False))
    if found is None:
        raise ConfigError(f"{url} has no goodput ledger (ledger/): was it trained by this version of the engine?")
    return found.to_dict()


def summary_lines(found: dict[str, Any]) -> list[str]:
    """The account as ``inspect`` prints it."""
    return lines(found)


def _fraction(value: float | None, flag: str) -> float | None:
    if value is not None and not 0.0 <= value <= 1.0:
        raise ConfigError(f"goodput {flag}: a share between 0 and 1, got {value}")
    return value


def simulation_inputs(args: argparse.Namespace) -> tuple[Any, float, float | None, str]:
    """(JobModel, horizon seconds, the --from run's own interval, where the costs come from)."""
    from engine.goodput.simulate import LLAMA3_MTBF_GPU_HOURS, PROFILES, JobModel
    _fraction(args.hang_share, "--hang-share")
    _fraction(args.node_share, "--node-share")
    if args.gpus is not None and args.gpus < 1:
        raise ConfigError(f"goodput --gpus: at least 1, got {args.gpus}")
    if args.trials < 1:
        raise ConfigError(f"goodput --trials: at least 1, got {args.trials}")
    horizon = args.hours * 3600 if args.hours else DEFAULT_HORIZON_HOURS * 3600
    measured_interval, source = None, "flags"
    if args.from_dir is not None:
        from engine.checkpoint.store.storage import Storage
        from engine.goodput.observed import model_of, observed_costs
        costs = observed_costs(Storage(args.from_dir, create=False))
        if costs is None:
            raise ConfigError(f"goodput --from {args.from_dir}: no goodput ledger there")
        if costs.failures_per_hour is None and args.mtbf_gpu_hours is None and args.gpus is None:
            raise ConfigError(f"goodput --from {args.from_dir}: the run saw no failure; give --mtbf-gpu-hours")
        mtbf = args.mtbf_gpu_hours
        source = f"measured in {args.from_dir}"
        if mtbf is None and args.gpus is not None:  # another job's size: a chaos run's failure rate means nothing there
            mtbf = LLAMA3_MTBF_GPU_HOURS
            source += f"; MTBF {mtbf:,.0f} GPU-hours from Llama 3 (docs/goodput.md)"
        model = model_of(costs, args.gpus, mtbf)
        measured_interval = costs.interval_s
        if not args.hours:
            horizon = read_account(args.from_dir)["wall_s"] if args.gpus is None else horizon
    else:
        if args.gpus is None:
            raise ConfigError("goodput --simulate: give --gpus N (and --from RUN_DIR for measured costs)")
        model = JobModel(gpus=args.gpus, mtbf_gpu_hours=args.mtbf_gpu_hours or LLAMA3_MTBF_GPU_HOURS,
                         checkpoint_s=0.0, restart_s=0.0)
    if args.profile is not None:
        if args.profile not in PROFILES:
            raise ConfigError(f"goodput --profile: one of {', '.join(sorted(PROFILES))}, got {args.profile!r}")
        model = _replace(model, checkpoint_s=PROFILES[args.profile].checkpoint_s)
        source += f"; checkpoint cost of profile {args.profile} ({PROFILES[args.profile].source})"
    overrides = {"checkpoint_s": args.checkpoint_s, "restart_s": args.restart_s, "hang_share": args.hang_share,
                 "hang_detect_s": args.hang_detect_s}
    model = _replace(model, node_share=args.node_share, requeue_s=args.requeue_s,
                     **{name: value for name, value in overrides.items() if value is not None})
    if model.checkpoint_s <= 0:
        raise ConfigError("goodput --simulate: give --checkpoint-s, a --profile, or --from RUN_DIR")
    failures = horizon / model.job_mtbf_s
    if failures > MAX_FAILURES_PER_TRIAL:
        raise ConfigError(f"goodput --simulate: the job fails every {model.job_mtbf_s:.3g} s, {failures:,.0f} times "
                          f"in {duration(horizon)}: more than the model draws ({MAX_FAILURES_PER_TRIAL:,}); "
                          "a shorter --hours, fewer --gpus or a longer --mtbf-gpu-hours")
    return model, horizon, measured_interval, source


def _replace(model: Any, **changes: Any) -> Any:
    import dataclasses
    return dataclasses.replace(model, **changes)


def run_simulation(args: argparse.Namespace) -> int:
    from engine.goodput.simulate import best_interval, compare, default_intervals, young_daly_interval
    began = time.monotonic()
    model, horizon, measured, source = simulation_inputs(args)
    # Fewer trials where each has many failures: the mean is then as steady, and the command fast.
    args.trials = max(1, min(args.trials, int(DRAWS_PER_RUN / max(1.0, horizon / model.job_mtbf_s))))
    daly = young_daly_interval(model.checkpoint_s, model.job_mtbf_s)
    fixed = default_intervals(measured)
    outcomes = compare(model, [*fixed, daly], horizon, args.trials, args.seed)
    best = best_interval(model, horizon, args.trials, args.seed)
    if args.json:
        print(json.dumps({"model": _model_dict(model), "horizon_s": horizon, "source": source,
                          "young_daly_s": daly, "best": _outcome_dict(best),
                          "intervals": [_outcome_dict(outcome) for outcome in outcomes]}))
        return 0
    print(f"model: {model.gpus} GPUs, MTBF {model.mtbf_gpu_hours:,.0f} GPU-hours (a job failure every "
          f"{duration(model.job_mtbf_s)}), checkpoint {model.checkpoint_s:.3g} s, restart {model.restart_s:.3g} s, "
          f"hangs {100 * model.hang_share:.0f}% (detected in {model.hang_detect_s:.3g} s); "
          f"{args.trials} trials of {duration(horizon)}; costs: {source}")
    print(f"{'checkpoint interval':<28}{'goodput':>9}  {'lost':>7}  {'stall':>7}  {'restart':>8}  {'failures':>9}")
    for outcome in outcomes:
        label = "Young/Daly " + duration(outcome.interval_s) if outcome is outcomes[-1] else \
            ("measured " if measured is not None and outcome.interval_s == measured else "fixed ") + duration(outcome.interval_s)
        print(_row(label, outcome))
    print(_row(f"best {duration(best.interval_s)}", best))
    print(f"goodput: {100 * outcomes[-1].goodput:.1f}% at the Young/Daly interval; best interval "
          f"{duration(best.interval_s)} ({100 * best.goodput:.1f}%); simulated in {time.monotonic() - began:.1f} s")
    return 0


def _row(label: str, outcome: Any) -> str:
    share = {name: 100 * seconds / outcome.horizon_s for name, seconds in outcome.buckets.items()}
    return (f"{label:<28}{100 * outcome.goodput:>8.1f}%  {share['work_lost']:>6.1f}%  {share['checkpoint_stall']:>6.1f}%  "
            f"{share['startup'] + share['down'] + share['hang_detection']:>7.1f}%  {outcome.failures:>9.1f}")


def _model_dict(model: Any) -> dict[str, Any]:
    import dataclasses
    return dataclasses.asdict(model) | {"job_mtbf_s": model.job_mtbf_s}


def _outcome_dict(outcome: Any) -> dict[str, Any]:
    return {"interval_s": outcome.interval_s, "goodput": outcome.goodput, "buckets": outcome.buckets,
            "failures": outcome.failures}
