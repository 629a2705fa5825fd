"""Call the user's training step and check what it returned."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

import torch

from engine.loops.describe import describe_nested
from engine.errors import ModuleContractError
from engine.loops.context import Position

Hidden = Any  # a tensor, or tuples / lists / dicts of tensors, or None
StepCall = Callable[[Any, Hidden, int], Any]


INDEX_PARAMETERS = ("batch_idx", "split_idx")
# What Lightning 1.x called the arguments the engine passes by keyword.
_LIGHTNING_NAMES = {"hidden": "hiddens", "optimizer_index": "optimizer_idx"}


def make_step_call(training_step: Callable[..., Any], tbptt: bool, several_optimizers: bool,
                   position: Position | None = None) -> StepCall:
    """Bind once per run which keyword arguments the step receives: ``hidden`` (TBPTT),
    ``optimizer_index`` (several optimizers, automatic optimization), and ``batch_idx`` /
    ``split_idx`` when the step's signature declares them (read from ``position``, 0-based like
    the cursor; ``split_idx`` is 0 without TBPTT).

    Raises:
        ModuleContractError: the step's signature cannot take ``hidden`` / ``optimizer_index``
            although the run will pass it.
    """
    parameters = _parameters(training_step)
    _check_accepts(parameters, ("hidden",) if tbptt else (), "TBPTT is on (tbptt_split_length is set)")
    _check_accepts(parameters, ("optimizer_index",) if several_optimizers else (),
                   "configure_optimizers returned several optimizers")
    wanted = _index_parameters(parameters)
    if wanted:
        if position is None:
            raise ModuleContractError(f"training_step declares {list(wanted)} but the loop gives no position")
        return _step_call_with_indices(training_step, tbptt, several_optimizers, position, wanted)
    if tbptt and several_optimizers:
        return lambda batch, hidden, index: training_step(batch, hidden=hidden, optimizer_index=index)
    if tbptt:
        return lambda batch, hidden, index: training_step(batch, hidden=hidden)
    if several_optimizers:
        return lambda batch, hidden, index: training_step(batch, optimizer_index=index)
    return lambda batch, hidden, index: training_step(batch)


def declared_index_parameters(training_step: Callable[..., Any]) -> tuple[str, ...]:
    """Which of ``batch_idx`` / ``split_idx`` the step names as parameters (read once per run)."""
    return _index_parameters(_parameters(training_step))


def _parameters(training_step: Callable[..., Any]) -> Mapping[str, inspect.Parameter] | None:
    try:
        return inspect.signature(training_step).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return None


def _index_parameters(parameters: Mapping[str, inspect.Parameter] | None) -> tuple[str, ...]:
    if parameters is None:
        return ()
    return tuple(name for name in INDEX_PARAMETERS if name in parameters
                 and parameters[name].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))


def _check_accepts(parameters: Mapping[str, inspect.Parameter] | None, names: tuple[str, ...], because: str) -> None:
    if parameters is None or any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    for name in names:
        if name not in parameters or parameters[name].kind not in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                                   inspect.Parameter.KEYWORD_ONLY):
            lightning_name = _LIGHTNING_NAMES[name]
            advice = (f"rename Lightning's {lightning_name!r} to {name!r}" if lightning_name in parameters
                      else "add the parameter to the step's signature")
            raise ModuleContractError(f"training_step{inspect.Signature(list(parameters.values()))} has no parameter "
                                      f"{name!r}, but {because}, so the engine passes {name}= to it; {advice}")


def _step_call_with_indices(training_step: Callable[..., Any], tbptt: bool, several_optimizers: bool,
                            position: Position, wanted: tuple[str, ...]) -> StepCall:
    wants_batch, wants_split = "batch_idx" in wanted, "split_idx" in wanted

    def call(batch: Any, hidden: Hidden, index: int) -> Any:
        arguments: dict[str, Any] = {}
        if tbptt:
            arguments["hidden"] = hidden
        if several_optimizers:
            arguments["optimizer_index"] = index
        if wants_batch:
            arguments["batch_idx"] = position.batch
        if wants_split:
            arguments["split_idx"] = position.split
        return training_step(batch, **arguments)

    return call


def read_tbptt_output(output: Any) -> tuple[torch.Tensor, Hidden]:
    """A TBPTT step returns ``(loss, hidden)``."""
    if isinstance(output, dict):
        raise ModuleContractError(
            f"training_step returned a dict with keys {sorted(map(str, output))}; with TBPTT return the tuple "
            "(loss, hidden) (Lightning's {'loss': loss, 'hiddens': hiddens} becomes (loss, hiddens))")
    if not isinstance(output, (tuple, list)) or len(output) != 2:
        raise ModuleContractError(
            "training_step must return (loss, hidden) when TBPTT is on "
            f"(tbptt_split_length is set); got {_describe(output)}"
        )
    loss, hidden = output
    if hidden is None:
        raise ModuleContractError(
            "training_step returned no hidden state (None) while TBPTT is on; return (loss, hidden) "
            "with the state to carry into the next split"
        )
    return check_loss(loss), hidden


def read_plain_output(output: Any) -> tuple[torch.Tensor, Hidden]:
    """A step without TBPTT returns the loss alone."""
    if isinstance(output, (tuple, list)):
        raise ModuleContractError(
            f"training_step returned {_describe(output)} but TBPTT is off (tbptt_split_length is None): "
            "return the loss alone, or set tbptt_split_length to carry hidden state"
        )
    if isinstance(output, dict):
        raise ModuleContractError(
            f"training_step returned a dict with keys {sorted(map(str, output))}; return the loss tensor itself "
            "(Lightning's {'loss': loss} becomes loss; log other values with self.log)")
    return check_loss(output), None


def check_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ModuleContractError(
            f"the loss returned by training_step must be a scalar (0-dim) tensor; got {_describe(loss)}"
        )
    return loss


def detach_hidden(hidden: Hidden) -> Hidden:
    """Cut the graph between splits: detach every tensor of the hidden state."""
    if isinstance(hidden, torch.Tensor):
        return hidden.detach()
    if isinstance(hidden, tuple) and hasattr(hidden, "_fields"):
        return type(hidden)(*(detach_hidden(item) for item in hidden))
    if isinstance(hidden, (tuple, list)):
        return type(hidden)(detach_hidden(item) for item in hidden)
    if isinstance(hidden, dict):
        return {key: detach_hidden(item) for key, item in hidden.items()}
    return hidden


def describe_tree(value: Any) -> str:
    """A short description of a batch or hidden state: tensor shapes inside tuples, lists and dicts."""
    return describe_nested(value, _describe_leaf)


def _describe_leaf(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}"
    return "None" if value is None else f"a {type(value).__name__}"


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of length {len(value)}"
    return f"a value of type {type(value).__name__}"
