"""The evaluation loop: one validation pass over the validation data, isolated from training.

A pass runs under ``torch.no_grad()`` with the module in eval mode (its previous mode restored
after), and under random streams of its own: every global RNG is saved, seeded from the run's
validation seed and the pass number, and put back afterwards. So a shuffled validation loader or
dropout left on by the user draws the same numbers in every run and never shifts what training
draws: training with and without validation is bit-identical. With DataLoader worker processes
each sample is seeded from the pass's seed and its position in the pass (as training samples
are), so persistent workers started in another pass after a resume draw the same values.

Passes are not checkpointed halfway: the checkpoint written right after a pass holds its results;
a kill during a pass resumes from the checkpoint before it and runs the pass again from its
start, which gives the same numbers (same weights, same seeded streams).

Under torchrun each rank validates its own block of the validation batches
(:func:`engine.distributed.sampler.shard_validation_loader`) and the pass's values are reduced
across ranks at its end (:mod:`engine.loops.logged`): every rank sends every value it logged and
the number of batches it validated, and every rank replays them in rank order, so all ranks
report the single-process values and count the batches of every rank. The ranks take rank 0's
validation seed (:meth:`EvaluationLoop.choose_seed`): a shuffled validation loader then draws one
permutation, whose blocks are disjoint.

A preemption signal during a pass lets the pass finish: the stop is taken at the boundary that
follows it, whose checkpoint holds the pass's results, so its metrics row is written once and
the resumed run goes on exactly. The validation data's worker processes ignore the signal
(:class:`~engine.data.workers.PreemptionSafeLoader`) so that the pass can finish.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from typing import Any, Callable, Iterator, Protocol, Sequence

import msgpack
import torch

from engine import faults
from engine.data.workers import PreemptionSafeLoader
from engine.errors import DataError, ModuleContractError
from engine.loops.step_output import Hidden, detach_hidden
from engine.data.rng import capture_global_rng, restore_global_rng
from engine.loops.logged import MetricLogger, Recording, reduce_recordings
from progress import Counts, Progress

ValidationCall = Callable[[Any, Hidden], Any]
Splitter = Callable[[Any, int], Sequence[Any]]


class Ranks(Protocol):
    """What a validation pass exchanges with the other ranks of the job (engine.distributed's
    :class:`~engine.distributed.rank_values.RankExchange`, or :class:`OneRank` alone)."""

    def gather(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload``, in rank order."""
        ...

    def seed_of_rank_zero(self, seed: int) -> int:
        """Rank 0's ``seed``."""
        ...


class OneRank:
    """A process that validates alone: nothing to exchange."""

    def gather(self, payload: bytes) -> list[bytes]:
        return [payload]

    def seed_of_rank_zero(self, seed: int) -> int:
        return seed


class EvaluationLoop:
    """Runs validation passes; ``progress`` counts passes, ``batches`` the batches of a pass."""

    def __init__(self, module: torch.nn.Module, data: PreemptionSafeLoader, call_step: ValidationCall,
                 splitter: Splitter | None, split_length: int | None, carry_hidden: bool,
                 logger: MetricLogger, ranks: Ranks | None = None) -> None:
        self.progress = Progress()
        self.batches = Progress()
        self.seed: int | None = None
        self.validated_at_step: int | None = None
        self._hidden: Hidden = None
        self._module = module
        self._data = data
        self._call_step = call_step
        self._splitter = splitter
        self._split_length = split_length
        self._carry = carry_hidden
        self._logger = logger
        self._ranks: Ranks = OneRank() if ranks is None else ranks

    def choose_seed(self) -> None:
        """At a fresh start: derive the validation seed from the global torch RNG *without*
        drawing from it (a hash of its state), so it follows the user's seed; every rank of a
        torchrun job takes rank 0's."""
        if self.seed is None:
            digest = hashlib.sha256(bytes(torch.get_rng_state().tolist())).digest()
            self.seed = self._ranks.seed_of_rank_zero(int.from_bytes(digest[:8], "little") >> 1)

    def due_after_steps(self, optimizer_steps: int, every_n_steps: int) -> bool:
        """Mid-epoch validation: due when the step count crosses a multiple of ``every_n_steps``."""
        return optimizer_steps // every_n_steps > (self.validated_at_step or 0) // every_n_steps

    def current_at(self, optimizer_steps: int) -> bool:
        """Whether a pass already ran with the weights of step ``optimizer_steps`` (epoch-end
        validation is then not repeated)."""
        return self.validated_at_step == optimizer_steps

    def run(self, optimizer_steps: int) -> dict[str, float]:
        """One validation pass; returns its aggregated metrics."""
        progress = self.progress
        progress.increment_ready()
        progress.increment_started()
        assert self.seed is not None, "choose_seed() or load_state_dict() before run()"
        self._logger.begin_evaluation()
        try:
            pass_seed = self.seed + progress.total.started
            with _isolated_rng(pass_seed), torch.no_grad(), _eval_mode(self._module):
                self._data.seed_pass(pass_seed)
                for batch in self._data:
                    self._run_batch(batch)
        except BaseException:
            self._logger.end_evaluation()
            raise
        values = self._reduce_over_ranks()
        self.validated_at_step = optimizer_steps
        progress.increment_processed()
        progress.increment_completed()
        return values

    def _reduce_over_ranks(self) -> dict[str, float]:
        """The pass's values over every rank's batches; the batch counters then count every
        rank's batches too (they are replicated state, equal on every rank)."""
        local = msgpack.packb([self.batches.current.completed, self._logger.end_evaluation().encode()])
        parts = [msgpack.unpackb(payload) for payload in self._ranks.gather(local)]
        batches = sum(int(count) for count, _ in parts)
        if batches == 0:
            raise DataError("the validation data yielded no batch")
        values = reduce_recordings([Recording.decode(recording) for _, recording in parts])
        self._logger.publish_evaluation(values)
        total = self.batches.total.completed - self.batches.current.completed + batches
        self.batches.total = Counts(total, total, total, total)
        self.batches.reset_current()
        return values

    def _run_batch(self, batch: Any) -> None:
        batches = self.batches
        batches.increment_ready()
        batches.increment_started()
        if not self._carry or batches.current.completed == 0:
            self._hidden = None
        if self._splitter is None or self._split_length is None:
            self._record(self._call_step(batch, None))
        else:
            for split in self._splitter(batch, self._split_length):
                output = self._call_step(split, self._hidden)
                if not isinstance(output, (tuple, list)) or len(output) != 2:
                    raise ModuleContractError("validation_step must return (loss or dict, hidden) when TBPTT is on")
                result, hidden = output
                self._hidden = detach_hidden(hidden)
                self._record(result)
        batches.increment_processed()
        batches.increment_completed()
        faults.reach("validation_batch_end")

    def _record(self, result: Any) -> None:
        if isinstance(result, dict):
            for name, value in result.items():
                self._logger.log_returned(name, value, "in its dict")
        elif isinstance(result, torch.Tensor):
            self._logger.log_returned("val_loss", result, "(its loss is logged as 'val_loss')")
        elif result is not None:
            raise ModuleContractError(
                f"validation_step must return a scalar loss, a dict of scalars or None; got {type(result).__name__}"
            )

    def close(self) -> None:
        """Stop the validation data's worker processes (they ignore the preemption signals)."""
        self._data.close()

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "validated_at_step": self.validated_at_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        step = state["validated_at_step"]
        self.validated_at_step = None if step is None else int(step)


@contextlib.contextmanager
def _isolated_rng(seed: int) -> Iterator[None]:
    saved = capture_global_rng()
    try:
        torch.manual_seed(seed)
        random.seed(seed)
        try:
            import numpy

            numpy.random.seed(seed % 2**32)
        except ImportError:  # pragma: no cover - numpy is optional
            pass
        yield
    finally:
        restore_global_rng(saved)


@contextlib.contextmanager
def _eval_mode(module: torch.nn.Module) -> Iterator[None]:
    modes = [(submodule, submodule.training) for submodule in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for submodule, training in modes:
            submodule.training = training
