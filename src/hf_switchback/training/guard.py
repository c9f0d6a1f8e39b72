"""Non-finite step guard: a step whose loss or gradient norm is NaN/inf changes nothing, and a run that keeps
producing them stops with an error instead of training (and saving) a NaN model.

Without it one bad batch (a NaN pixel) or a diverged learning rate turns every weight into NaN within a step,
the scheduler keeps stepping, the NaN model is saved over the last good one and the run exits 0.

What a skipped step does, so that a rerun of the same data position gives the same state:
- no optimizer step and no scheduler step (the schedule counts applied updates);
- gradients zeroed;
- with a GradScaler (fp16 on GPU): `scaler.update(backed-off scale)`, the scaler's own reaction to an
  overflow (scale x backoff_factor, per-optimizer state reset, so the next `unscale_` is allowed).
The decision is the same on every rank: the flag is reduced across ranks (a loss is per rank).
Under DeepSpeed the engine applies the update inside `accelerator.backward` (and handles fp16 overflow itself),
so there the guard cannot undo a step: it still counts non-finite steps and stops the run.

fp16 with a GradScaler overflows now and then by design (the scale starts at 2^16 and backs off by half):
such a skip, with a finite loss and a scale still >= 1, is the scaler's business and does not count towards
the stop. Anything else counts. Default stop after 5 in a row: an isolated bad batch is skipped and logged,
while a diverged run (every step NaN from then on) stops within seconds, before its checkpoints rotate the
good ones away. OpenCLIP stops at the first non-finite loss; Megatron-LM raises on the first NaN gradient.
A limit of 0 turns the stop into a ceiling of UNBOUNDED_CEILING in a row: a skipped step leaves the weights as
they were, so a model that gives NaN on every batch would otherwise loop over the data forever without a step.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONSECUTIVE = 5
# The stop for max_consecutive=0: far beyond any run of isolated bad batches, reached in seconds to minutes by
# a diverged model.
UNBOUNDED_CEILING = 100


class NonFiniteError(RuntimeError):
    """Training stopped: too many consecutive non-finite steps, or non-finite weights about to be saved."""


@dataclass
class NonFiniteGuard:
    """Counts skipped steps; raises NonFiniteError after `max_consecutive` counted skips in a row (0: after
    UNBOUNDED_CEILING).

    `skipped` and `last_skipped_step` go into checkpoints (state_dict) and come back on resume, so the run's
    results count the skips of every launch."""

    max_consecutive: int = DEFAULT_MAX_CONSECUTIVE
    skipped: int = 0  # every skipped step of the run, overflow skips included
    consecutive: int = 0
    last_skipped_step: int | None = None

    def __post_init__(self) -> None:
        if self.max_consecutive < 0:
            raise ValueError(f"max_consecutive must be >= 0 (0: never stop), got {self.max_consecutive}")

    def record(self, step: int, ok: bool, *, counts: bool = True, detail: str = "") -> None:
        """Book one step's outcome; `counts=False` for a GradScaler overflow (skipped, not a divergence)."""
        if ok:
            self.consecutive = 0
            return
        self.skipped += 1
        self.last_skipped_step = step
        if counts:
            self.consecutive += 1
        if self.consecutive <= 5 or self.consecutive & (self.consecutive - 1) == 0:  # then at powers of two
            logger.warning(
                "step %d skipped: %s (%d skipped so far, %d in a row)",
                step,
                detail,
                self.skipped,
                self.consecutive,
            )
        if self.consecutive >= (self.max_consecutive or UNBOUNDED_CEILING):
            raise NonFiniteError(
                f"step {step}: {self.consecutive} consecutive steps with a non-finite loss or gradient norm "
                f"({detail}); stopping. The weights are those before the first of them; lower --lr, check the "
                "data, or resume from the last checkpoint"
            )

    def state_dict(self) -> dict:
        """What a checkpoint keeps (keys of the train state json)."""
        return {"nonfinite_skipped_steps": self.skipped, "last_nonfinite_step": self.last_skipped_step}

    def load_state_dict(self, state: dict) -> None:
        """Restore from a train state; one written before these keys existed counts from zero."""
        self.skipped = int(state.get("nonfinite_skipped_steps", 0))
        self.last_skipped_step = state.get("last_nonfinite_step")


def _finite(value) -> torch.Tensor:
    if value is None:
        return torch.tensor(True)
    if not torch.is_tensor(value):
        return torch.tensor(math.isfinite(float(value)))
    if hasattr(value, "full_tensor"):  # DTensor (FSDP2): the norm is replicated
        value = value.full_tensor()
    return torch.isfinite(value.detach().float()).all().cpu()


class StepOutcome(NamedTuple):
    applied: bool  # the optimizer and scheduler stepped
    grad_norm: float  # before clipping (NaN/inf on a skipped step)
    metrics: dict  # what after_optimizer_step returned ({} when skipped or absent)


def guarded_step(
    accelerator,
    model,
    optimizer,
    scheduler,
    loss,
    guard: NonFiniteGuard,
    step: int,
    clip_norm: float = 0.0,
    after_optimizer_step=None,
) -> StepOutcome:
    """Clip (or just measure) the gradient norm, then step optimizer + scheduler only if loss and norm are finite.

    Call after backward; `step` is the number of the step being taken (1-based, for messages).
    `after_optimizer_step()` runs between optimizer.step() and zero_grad() of an applied step (what reads the
    step's gradients and new optimizer state, e.g. the spike monitor); its dict comes back as `metrics`.
    Gradients are zeroed either way.
    """
    # With clipping off the norm is still needed: max_norm=inf measures without scaling (and unscales fp16).
    max_norm = clip_norm if clip_norm and clip_norm > 0 else math.inf
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
    flags = torch.stack([_finite(loss), _finite(grad_norm)]).to(accelerator.device, torch.float32)
    flags = accelerator.reduce(flags, reduction="sum") if accelerator.num_processes > 1 else flags
    loss_ok, norm_ok = (bool(f >= accelerator.num_processes) for f in flags.tolist())
    norm_value = float(grad_norm) if grad_norm is not None else float("nan")
    scaler = getattr(accelerator, "scaler", None)
    if loss_ok and norm_ok:
        optimizer.step()
        metrics = after_optimizer_step() if after_optimizer_step is not None else {}
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        guard.record(step, True)
        return StepOutcome(True, norm_value, metrics or {})
    optimizer.zero_grad(set_to_none=True)
    overflow = False
    if scaler is not None and scaler.is_enabled():
        scale = scaler.get_scale()
        overflow = loss_ok and scale >= 1.0
        scaler.update(scale * scaler.get_backoff_factor())
    detail = f"loss finite: {loss_ok}, grad norm {norm_value}" + (" (fp16 overflow)" if overflow else "")
    guard.record(step, False, counts=not overflow, detail=detail)
    return StepOutcome(False, norm_value, {})


def non_finite_parameters(model: nn.Module, accelerator=None) -> list[str]:
    """Names of parameters holding NaN/inf (this rank's shards); with `accelerator`, the count is agreed
    across ranks: every rank returns a non-empty list when any rank found one."""
    bad = []
    for name, param in model.named_parameters():
        local = param.detach()
        if hasattr(local, "to_local"):  # FSDP2 DTensor: check this rank's shard
            local = local.to_local()
        if local.numel() and not torch.isfinite(local).all():
            bad.append(name)
    if accelerator is not None and accelerator.num_processes > 1:
        count = torch.tensor(float(len(bad)), device=accelerator.device)
        if accelerator.reduce(count, reduction="sum").item() > 0 and not bad:
            bad = ["<a parameter shard on another rank>"]
    return bad


def check_finite_before_save(model: nn.Module, what: str, accelerator=None) -> None:
    """Raise NonFiniteError instead of writing NaN/inf weights over a good model or checkpoint."""
    bad = non_finite_parameters(model, accelerator)
    if bad:
        raise NonFiniteError(
            f"not writing {what}: {len(bad)} parameter(s) hold NaN/inf ({', '.join(bad[:4])}); "
            "the previous files are kept"
        )


def check_mixed_precision(accelerator) -> None:
    """Refuse fp16 where accelerate gives no GradScaler: without loss scaling, fp16 gradients underflow to zero.

    accelerate (1.x) silently drops fp16 on the CPU: no autocast and no scaler, so the run is fp32 while it says
    fp16. DeepSpeed brings its own loss scaler, so it is left alone.
    """
    from accelerate.utils import DistributedType

    if accelerator.mixed_precision != "fp16" or accelerator.distributed_type == DistributedType.DEEPSPEED:
        return
    if getattr(accelerator, "scaler", None) is None:
        raise ValueError(
            f"--mixed_precision fp16 on {accelerator.device.type}: accelerate gives this device no GradScaler "
            "(and no fp16 autocast), so fp16 would not be what runs; use --mixed_precision bf16 or no"
        )
