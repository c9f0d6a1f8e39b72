"""Parameter groups and the learning-rate schedule (the optimizer classes live in `optimizers.py`).

OpenCLIP's rule: no weight decay on gains and biases — every parameter with fewer than 2 dimensions (LayerNorm
weights, biases, logit_scale) — nor on embedding tables (token, position, class embedding); decay the weight
matrices only. Frozen parameters (--lock_image / --lock_text) are left out so the optimizer holds no state
for them.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def _no_decay(name: str, param: nn.Parameter, embedding_params: set[int]) -> bool:
    return (
        param.ndim < 2 or "logit_scale" in name or id(param) in embedding_params or name.endswith("embedding")
    )


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """[{"params": decayed, "weight_decay": wd}, {"params": the rest, "weight_decay": 0.0}], trainable only."""
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if _no_decay(name, param, embedding_params) else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def cosine_with_warmup(optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0):
    """LambdaLR: linear warmup 0 -> 1 over `warmup_steps`, then cosine 1 -> min_lr_ratio at `total_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
