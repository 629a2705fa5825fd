"""How one ``fit`` call starts: fresh, or restored from the checkpoint ``resume`` chooses; and
what its start line says.

:class:`RunStart` takes the writer lease, chooses the checkpoint (through the run's
checkpointing, which may be none), warns about what a fresh start or a resume by name leaves
behind, and restores the run's parts; :class:`~engine.run.run.FitRun` takes the result.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from engine.checkpoint.store.abandoned import describe_names
from engine.checkpoint.resume_choice import AnchorFallback
from engine.checkpoint.format.state_keys import SIGNATURE
from engine.checkpoint.store.checkpoint_store import LoadedCheckpoint
from engine.config import TrainerConfig
from engine.distributed import global_order
from engine.distributed.state_parts import saved_world_size
from engine.loops.context import StopState
from engine.loops.optim_setup import OptimizerSetup
from engine.loops.tree import units_completed_in
from engine.run import state as run_state
from engine.run.display import Display
from engine.checkpoint.store.metrics_log import MetricsLog
from engine.run.overrides import BuiltSettings, overridden_settings
from engine.errors import warn as warn_user
from progress import RunEnd

if TYPE_CHECKING:
    from engine.checkpoint.checkpointing import ResumeSource


@dataclasses.dataclass
class ResumedStart:
    """What the start line of a resumed run says: the checkpoint, the settings
    configure_optimizers built before the restore, and what the checkpoint's end means;
    and the training time the checkpoint records."""

    loaded: LoadedCheckpoint
    built: BuiltSettings
    end_note: str | None
    elapsed_seconds: float
    world_size_before: int | None = None  # the checkpoint's world size when this run has another
    fallback: AnchorResume | None = None  # "auto" went back to an anchor (another world size)


@dataclasses.dataclass(frozen=True)
class AnchorResume:
    """resume="auto" on another world size went back from ``newest``, taken inside a batch, to
    the newest anchor: the newer checkpoints ``skipped`` (oldest first) are left behind and
    ``splits_redone`` units of step work are trained again."""

    newest: str
    skipped: list[str]
    splits_redone: int

    def record(self) -> dict[str, object]:
        """What resumes.jsonl records about it."""
        return {"fell_back_from": self.newest, "skipped": self.skipped, "splits_redone": self.splits_redone}


class RunStart:
    """Starts one ``fit`` call; see the module docstring. Warnings point at the caller of
    ``Trainer.fit`` (their stack levels count the calls from there)."""

    def __init__(self, config: TrainerConfig, checkpoints: ResumeSource, parts: run_state.RunParts,
                 metrics: MetricsLog, stop: StopState) -> None:
        self._config = config
        self._checkpoints = checkpoints
        self._parts = parts
        self._metrics = metrics
        self._stop = stop

    def begin(self, resume: str) -> ResumedStart | None:
        """Take the lease, then restore the checkpoint ``resume`` chooses (its start) or start
        fresh (None)."""
        checkpoints = self._checkpoints
        checkpoints.acquire()
        if resume == "off":
            self._warn_fresh_over_checkpoints()
        loaded = checkpoints.select(resume, run_state.validate, self._needs_an_anchor)
        if loaded is not None and resume.startswith("ckpt-"):
            self._abandon_newer(loaded.name)
        if loaded is None:
            self._start_fresh()
            return None
        fallback = checkpoints.anchor_fallback
        restored = run_state.restore(loaded.name, loaded.state, loaded.progress, self._parts, loaded.extra_files)
        anchor_resume = None if fallback is None else self._fall_back(fallback, loaded)
        self._metrics.resume_at(restored.metrics_bytes, self._parts.tree.step_counter.total)
        # Kept for the start line only: without the checkpoint's bytes (every rank's part, in a
        # distributed run), which would otherwise stay in memory for the whole fit.
        kept = dataclasses.replace(loaded, state={}, extra_files={})
        return ResumedStart(kept, restored.built, self._resume_end(loaded.progress.end), restored.elapsed_seconds,
                            restored.world_size_before, anchor_resume)

    def _needs_an_anchor(self, loaded: LoadedCheckpoint) -> bool:
        return global_order.needs_an_anchor(loaded.state, self._parts.world_size)

    def _fall_back(self, fallback: AnchorFallback, anchor: LoadedCheckpoint) -> AnchorResume:
        """resume="auto" went back to ``anchor`` (restored): the newer checkpoints are
        abandoned (kept until this run's first commit), and one log line says so."""
        skipped = self._checkpoints.abandon_newer_than(anchor.name)
        redone = units_completed_in(fallback.newest_progress) - units_completed_in(anchor.progress)
        before = saved_world_size(anchor.state[SIGNATURE])
        warn_user(
            f"splitloop: resuming on {self._parts.world_size} process(es): the newest checkpoint, {fallback.newest} "
            f"(world size {before}), was taken inside a batch or an open gradient-accumulation window, whose "
            f"per-rank part cannot move to another world size; resuming from {anchor.name}, the newest checkpoint "
            f"at a batch boundary, and redoing {redone} split(s) of step work; the newer checkpoint(s) "
            f"{describe_names(skipped)} are left behind: resume one by name with {before} process(es) to return to "
            f"it; they are {self._fate_of_abandoned()}")
        return AnchorResume(fallback.newest, skipped, redone)

    def _resume_end(self, end: RunEnd | None) -> str | None:
        """A checkpoint of a finished run: stop at once (nothing more to train) unless a limit
        was raised since; returns what the start line says about it (None: the run had not ended)."""
        if end is None:
            return None
        config = self._config
        raised = end.raised_limits(config.max_epochs, config.max_steps, config.max_time)
        if raised:
            return f"the run had finished ({end.reason}); {', '.join(raised)}: training on"
        self._stop.request(end.reason)
        return (f"the run has finished ({end.reason}): nothing more to train; raise max_epochs, max_steps or "
                "max_time to train on")

    def _abandon_newer(self, name: str) -> None:
        """resume="ckpt-…" from an older checkpoint: the newer ones are left behind; say so
        before anything is deleted (engine.checkpoint.store.abandoned)."""
        newer = self._checkpoints.abandon_newer_than(name)
        if not newer:
            return
        warn_user(f"resume={name!r}: {self._config.run_dir} holds {len(newer)} newer checkpoint(s), "
                  f"{describe_names(newer)}, of the history this run branches off; resume='auto' no longer "
                  f"returns to them; they are {self._fate_of_abandoned()}")

    def _fate_of_abandoned(self) -> str:
        """What becomes of the checkpoints a resume from an older one abandons."""
        assert self._config.checkpoint is not None  # only a run with checkpoints resumes
        if self._config.checkpoint.keep_last is None:
            return "kept (keep_last=None)"
        return ("kept until this run commits its first checkpoint, then deleted by retention (to keep them, stop "
                "now and copy them elsewhere)")

    def _warn_fresh_over_checkpoints(self) -> None:
        """resume="off" in a run dir that holds checkpoints: say that retention will delete them."""
        existing = self._checkpoints.existing_names()
        if not existing:
            return
        assert self._config.checkpoint is not None  # only a run with checkpoints has some
        keep_last = self._config.checkpoint.keep_last
        if keep_last is not None:
            warn_user(f"resume='off': starting a fresh run in {self._config.run_dir}, which holds {len(existing)} "
                      f"checkpoint(s) of an earlier run (newest {existing[-1]}); retention (keep_last={keep_last}) "
                      "deletes them as this run commits new ones. To keep them, stop now and use another run_dir")

    def _start_fresh(self) -> None:
        self._metrics.start_fresh()
        evaluation = self._parts.tree.evaluation
        if evaluation is not None:
            evaluation.choose_seed()


def announce(display: Display, config: TrainerConfig, resumed: ResumedStart | None, setup: OptimizerSetup) -> None:
    """The start line, once the callbacks' on_fit_start ran (they may set hyper-parameters
    after the restore): a resumed run also says whether it had finished and which settings
    of configure_optimizers the checkpoint replaced, the latter as a warning too."""
    if resumed is None:
        display.start(config.run_dir, None)
        return
    notes = [resumed.end_note, _overridden(resumed.loaded.name, overridden_settings(resumed.built, setup))]
    display.start(config.run_dir, resumed.loaded, [note for note in notes if note])


def _overridden(name: str, overridden: list[str]) -> str | None:
    if not overridden:
        return None
    text = (f"{name} overrides what configure_optimizers built: {'; '.join(overridden)}; the run goes on with the "
            "checkpoint's values (to change them on resume, set them in a callback's on_fit_start: "
            "docs/guarantees.md, Changing hyper-parameters on resume)")
    warn_user(text)
    return text
