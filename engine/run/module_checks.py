"""Checks of the user's module and of what ``configure_optimizers`` returned, run once per
``fit`` before training, so that a module that cannot train fails with a
:class:`~engine.errors.ModuleContractError` naming the cause, not with an error from inside
``backward`` or ``load_state_dict`` later."""

from __future__ import annotations

import torch

from engine.errors import ModuleContractError
from engine.loops.optim_setup import OptimizerSetup


def check_module(module: object) -> None:
    """Refuse what is not a trainable module: not an nn.Module, no ``training_step`` or
    ``configure_optimizers``, no parameter, or none that requires grad. Reads only; ``fit`` runs
    it before it creates the run directory."""
    if not isinstance(module, torch.nn.Module):
        raise ModuleContractError(f"fit expects a torch.nn.Module (subclass engine.Module), got {type(module).__name__}")
    for method in ("training_step", "configure_optimizers"):
        if not callable(getattr(module, method, None)):
            raise ModuleContractError(f"{type(module).__name__} has no {method}() method (subclass engine.Module)")
    _check_trainable(module)


def _check_trainable(module: torch.nn.Module) -> None:
    name = type(module).__name__
    parameters = list(module.parameters())
    if not parameters:
        raise ModuleContractError(f"{name} has no parameters, so there is nothing to train: register its layers "
                                  "as attributes in __init__ (after super().__init__()), or wrap plain tensors "
                                  "in torch.nn.Parameter")
    if not any(parameter.requires_grad for parameter in parameters):
        raise ModuleContractError(f"every parameter of {name} is frozen (requires_grad=False), so there is nothing "
                                  "to train: unfreeze the ones to train with parameter.requires_grad_(True)")


def check_optimizer_setup(module: torch.nn.Module, setup: OptimizerSetup) -> None:
    """Each optimizer appears once and optimizes only the module's own parameters: a parameter
    outside the module would not be saved in checkpoints, so a resume would silently restart it."""
    for index, optimizer in enumerate(setup.optimizers):
        if any(optimizer is other for other in setup.optimizers[:index]):
            raise ModuleContractError(f"configure_optimizers returned the same {type(optimizer).__name__} twice "
                                      f"(at positions {setup.optimizers.index(optimizer)} and {index}); return each "
                                      "optimizer once")
    own = {id(parameter) for parameter in module.parameters()}
    for index, optimizer in enumerate(setup.optimizers):
        foreign = sum(1 for group in optimizer.param_groups for parameter in group["params"] if id(parameter) not in own)
        if foreign:
            raise ModuleContractError(
                f"optimizer {index} ({type(optimizer).__name__}) holds {foreign} tensor(s) that are not parameters of "
                f"{type(module).__name__}: checkpoints save the module's parameters only, so those would not be "
                "restored on resume; build the optimizer from self.parameters() (register the tensors as "
                "torch.nn.Parameter attributes of the module)")
