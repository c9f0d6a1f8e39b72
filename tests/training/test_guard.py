"""Non-finite step guard: skipped steps change nothing, a run of them stops, NaN weights are never saved."""

import math

import pytest
import torch
from accelerate import Accelerator
from torch import nn

from hf_switchback.training.guard import (
    UNBOUNDED_CEILING,
    NonFiniteError,
    NonFiniteGuard,
    check_finite_before_save,
    check_mixed_precision,
    guarded_step,
    non_finite_parameters,
)
from hf_switchback.training.optim import cosine_with_warmup


def _setup(lr=0.1):
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scheduler = cosine_with_warmup(optimizer, 2, 20, 0.0)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, model, optimizer, scheduler


def _backward(accelerator, model, poison=False):
    x = torch.randn(8, 4)
    if poison:
        x[0, 0] = float("nan")  # one NaN pixel
    loss = model(x).pow(2).mean()
    accelerator.backward(loss)
    return loss.detach()


def _same(before, model):
    return all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def _snapshot(model, optimizer, scheduler):
    params = [p.detach().clone() for p in model.parameters()]
    return params, scheduler.scheduler.last_epoch, len(optimizer.state_dict()["state"])


def test_a_nan_batch_is_skipped_and_changes_nothing():
    accelerator, model, optimizer, scheduler = _setup()
    guard = NonFiniteGuard()
    loss = _backward(accelerator, model)
    applied, norm, _ = guarded_step(accelerator, model, optimizer, scheduler, loss, guard, step=1)
    assert applied and math.isfinite(norm) and guard.skipped == 0
    params, sched_epoch, opt_state = _snapshot(model, optimizer, scheduler)
    lr = scheduler.get_last_lr()[0]

    loss = _backward(accelerator, model, poison=True)
    applied, norm, _ = guarded_step(
        accelerator, model, optimizer, scheduler, loss, guard, step=2, clip_norm=1.0
    )
    assert not applied and not math.isfinite(norm)
    assert _same(params, model)
    assert scheduler.scheduler.last_epoch == sched_epoch and scheduler.get_last_lr()[0] == lr
    assert all(p.grad is None for p in model.parameters())
    assert guard.skipped == 1 and guard.consecutive == 1 and guard.last_skipped_step == 2
    assert len(optimizer.state_dict()["state"]) == opt_state

    loss = _backward(accelerator, model)  # a good batch again: applied, the run of skips is reset
    applied, norm, _ = guarded_step(accelerator, model, optimizer, scheduler, loss, guard, step=3)
    assert applied and math.isfinite(norm) and guard.consecutive == 0
    assert not _same(params, model)
    assert scheduler.scheduler.last_epoch == sched_epoch + 1


def test_consecutive_non_finite_steps_stop_the_run_naming_the_step():
    accelerator, model, optimizer, scheduler = _setup()
    guard = NonFiniteGuard(max_consecutive=3)
    for step in (1, 2):
        loss = _backward(accelerator, model, poison=True)
        assert guarded_step(accelerator, model, optimizer, scheduler, loss, guard, step=step).applied is False
    loss = _backward(accelerator, model, poison=True)
    with pytest.raises(NonFiniteError, match=r"step 3: 3 consecutive"):
        guarded_step(accelerator, model, optimizer, scheduler, loss, guard, step=3)
    assert not non_finite_parameters(model)  # the weights are still the good ones
    with pytest.raises(ValueError, match="max_consecutive"):
        NonFiniteGuard(max_consecutive=-1)


def test_a_limit_of_zero_still_ends_a_run_of_skips_and_its_warnings_are_rate_limited(caplog):
    guard = NonFiniteGuard(max_consecutive=0)
    with caplog.at_level("WARNING", logger="hf_switchback.training.guard"):
        for step in range(1, UNBOUNDED_CEILING):
            guard.record(step, False, detail="nan")
        with pytest.raises(
            NonFiniteError, match=rf"step {UNBOUNDED_CEILING}: {UNBOUNDED_CEILING} consecutive"
        ):
            guard.record(UNBOUNDED_CEILING, False, detail="nan")
    # the first 5, then at 8, 16, 32, 64 in a row (100 raises instead)
    assert len(caplog.records) == 9
    assert (
        NonFiniteGuard(max_consecutive=UNBOUNDED_CEILING + 50).consecutive == 0
    )  # a larger limit is allowed


def test_an_inf_loss_with_finite_gradients_is_skipped_too():
    accelerator, model, optimizer, scheduler = _setup()
    guard = NonFiniteGuard()
    _backward(accelerator, model)
    before = [p.detach().clone() for p in model.parameters()]
    applied, _, _ = guarded_step(
        accelerator, model, optimizer, scheduler, torch.tensor(math.inf), guard, step=1
    )
    assert not applied and _same(before, model)


class _ScalerAccelerator:
    """The parts of Accelerator the guard uses, with a real GradScaler on the CPU (accelerate gives none there)."""

    num_processes, device = 1, torch.device("cpu")

    def __init__(self, optimizer):
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
        self.optimizer = optimizer

    def clip_grad_norm_(self, parameters, max_norm):
        self.scaler.unscale_(self.optimizer)  # as accelerate does for fp16
        return nn.utils.clip_grad_norm_(parameters, max_norm)


class _ScaledOptimizer:
    def __init__(self, optimizer, scaler):
        self.optimizer, self.scaler = optimizer, scaler

    def step(self):
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)


def test_grad_scaler_overflow_backs_off_without_counting_and_stays_usable():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    accelerator = _ScalerAccelerator(inner)
    optimizer = _ScaledOptimizer(inner, accelerator.scaler)
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 1.0)
    guard = NonFiniteGuard(max_consecutive=1)  # an overflow must not count, or this would raise

    loss = model(torch.randn(8, 4)).pow(2).mean()
    accelerator.scaler.scale(loss * 1e38).backward()  # finite loss, gradients overflow once scaled
    before = [p.detach().clone() for p in model.parameters()]
    applied, _, _ = guarded_step(accelerator, model, optimizer, scheduler, loss, guard, step=1)
    assert not applied and guard.skipped == 1 and guard.consecutive == 0
    assert accelerator.scaler.get_scale() == 2.0**3  # backed off, as the scaler does on overflow
    assert _same(before, model)
    assert scheduler.last_epoch == 0

    loss = model(torch.randn(8, 4)).pow(2).mean()
    accelerator.scaler.scale(loss).backward()  # the scaler accepts the next unscale_ (its state was reset)
    applied, _, _ = guarded_step(accelerator, model, optimizer, scheduler, loss, guard, step=2)
    assert applied and scheduler.last_epoch == 1
    assert not _same(before, model)

    loss = model(torch.randn(8, 4)).pow(2).mean()
    accelerator.scaler.scale(loss).backward()
    with pytest.raises(NonFiniteError, match="step 3"):  # a NaN loss counts even with a scaler
        guarded_step(accelerator, model, optimizer, scheduler, loss * math.nan, guard, step=3)


def test_non_finite_weights_are_never_saved():
    model = nn.Linear(4, 2)
    check_finite_before_save(model, "the model")  # finite: no error
    with torch.no_grad():
        model.bias[1] = math.inf
    assert non_finite_parameters(model) == ["bias"]
    with pytest.raises(
        NonFiniteError, match=r"not writing the model: 1 parameter\(s\) hold NaN/inf \(bias\)"
    ):
        check_finite_before_save(model, "the model")


def test_fp16_without_a_grad_scaler_is_refused():
    class Fake:
        mixed_precision, scaler = "fp16", None
        device = torch.device("cpu")
        distributed_type = "NO"

    with pytest.raises(ValueError, match="fp16 on cpu: accelerate gives this device no GradScaler"):
        check_mixed_precision(Fake())
    Fake.mixed_precision = "bf16"
    check_mixed_precision(Fake())
