"""Optimizer factory for CLIP training: AdamW and (where available) StableAdamW / 8-bit AdamW.

`examples/train_clip.py --optimizer NAME` calls `create_optimizer(NAME, param_groups, ...)`; the param groups
already carry their own ``weight_decay`` (no decay on norms, biases, logit_scale), so this module only picks the
optimizer class and passes the shared hyperparameters.
"""

from __future__ import annotations

import torch

__all__ = ["OPTIMIZER_CHOICES", "create_optimizer"]

OPTIMIZER_CHOICES: tuple[str, ...] = ("adamw",)


def _torch_adamw(param_groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float):
    params = [p for g in param_groups for p in g["params"]]
    # The fused kernel is the fastest path where every parameter lives on CUDA; elsewhere (CPU tests, mixed
    # devices) the foreach path is the safe default.
    fused = bool(params) and all(p.is_cuda and p.is_floating_point() for p in params)
    return torch.optim.AdamW(param_groups, lr=lr, betas=betas, eps=eps, fused=fused or None)


def create_optimizer(
    name: str, param_groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float
) -> torch.optim.Optimizer:
    """Build optimizer ``name`` (one of OPTIMIZER_CHOICES) over ``param_groups`` (each with its weight_decay)."""
    if name == "adamw":
        return _torch_adamw(param_groups, lr=lr, betas=betas, eps=eps)
    raise ValueError(f"optimizer={name!r} is not one of {OPTIMIZER_CHOICES}")
