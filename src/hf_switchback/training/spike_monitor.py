"""Loss-spike early warning: per-layer RMS of g²/v̂ from the optimizer's second-moment state.

The SwitchBack paper (§3.4) finds that loss spikes follow, 1-8 steps later, the moment AdamW's second-moment
estimate v̂ under-estimates the squared gradient: the update g/sqrt(v̂) then becomes far larger than intended.
The signal is, per parameter tensor,

    RMS_t = sqrt(mean(g_t² / v̂_t))          (v̂_t: bias-corrected second moment *after* this step's update)

which sits near 1 while v̂ tracks g², and jumps (up to sqrt(1/(1-β2))) when a gradient outgrows it. StableAdamW
clips its per-tensor learning rate by exactly this value (lr / max(1, RMS_t)).

Usage (after ``optimizer.step()``, before ``optimizer.zero_grad()``, so the gradients are still there)::

    monitor = SpikeMonitor(model, optimizer)
    ...
    optimizer.step()
    metrics = monitor.update(step, loss.item())   # {"rms/max": ..., "rms/<layer>": ...}
    accelerator.log(metrics, step=step)
    optimizer.zero_grad()
    ...
    monitor.save_plot(os.path.join(output_dir, "spike_monitor.png"))

Reads the state of torch.optim.Adam/AdamW (``exp_avg_sq``, not bias-corrected), torch-optimi (``exp_avg_sq``,
already bias-corrected through its debiased β) and bitsandbytes 8-/32-bit optimizers (``state2``, block-wise
quantized or fp32, not bias-corrected). With FSDP-sharded parameters the RMS is over this rank's shard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from ..adapters.bitsandbytes import second_moment

__all__ = ["SpikeMonitor", "default_group_name"]

logger = logging.getLogger(__name__)

# Wrapper prefixes that DDP / torch.compile add to parameter names; dropped so the groups read like the model.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.")


def default_group_name(param_name: str) -> str:
    """Group a parameter by transformer layer: ``text_model.encoder.layers.3.mlp.fc1.weight`` ->
    ``text_model.layers.3``; outside the layer stack by its first two name parts
    (``vision_model.embeddings``, ``visual_projection``, ``logit_scale``)."""
    parts = param_name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        return ".".join([*(x for x in parts[:i] if x != "encoder"), *parts[i : i + 2]])
    return ".".join(parts[:2]) if len(parts) > 2 else parts[0]


def _unwrap_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    # accelerate's AcceleratedOptimizer (and similar wrappers) keep the real optimizer in `.optimizer`.
    while hasattr(optimizer, "optimizer") and isinstance(optimizer.optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _second_moment(optimizer: torch.optim.Optimizer, group: dict, state: dict) -> torch.Tensor | None:
    """Bias-corrected second moment v̂_t of one parameter as fp32, or None before its first step."""
    if "exp_avg_sq" in state:
        v = _local(state["exp_avg_sq"]).float()
        if type(optimizer).__module__.startswith("optimi"):
            return v  # optimi folds bias correction into its debiased β2; the state is v̂ already
        step = float(state["step"])
        beta2 = group["betas"][1]
        return v / (1 - beta2**step)
    if "state2" in state:  # bitsandbytes
        return second_moment(state) / (1 - group["betas"][1] ** float(state["step"]))
    return None


class SpikeMonitor:
    """Tracks per-group max RMS(g²/v̂), the loss, and warns when the RMS crosses ``threshold``.

    Args:
        model: the trained model (wrapped or not); used for parameter names only.
        optimizer: the optimizer whose state holds the second moments (accelerate's wrapper is fine).
        threshold: warn when the max RMS over all tensors goes above this (after being below it). At steady state
            RMS ≈ 1; StableAdamW starts clipping at 1, so a few times that means v̂ is far behind g².
        every: compute the RMS every ``every`` calls (it costs about one extra pass over grads and states);
            the loss is recorded on every call.
        group_fn: maps a parameter name to its group (default: per transformer layer).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        threshold: float = 4.0,
        every: int = 1,
        group_fn: Callable[[str], str] = default_group_name,
    ):
        if threshold <= 0 or every < 1:
            raise ValueError(f"need threshold > 0 and every >= 1, got threshold={threshold}, every={every}")
        self.optimizer = _unwrap_optimizer(optimizer)
        adam_family = type(self.optimizer).__module__.startswith(("optimi", "bitsandbytes")) or all(
            "betas" in g for g in self.optimizer.param_groups
        )
        if not adam_family:
            # Only Adam-family optimizers keep the second moment v the RMS(g²/v̂) is made of; anything else
            # would make update() return {} forever: a monitor that never warns.
            raise ValueError(
                f"SpikeMonitor reads Adam's second moment; {type(self.optimizer).__name__} has none. "
                "Use an Adam-family optimizer (adamw, stableadamw, adamw8bit, ...) or drop --spike_monitor."
            )
        if type(self.optimizer).__module__.startswith("optimi") and any(
            g.get("foreach") for g in self.optimizer.param_groups
        ):
            # optimi's foreach path overwrites p.grad with scratch values during step(); the RMS read afterwards
            # would be meaningless (≈1 every step), so refuse rather than report a flat line.
            raise ValueError(
                "SpikeMonitor needs torch-optimi with foreach=False (its foreach step clobbers grads)"
            )
        self.threshold = threshold
        self.every = every
        self._names: dict[int, str] = {}  # id(param) -> name without wrapper prefixes
        self._groups: dict[str, str] = {}  # name -> group
        for name, p in model.named_parameters():
            for prefix in _WRAPPER_PREFIXES:
                name = name.replace(prefix, "")
            self._names[id(p)] = name
            self._groups[name] = group_fn(name)
        self._calls = 0
        self._above = False
        # History for the plot: loss on every call; RMS on the calls where it was computed.
        self.loss_steps: list[int] = []
        self.losses: list[float] = []
        self.rms_steps: list[int] = []
        self.max_rms: list[float] = []
        self.warnings: list[tuple[int, str, float]] = []  # (step, tensor name, rms)

    @torch.no_grad()
    def tensor_rms(self) -> dict[str, float]:
        """RMS(g²/v̂) of every parameter that has a gradient and optimizer state, keyed by parameter name."""
        out = {}
        for group in self.optimizer.param_groups:
            eps_sq = group.get("eps", 0.0) ** 2
            for p in group["params"]:
                if p.grad is None or p not in self.optimizer.state:
                    continue
                v = _second_moment(self.optimizer, group, self.optimizer.state[p])
                if v is None:
                    continue
                g = _local(p.grad).float()
                # max(v̂, eps²) as in StableAdamW, so an all-zero gradient row reads 0, not NaN
                ratio = g.square().div_(v.reshape(g.shape).clamp_min(max(eps_sq, 1e-30)))
                name = self._names.get(id(p), f"unnamed{len(out)}")
                out[name] = ratio.mean().sqrt().item()
        return out

    def update(self, step: int, loss: float | None = None) -> dict[str, float]:
        """Record ``loss`` and (every ``every`` calls) the RMS; return the metrics for the trackers."""
        metrics: dict[str, float] = {}
        if loss is not None:
            self.loss_steps.append(step)
            self.losses.append(float(loss))
        self._calls += 1
        if (self._calls - 1) % self.every:
            return metrics
        per_tensor = self.tensor_rms()
        if not per_tensor:
            return metrics
        groups: dict[str, float] = {}
        for name, rms in per_tensor.items():
            group = self._groups.get(name, "other")
            groups[group] = max(groups.get(group, 0.0), rms)
        worst = max(per_tensor, key=per_tensor.get)
        max_rms = per_tensor[worst]
        metrics = {f"rms/{g}": v for g, v in groups.items()}
        metrics["rms/max"] = max_rms
        self.rms_steps.append(step)
        self.max_rms.append(max_rms)
        above = max_rms > self.threshold
        if above and not self._above:
            self.warnings.append((step, worst, max_rms))
            logger.warning(
                "step %d: RMS(g²/v̂) = %.2f in %s exceeds %.2f: the second-moment estimate lags the gradient; "
                "a loss spike often follows within a few steps (StableAdamW clips this update)",
                step,
                max_rms,
                worst,
                self.threshold,
            )
        self._above = above
        return metrics

    def save_plot(self, path: str) -> None:
        """Write a PNG with the loss (top) and the max RMS(g²/v̂) (bottom) over steps."""
        # matplotlib's object API with the Agg canvas: no pyplot, so no global backend switch and no display.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(8, 5.5), layout="constrained")
        FigureCanvasAgg(fig)
        ax_loss, ax_rms = fig.subplots(2, 1, sharex=True)
        ax_loss.plot(self.loss_steps, self.losses, lw=1, color="tab:blue")
        ax_loss.set_ylabel("loss")
        ax_loss.grid(alpha=0.3)
        ax_rms.plot(self.rms_steps, self.max_rms, lw=1, color="tab:red", label="max over tensors")
        ax_rms.axhline(
            self.threshold, ls="--", color="gray", lw=1, label=f"warning threshold {self.threshold:g}"
        )
        ax_rms.axhline(1.0, ls=":", color="black", lw=1, label="StableAdamW clips above 1")
        for step, _, _ in self.warnings:
            ax_loss.axvline(step, color="tab:red", alpha=0.3, lw=1)
        ax_rms.set_yscale("log")
        ax_rms.set_ylabel("RMS(g² / v̂)")
        ax_rms.set_xlabel("step")
        ax_rms.grid(alpha=0.3)
        ax_rms.legend(loc="upper right", fontsize=8)
        fig.savefig(path, dpi=110)
