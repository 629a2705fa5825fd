"""TrainerConfig.precision: autocast around the step, the gradient scaler of "16-mixed" (skipped
steps, its state in checkpoints, manual optimization), and exact resume in every precision."""

import os
import pathlib
import platform
import subprocess
import sys

import pytest
import torch

import engine
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.store.storage import Storage
from engine.loops.precision import MixedPrecision, Precision, ScaledMixedPrecision, make_precision
from kill_helpers import run_until_done
from resume_helpers import assert_resumes_are_exact, assert_same_run, memory_url
from scenarios import train_with_checkpoints

BATCHES, POISONED = 6, 2
# torch.amp.GradScaler's documented defaults.
INIT_SCALE, BACKOFF = 65536.0, 0.5


def make_batches(poisoned=POISONED):
    """Six batches of a linear regression; batch ``poisoned`` has an infinite target, so its
    gradients are inf/nan (None: no poisoned batch)."""
    generator = torch.Generator().manual_seed(3)
    batches = []
    for index in range(BATCHES):
        x = torch.randn(4, 4, generator=generator) * 0.01  # small: no overflow at the initial scale
        y = x.sum(dim=1, keepdim=True) * 0.5
        if index == poisoned:
            y[0, 0] = float("inf")
        batches.append((x, y))
    return batches


class Regressor(engine.Module):
    """One linear layer; manual=True steps through manual_backward / manual_unscale / manual_step."""

    def __init__(self, manual=False):
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = not manual
        self.layer = torch.nn.Linear(4, 1)
        self.autocast_dtypes = []

    def training_step(self, batch):
        x, y = batch
        enabled = torch.is_autocast_enabled("cpu")
        self.autocast_dtypes.append(torch.get_autocast_dtype("cpu") if enabled else None)
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            self.manual_unscale(optimizer)
            torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)
            self.manual_step(optimizer)
            self.lr_schedulers()[0].step()
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.9)
        return {"optimizers": [optimizer], "schedulers": [engine.LRSchedule(scheduler, "step")]}


def fit(run_dir=None, precision="16-mixed", manual=False, resume="auto", poisoned=POISONED, **extra):
    model = Regressor(manual)
    checkpoint = engine.CheckpointConfig(keep_last=None) if run_dir is not None else None
    settings = dict(max_epochs=2, run_dir=run_dir, checkpoint=checkpoint, progress_bar="off", precision=precision)
    settings.update(extra)
    result = engine.Trainer(engine.TrainerConfig(**settings)).fit(model, make_batches(poisoned), resume=resume)
    return model, result


def latest_state(run_dir):
    return CheckpointStore(Storage(run_dir)).latest().state


def test_precision_and_device_are_validated():
    with pytest.raises(engine.ConfigError, match=r"TrainerConfig.precision.*'fp8'"):
        engine.TrainerConfig(precision="fp8")
    with pytest.raises(engine.ConfigError, match=r"TrainerConfig.device.*'gpu'"):
        engine.TrainerConfig(device="gpu")


@pytest.mark.parametrize("precision, dtype", [("32", None), ("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)])
@pytest.mark.parametrize("manual", [False, True])
def test_the_step_runs_under_the_configured_autocast(precision, dtype, manual):
    model, _ = fit(precision=precision, manual=manual, poisoned=None, max_epochs=1)
    assert model.autocast_dtypes == [dtype] * BATCHES
    assert (model.grad_scaler is not None) == (precision == "16-mixed")


@pytest.mark.parametrize("manual", [False, True])
def test_an_inf_gradient_skips_the_step_and_is_not_counted(manual):
    """optimizer_steps counts applied steps; the step-interval scheduler follows them; the
    scale backs off once per skipped step."""
    run_dir = memory_url("precision")
    model, result = fit(run_dir, manual=manual, max_epochs=1)
    applied = BATCHES - 1
    assert result.optimizer_steps == applied
    scheduler_steps = BATCHES if manual else applied  # the manual step steps its scheduler itself
    assert model.optimizers().param_groups[0]["lr"] == pytest.approx(0.1 * 0.9 ** scheduler_steps, rel=1e-12)
    assert model.grad_scaler.get_scale() == INIT_SCALE * BACKOFF
    assert all(torch.isfinite(p).all() for p in model.parameters())
    flow = latest_state(run_dir)["loops"]["flow"]
    assert flow["precision"]["scaler"]["scale"] == INIT_SCALE * BACKOFF
    if not manual:
        assert flow["skipped_steps"] == 1


def test_max_steps_counts_applied_steps():
    _, result = fit(max_steps=3, max_epochs=1)
    assert result.optimizer_steps == 3
    assert result.cursor.batch == 3  # batches 0, 1, 3 stepped; batch 2 was skipped


class ValidatedRegressor(Regressor):
    def __init__(self):
        super().__init__()
        self.validation_dtypes = []

    def validation_step(self, batch):
        x, y = batch
        enabled = torch.is_autocast_enabled("cpu")
        self.validation_dtypes.append(torch.get_autocast_dtype("cpu") if enabled else None)
        return torch.nn.functional.mse_loss(self.layer(x), y)


@pytest.mark.parametrize("precision, dtype", [("32", None), ("bf16-mixed", torch.bfloat16)])
def test_validation_runs_under_the_same_autocast(precision, dtype):
    model = ValidatedRegressor()
    config = engine.TrainerConfig(max_epochs=1, run_dir=None, checkpoint=None, progress_bar="off", precision=precision)
    engine.Trainer(config).fit(model, make_batches(None), make_batches(None)[:2])
    assert model.validation_dtypes == [dtype] * 2


def test_grad_scaler_state_round_trip():
    source = ScaledMixedPrecision("cpu")
    parameter = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([parameter], lr=0.1)
    for value in (1.0, float("inf"), 2.0):  # one growth-tracker tick, one backoff, one tick
        optimizer.zero_grad()
        source.backward((parameter * value).sum())
        source.step(optimizer)
        source.update()
    saved = source.state_dict()
    assert saved["scaler"]["scale"] == INIT_SCALE * BACKOFF
    assert saved["scaler"]["_growth_tracker"] == 1
    target = ScaledMixedPrecision("cpu")
    target.load_state_dict(saved)
    assert target.state_dict() == saved
    assert target.scaler.get_scale() == INIT_SCALE * BACKOFF


def test_scaler_state_and_precision_must_match():
    with pytest.raises(ValueError, match="16-mixed"):
        ScaledMixedPrecision("cpu").load_state_dict({})
    with pytest.raises(ValueError, match="scaler"):
        Precision().load_state_dict(ScaledMixedPrecision("cpu").state_dict())
    assert type(make_precision("bf16-mixed", torch.device("cpu"))) is MixedPrecision


def test_resume_with_another_precision_is_refused():
    run_dir = memory_url("precision")
    fit(run_dir, precision="16-mixed", max_epochs=1)
    with pytest.raises(engine.CheckpointIncompatible, match="precision"):
        fit(run_dir, precision="bf16-mixed")


@pytest.mark.parametrize("manual, accumulate", [(False, 2), (True, 1)])
def test_resume_from_every_checkpoint_across_skipped_steps(manual, accumulate):
    """fp16 with a poisoned batch per epoch (a skipped step and a backoff each time), gradient
    accumulation over two batches (checkpoints inside a window hold scaled gradients) and
    clipping after unscale: resuming from any checkpoint gives the uninterrupted run."""
    reference = memory_url("precision")
    extra = dict(accumulate_grad=accumulate, gradient_clip_val=None if manual else 1.0)
    fit(reference, manual=manual, **extra)
    names = CheckpointStore(Storage(reference)).names()
    assert len(names) == 2 * BATCHES + 2
    assert_resumes_are_exact(reference, names[:-1], lambda run_dir: fit(run_dir, manual=manual, **extra)[1])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fp16_survives_sigkill_at_split_boundaries(tmp_path):
    """Real processes, SIGKILLed every fifth split boundary, "16-mixed" with accumulation over
    three splits: the result equals the uninterrupted run bit for bit."""
    reference = str(tmp_path / "reference")
    train_with_checkpoints("fp16_accumulate", reference)
    run_dir = str(tmp_path / "run")
    kills = run_until_done("fp16_accumulate", run_dir, "split_end_after_checkpoint:5:sigkill")
    assert kills >= 3
    assert_same_run(reference, run_dir)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="ONEDNN_MAX_CPU_ISA=AVX2 is an x86 setting")
def test_bf16_lstm_tests_are_skipped_naming_what_an_avx2_only_cpu_lacks():
    """On an AVX2-only CPU oneDNN has no bf16 LSTM: the scenario tests that need one are
    skipped with the reason, not failed with oneDNN's error. ONEDNN_MAX_CPU_ISA=AVX2 makes
    this CPU one (tests/cpu_features.py)."""
    tests = pathlib.Path(__file__).resolve().parents[1]
    environment = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    process = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-n", "0", "-p", "no:cacheprovider",
                              str(tests / "loops" / "test_parity.py"), "-k", "bf16"],
                             cwd=tests.parent, env=environment, capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stdout[-3000:]
    assert "1 skipped" in process.stdout and "passed" not in process.stdout and "failed" not in process.stdout
    assert "no bfloat16 LSTM on this CPU: " in process.stdout
    assert ("lacks avx512" in process.stdout) or ("ONEDNN_MAX_CPU_ISA=AVX2 hides" in process.stdout)
