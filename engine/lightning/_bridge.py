"""The LightningModule seen as an :class:`engine.Module`: the engine's loops call the bridge, the
bridge calls the user's module with Lightning's signatures and hooks.

The bridge's ``state_dict`` is the LightningModule's own (same keys), so checkpoints hold the
user's weights under their usual names.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Iterator, Sequence

import contextlib

import torch

from engine.data.splitting import Batch, split_along_time
from engine.errors import ModuleContractError
from engine.lightning._logging import TEST, TRAINING, VALIDATION, LightningLog
from engine.lightning._packages import overrides
from engine.module import Module


_STAGES = {VALIDATION: "validation", TEST: "test"}  # the step's name -> its hooks' stage


@dataclasses.dataclass
class LightningProgress:
    """What ``self.current_epoch``, ``self.global_step`` and the once-per-epoch/pass hooks read."""

    current_epoch: int = 0
    global_step: int = 0
    epoch_started: bool = False
    evaluation_started: bool = False  # in a validation (or test) pass
    evaluation_batch: int = 0
    should_stop: bool = False
    last_manual_loss: torch.Tensor | None = None
    batch_end: tuple[Any, Any, int] | None = None  # (outputs, batch, batch_idx) once the batch's last split ran


class LightningBridge(Module):
    """Runs ``lightning_module`` under engine.Trainer (see the package docstring)."""

    lightning_module: Any  # a LightningModule: its Lightning methods are not typed here

    def __init__(self, lightning_module: Any) -> None:
        super().__init__()
        self.lightning_module = lightning_module
        steps = getattr(lightning_module, "truncated_bptt_steps", None)
        self.tbptt_split_length = steps if steps else None  # Lightning 1.x: 0 meant off
        self.automatic_optimization = bool(getattr(lightning_module, "automatic_optimization", True))
        self.log_sink = LightningLog(lambda: self._engine_logger)
        self.progress = LightningProgress()
        self._splits_in_batch = 1
        self._passes_batch_idx = _takes_batch_idx(lightning_module.training_step)
        self._evaluation_takes_batch_idx: dict[str, bool] = {}  # read once per hook, not per batch
        self._splits_its_own_way = overrides(lightning_module, "tbptt_split_batch")
        if self.tbptt_split_length is not None:
            _require_hiddens(lightning_module)

    # ---- what the engine reads of a module ---------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.lightning_module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.lightning_module.load_state_dict(state_dict, strict=strict, assign=assign)

    def to(self, *args: Any, **kwargs: Any) -> LightningBridge:
        # Through the LightningModule's own to(), which keeps its self.device up to date.
        self.lightning_module.to(*args, **kwargs)
        return self

    def configure_optimizers(self) -> object:
        # Handed to the engine's own parsing (engine.loops.optim_setup), every Lightning form included.
        return self.lightning_module.configure_optimizers()

    def split_batch(self, batch: Batch, split_length: int) -> Sequence[Batch]:
        if not self.training:  # Lightning 1.x validated whole batches, never split
            return [batch]
        model = self.lightning_module
        splits = (model.tbptt_split_batch(batch, split_length) if self._splits_its_own_way
                  else split_along_time(batch, split_length, 1))
        self._splits_in_batch = len(splits)
        return splits

    # ---- steps --------------------------------------------------------------------------
    def training_step(  # type: ignore[override]
            self, batch: Batch, batch_idx: int, split_idx: int, **engine_arguments: Any) -> object:
        """The LightningModule's step with Lightning's arguments (``hiddens``, ``optimizer_idx`` for
        1.x modules), preceded by the epoch's and batch's start hooks."""
        model, progress = self.lightning_module, self.progress
        optimizer_index = engine_arguments.get("optimizer_index", 0)
        if not progress.epoch_started:
            progress.epoch_started = True
            model.on_train_epoch_start()
        if split_idx == 0 and optimizer_index == 0:
            if model.on_train_batch_start(batch, batch_idx) == -1:
                raise ModuleContractError(f"{type(model).__name__}.on_train_batch_start returned -1 (skip the rest of "
                                          "the epoch): not supported by engine.lightning; request a stop with "
                                          "self.trainer.should_stop = True")
        arguments: dict[str, Any] = {}
        if "optimizer_index" in engine_arguments:
            self._require_optimizer_idx()
            arguments["optimizer_idx"] = optimizer_index
        if self.tbptt_split_length is not None:
            arguments["hiddens"] = engine_arguments.get("hidden")
        progress.last_manual_loss = None
        with self.running(TRAINING, batch):
            output = model.training_step(batch, batch_idx, **arguments) if self._passes_batch_idx \
                else model.training_step(batch, **arguments)
        if split_idx == self._splits_in_batch - 1 or self.tbptt_split_length is None:
            progress.batch_end = (output, batch, batch_idx)
        return self._engine_output(output)

    def validation_step(self, batch: Batch, hidden: Any = None) -> object:
        return self.evaluation_step("validation_step", batch, hidden)

    def evaluation_step(self, hook: str, batch: Batch, hidden: Any = None) -> object:
        """One batch of ``validation_step`` / ``test_step`` between ``on_{stage}_batch_start`` and
        ``on_{stage}_batch_end``, the first of a pass after ``on_{stage}_start`` and
        ``on_{stage}_epoch_start``, as Lightning calls them; what the step returns goes to
        ``on_{stage}_batch_end`` only (Lightning logs nothing of it)."""
        model, progress = self.lightning_module, self.progress
        stage = _STAGES[hook]
        if not progress.evaluation_started:
            progress.evaluation_started, progress.evaluation_batch = True, 0
            getattr(model, f"on_{stage}_start")()
            getattr(model, f"on_{stage}_epoch_start")()
        batch_idx = progress.evaluation_batch
        getattr(model, f"on_{stage}_batch_start")(batch, batch_idx)
        step = getattr(model, hook)
        takes_batch_idx = self._evaluation_takes_batch_idx.setdefault(hook, _takes_batch_idx(step))
        with self.running(hook, batch):
            output = step(batch, batch_idx) if takes_batch_idx else step(batch)
        getattr(model, f"on_{stage}_batch_end")(output, batch, batch_idx)
        progress.evaluation_batch += 1
        return (None, None) if self.tbptt_split_length is not None else None

    def end_evaluation(self, hook: str) -> None:
        """The end of a validation (or test) pass: ``on_{stage}_epoch_end``, then ``on_{stage}_end``."""
        stage = _STAGES[hook]
        self.progress.evaluation_started = False
        getattr(self.lightning_module, f"on_{stage}_epoch_end")()
        getattr(self.lightning_module, f"on_{stage}_end")()

    def _require_optimizer_idx(self) -> None:
        """Lightning 2.x needs manual optimization for several optimizers; a 1.x step takes ``optimizer_idx``."""
        model = self.lightning_module
        if "optimizer_idx" not in inspect.signature(model.training_step).parameters:
            raise ModuleContractError(
                f"{type(model).__name__}: configure_optimizers returned {len(self._engine_optimizers)} optimizers under "
                "automatic optimization, and training_step has no optimizer_idx parameter; set "
                "self.automatic_optimization = False and step them in training_step")

    @contextlib.contextmanager
    def running(self, hook: str, batch: Any) -> Iterator[None]:
        """``self.log`` records into ``hook``'s pass while it runs."""
        sink = self.log_sink
        sink.hook, sink.batch = hook, batch
        try:
            yield
        finally:
            sink.hook, sink.batch = None, None

    def _engine_output(self, output: Any) -> object:
        """The step's return value as the engine reads it: the loss, or (loss, hidden) with TBPTT."""
        loss = output.get("loss") if isinstance(output, dict) else output
        if not self.automatic_optimization:
            loss = loss.detach() if isinstance(loss, torch.Tensor) and loss.dim() == 0 else self.progress.last_manual_loss
            loss = torch.tensor(float("nan")) if loss is None else loss
        elif loss is None:
            raise ModuleContractError(f"{type(self.lightning_module).__name__}.training_step returned no loss (None, "
                                      "Lightning's 'skip this batch'): not supported by engine.lightning; return a loss")
        if self.tbptt_split_length is None:
            return loss
        if not isinstance(output, dict) or "hiddens" not in output:
            raise ModuleContractError(f"{type(self.lightning_module).__name__}.training_step: with truncated_bptt_steps "
                                      "return {'loss': loss, 'hiddens': hiddens}")
        return loss, output["hiddens"]

    # ---- the LightningModule methods that reach the trainer -------------------------------
    def lightning_optimizers(self, use_pl_optimizer: bool = True) -> Any:
        """Lightning's ``self.optimizers()``: the torch optimizer, or a list when there are several."""
        return self.optimizers()

    def lightning_lr_schedulers(self) -> Any:
        """Lightning's ``self.lr_schedulers()``: None, the scheduler, or a list when there are several."""
        schedulers = self.lr_schedulers()
        return None if not schedulers else schedulers[0] if len(schedulers) == 1 else schedulers

    def lightning_clip_gradients(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                 gradient_clip_algorithm: str | None = None) -> None:
        """Lightning's ``self.clip_gradients`` (manual optimization): the optimizer's parameters'
        gradients clipped by norm (the default) or by value, as Lightning's precision plugin does."""
        if gradient_clip_val is None or gradient_clip_val == 0:
            return
        parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
        if gradient_clip_algorithm in (None, "norm"):
            torch.nn.utils.clip_grad_norm_(parameters, gradient_clip_val)
        elif gradient_clip_algorithm == "value":
            torch.nn.utils.clip_grad_value_(parameters, gradient_clip_val)
        else:
            raise ModuleContractError(f"self.clip_gradients(gradient_clip_algorithm={gradient_clip_algorithm!r}): "
                                      "expected 'norm' or 'value'")

    def lightning_manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Lightning's ``self.manual_backward``; the last loss is the split's ``loss`` in metrics.jsonl."""
        self.progress.last_manual_loss = loss.detach()
        loss.backward(*args, **kwargs)


def _takes_batch_idx(step: Any) -> bool:
    """Lightning passes ``batch_idx`` to a step that names it or takes two positional arguments."""
    parameters = list(inspect.signature(step).parameters.values())
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return any(p.name == "batch_idx" for p in parameters) or len(positional) >= 2 \
        or any(p.kind == p.VAR_POSITIONAL for p in parameters)


def _require_hiddens(model: Any) -> None:
    if "hiddens" not in inspect.signature(model.training_step).parameters:
        raise ModuleContractError(f"{type(model).__name__}.truncated_bptt_steps is set but training_step has no "
                                  "'hiddens' parameter: write it as Lightning 1.x did, "
                                  "training_step(self, batch, batch_idx, hiddens)")
