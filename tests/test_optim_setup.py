"""configure_optimizers: our forms and Lightning's ({"optimizer", "lr_scheduler"}, the
scheduler dict with "interval", "monitor" and "frequency", ([optimizers], [schedulers]), a list
of dicts), and the checks of a monitored scheduler (ReduceLROnPlateau)."""

import pytest
import torch

import engine
from engine.loops.optim_setup import LRSchedule, read_optimizer_setup
from models import Regression


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
    (lambda o, s: {"optimizer": o, "lr_scheduler": {"scheduler": s, "frequency": 2}}, "frequency=2 applies to a monitored scheduler only"),
    (lambda o, s: {"optimizer": o, "lr_scheduler": {"scheduler": s, "gamma": 2}}, "lr_scheduler dict has keys \\['gamma', 'scheduler'\\]"),
    (lambda o, s: {"optimizer": o, "lr_scheduler": {"scheduler": s, "interval": "batch"}}, "expected 'step' or 'epoch', got 'batch'"),
    (lambda o, s: {"optimizer": o, "monitor": "loss"}, "'monitor': 'loss' beside an lr_scheduler that is not a ReduceLROnPlateau"),
    (lambda o, s: {"optimizer": o, "lr_scheduler": s, "monitor": "loss"}, "not a ReduceLROnPlateau .*\\(StepLR\\)"),
    (lambda o, s: {"optimizer": o, "frequency": 2}, "Lightning-style dict with keys \\['frequency', 'optimizer'\\]"),
    (lambda o, s: {"optimizer": s}, "'optimizer' must be a torch.optim.Optimizer"),
    (lambda o, s: ([], [s]), "must return a torch.optim.Optimizer"),
])
def test_unusable_forms_are_refused_clearly(returned, message):
    with pytest.raises(engine.ModuleContractError, match=message):
        read_optimizer_setup(returned(*optimizer_and_scheduler()))


def test_a_step_interval_scheduler_from_a_lightning_dict_steps_every_split():
    class StepScheduled(Regression):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    module = StepScheduled()
    engine.Trainer(engine.TrainerConfig(max_epochs=1, progress_bar="off")).fit(module, [torch.randn(3, 2)] * 3)
    assert module.optimizers().param_groups[0]["lr"] == 0.125


def optimizer_and_plateau():
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    return optimizer, torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)


def monitored(setup):
    return [(id(s.scheduler), s.interval, s.monitor, s.frequency) for s in setup.schedules]


@pytest.mark.parametrize("interval, frequency", [("epoch", 1), ("step", 4)])
def test_lightning_dict_with_a_monitored_plateau(interval, frequency):
    optimizer, plateau = optimizer_and_plateau()
    setup = read_optimizer_setup({"optimizer": optimizer, "lr_scheduler": {
        "scheduler": plateau, "monitor": "val_loss", "interval": interval, "frequency": frequency,
        "strict": True, "name": "plateau"}})
    assert monitored(setup) == [(id(plateau), interval, "val_loss", frequency)]


def test_lightning_top_level_monitor_names_the_metric_of_a_bare_plateau():
    optimizer, plateau = optimizer_and_plateau()
    setup = read_optimizer_setup({"optimizer": optimizer, "lr_scheduler": plateau, "monitor": "val_loss"})
    assert monitored(setup) == [(id(plateau), "epoch", "val_loss", 1)]
    optimizer, plateau = optimizer_and_plateau()
    setup = read_optimizer_setup({"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "interval": "step"},
                                  "monitor": "train_loss"})
    assert monitored(setup) == [(id(plateau), "step", "train_loss", 1)]


def test_lightning_list_of_dicts_and_two_lists_with_monitored_plateaus():
    (first, first_plateau), (second, second_plateau) = optimizer_and_plateau(), optimizer_and_plateau()
    setup = read_optimizer_setup([
        {"optimizer": first, "lr_scheduler": {"scheduler": first_plateau, "monitor": "val_loss"}},
        {"optimizer": second, "lr_scheduler": {"scheduler": second_plateau, "monitor": "val_acc", "interval": "step"}}])
    assert monitored(setup) == [(id(first_plateau), "epoch", "val_loss", 1), (id(second_plateau), "step", "val_acc", 1)]
    setup = read_optimizer_setup(([first, second], [{"scheduler": first_plateau, "monitor": "val_loss", "frequency": 2},
                                                    engine.LRSchedule(second_plateau, monitor="a")]))
    assert monitored(setup) == [(id(first_plateau), "epoch", "val_loss", 2), (id(second_plateau), "epoch", "a", 1)]


def test_lr_schedule_with_a_monitor():
    optimizer, plateau = optimizer_and_plateau()
    setup = read_optimizer_setup({"optimizers": optimizer,
                                  "schedulers": [engine.LRSchedule(plateau, monitor="val_loss", frequency=3)]})
    assert monitored(setup) == [(id(plateau), "epoch", "val_loss", 3)]


@pytest.mark.parametrize("make, message", [
    (lambda o, p, s: engine.LRSchedule(p), "ReduceLROnPlateau is stepped with a metric: name it"),
    (lambda o, p, s: read_optimizer_setup({"optimizer": o, "lr_scheduler": p}), "ReduceLROnPlateau is stepped with a metric"),
    (lambda o, p, s: read_optimizer_setup({"optimizer": o, "lr_scheduler": {"scheduler": p, "interval": "epoch"}}),
     "ReduceLROnPlateau is stepped with a metric"),
    (lambda o, p, s: engine.LRSchedule(s, monitor="val_loss"), "monitor='val_loss': StepLR.step\\(\\) takes no metric"),
    (lambda o, p, s: engine.LRSchedule(p, monitor=""), "LRSchedule.monitor: expected the name of a logged metric, got ''"),
    (lambda o, p, s: engine.LRSchedule(p, monitor=3), "LRSchedule.monitor: expected the name of a logged metric, got 3"),
    (lambda o, p, s: engine.LRSchedule(p, monitor="v", frequency=0), "LRSchedule.frequency: expected a positive int, got 0"),
    (lambda o, p, s: engine.LRSchedule(p, monitor="v", frequency=True), "expected a positive int, got True"),
    (lambda o, p, s: engine.LRSchedule(p, monitor="v", frequency=1.5), "expected a positive int, got 1.5"),
    (lambda o, p, s: engine.LRSchedule(s, frequency=2), "frequency=2 applies to a monitored scheduler only"),
    (lambda o, p, s: read_optimizer_setup({"optimizer": o, "lr_scheduler": {"scheduler": p, "monitor": "v", "strict": False}}),
     "strict=False: a monitor naming a metric that does not exist is always an error here"),
])
def test_a_monitored_schedule_is_checked_with_a_one_line_error(make, message):
    optimizer, plateau = optimizer_and_plateau()
    step_lr = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    with pytest.raises(engine.ModuleContractError, match=message) as caught:
        make(optimizer, plateau, step_lr)
    assert "\n" not in str(caught.value)
