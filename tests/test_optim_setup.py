"""configure_optimizers: our forms and Lightning's ({"optimizer", "lr_scheduler"}, the
scheduler dict with "interval", ([optimizers], [schedulers]), a list of dicts)."""

import pytest
import torch

import engine
from engine.loops.optim_setup import LRSchedule, read_optimizer_setup


def optimizer_and_scheduler():
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)


def summary(setup):
    return [id(o) for o in setup.optimizers], [(id(s.scheduler), s.interval) for s in setup.schedules]


def test_lightning_dict_with_a_bare_scheduler_steps_per_epoch():
    optimizer, scheduler = optimizer_and_scheduler()
    setup = read_optimizer_setup({"optimizer": optimizer, "lr_scheduler": scheduler})
    assert summary(setup) == ([id(optimizer)], [(id(scheduler), "epoch")])


@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_lightning_scheduler_dict_with_interval(interval):
    optimizer, scheduler = optimizer_and_scheduler()
    setup = read_optimizer_setup({"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": interval}})
    assert summary(setup) == ([id(optimizer)], [(id(scheduler), interval)])


def test_lightning_dict_without_scheduler():
    optimizer, _ = optimizer_and_scheduler()
    assert summary(read_optimizer_setup({"optimizer": optimizer})) == ([id(optimizer)], [])


def test_lightning_two_lists():
    (first, first_scheduler), (second, second_scheduler) = optimizer_and_scheduler(), optimizer_and_scheduler()
    setup = read_optimizer_setup(([first, second], [first_scheduler, {"scheduler": second_scheduler, "interval": "step"}]))
    assert summary(setup) == ([id(first), id(second)], [(id(first_scheduler), "epoch"), (id(second_scheduler), "step")])


def test_lightning_list_of_dicts():
    (first, first_scheduler), (second, _) = optimizer_and_scheduler(), optimizer_and_scheduler()
    setup = read_optimizer_setup([{"optimizer": first, "lr_scheduler": first_scheduler}, {"optimizer": second}])
    assert summary(setup) == ([id(first), id(second)], [(id(first_scheduler), "epoch")])


def test_our_forms_still_work():
    optimizer, scheduler = optimizer_and_scheduler()
    assert summary(read_optimizer_setup(optimizer)) == ([id(optimizer)], [])
    assert summary(read_optimizer_setup((optimizer,))) == ([id(optimizer)], [])
    setup = read_optimizer_setup({"optimizers": optimizer, "schedulers": [LRSchedule(scheduler, interval="step")]})
    assert summary(setup) == ([id(optimizer)], [(id(scheduler), "step")])


@pytest.mark.parametrize("returned, message", [
    (lambda o, s: {"optimizer": o, "lr_scheduler": {"scheduler": s, "frequency": 2}}, "frequency, monitor, name and strict are not supported"),
    (lambda o, s: {"optimizer": o, "lr_scheduler": {"scheduler": s, "interval": "batch"}}, "expected 'step' or 'epoch', got 'batch'"),
    (lambda o, s: {"optimizer": o, "monitor": "loss"}, "Lightning-style dict with keys \\['monitor', 'optimizer'\\]"),
    (lambda o, s: {"optimizer": s}, "'optimizer' must be a torch.optim.Optimizer"),
    (lambda o, s: ([], [s]), "must return a torch.optim.Optimizer"),
])
def test_unusable_forms_are_refused_clearly(returned, message):
    with pytest.raises(engine.ModuleContractError, match=message):
        read_optimizer_setup(returned(*optimizer_and_scheduler()))


def test_a_step_interval_scheduler_from_a_lightning_dict_steps_every_split():
    class Regression(engine.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch):
            return self.net(batch).pow(2).mean()

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    module = Regression()
    engine.Trainer(engine.TrainerConfig(max_epochs=1, progress_bar="off")).fit(module, [torch.randn(3, 2)] * 3)
    assert module.optimizers().param_groups[0]["lr"] == 0.125
