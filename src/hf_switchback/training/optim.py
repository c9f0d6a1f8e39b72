"""What train_clip.py optimizes with: parameter groups, the optimizer (AdamW, StableAdamW, 8-bit states), the
learning-rate schedule.

Parameter groups follow OpenCLIP's rule: no weight decay on gains and biases (every parameter with fewer than 2
dimensions: LayerNorm weights, biases, logit_scale) nor on embedding tables (token, position, class
embedding); decay the weight matrices only. Frozen parameters (--lock_image / --lock_text) are left out so the
optimizer holds no state for them.

`examples/train_clip.py --optimizer NAME` calls `create_optimizer(NAME, param_groups(...), ...)`. The groups
carry their own ``weight_decay``, so the factory only picks the optimizer class and passes the shared
hyperparameters.

Where each optimizer comes from (we write our own only where no maintained library ships it):

- ``adamw``            torch.optim.AdamW (fused on CUDA).
- ``stableadamw``      torch-optimi's StableAdamW: AdamW with AdaFactor-style per-tensor update clipping,
                       lr_t = lr / max(1, RMS(g_t² / v̂_t)) (Wortsman et al. 2023, Algorithm 2). Checked against
                       the paper's formula in tests/training/test_optimizers.py.
- ``adamw8bit``        bitsandbytes AdamW8bit: block-wise 8-bit first/second moments.
- ``paged_adamw8bit``  bitsandbytes PagedAdamW8bit: same, states in CUDA unified memory (paged out to host RAM
                       under memory pressure; plain 8-bit on CPU).
- ``stableadamw8bit``  ours, a thin subclass of bitsandbytes AdamW8bit that applies StableAdamW's per-tensor lr
                       clipping before each tensor's update. Neither torch-optimi (no 8-bit states) nor
                       bitsandbytes (its ``max_unorm`` clips the update *norm* against the parameter norm, which
                       is a different rule) ships it.

8-bit variants keep some tensors in 32-bit state, as the bitsandbytes docs advise: every tensor with fewer than
``min_8bit_size`` elements (biases, norms, logit_scale: their states are tiny and quantization noise hurts them
most) and the parameters passed as ``keep_32bit`` (embeddings, see `unstable_parameters`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch
from torch import nn

from ..adapters.bitsandbytes import check_optimizer_hooks, second_moment

__all__ = [
    "OPTIMIZER_CHOICES",
    "cosine_with_warmup",
    "create_optimizer",
    "param_groups",
    "unstable_parameters",
]

OPTIMIZER_CHOICES: tuple[str, ...] = (
    "adamw",
    "stableadamw",
    "adamw8bit",
    "paged_adamw8bit",
    "stableadamw8bit",
)

# bitsandbytes' own default: tensors below this many elements keep 32-bit states.
DEFAULT_MIN_8BIT_SIZE = 4096


def unstable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters whose optimizer states should stay 32-bit under an 8-bit optimizer: embedding tables.

    Token and position embeddings get sparse, bursty gradients (a row only sees a gradient when its token
    occurs), which is where 8-bit block-wise state quantization is known to destabilize training (bitsandbytes
    docs, "8-bit optimizers" / StableEmbedding). Pass the result as ``keep_32bit`` to `create_optimizer`.
    """
    return [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]


def create_optimizer(
    name: str,
    param_groups: list[dict],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    keep_32bit: Iterable[torch.Tensor] = (),
    min_8bit_size: int = DEFAULT_MIN_8BIT_SIZE,
) -> torch.optim.Optimizer:
    """Build optimizer ``name`` (one of OPTIMIZER_CHOICES) over ``param_groups``.

    Args:
        param_groups: ``[{"params": [...], "weight_decay": float, ...}, ...]``; every group's own keys win over
            the shared ``lr``/``betas``/``eps`` given here (torch.optim semantics).
        keep_32bit: 8-bit variants only: parameters whose states stay fp32 (e.g. `unstable_parameters(model)`).
        min_8bit_size: 8-bit variants only: tensors with fewer elements keep fp32 states.
    """
    if name not in OPTIMIZER_CHOICES:
        raise ValueError(f"optimizer={name!r} is not one of {OPTIMIZER_CHOICES}")
    if not param_groups or any("params" not in g for g in param_groups):
        raise ValueError("param_groups must be a non-empty list of dicts with a 'params' key")
    params = [p for g in param_groups for p in g["params"]]
    all_cuda = all(p.is_cuda and p.is_floating_point() for p in params)
    if name == "adamw":
        # The fused kernel is the fastest path when every parameter lives on CUDA; elsewhere (CPU tests,
        # mixed devices) torch picks foreach/for-loop itself.
        return torch.optim.AdamW(param_groups, lr=lr, betas=betas, eps=eps, fused=all_cuda or None)
    if name == "stableadamw":
        from optimi import StableAdamW

        # optimi's weight decay (decouple_lr=False) is AdamW's: θ ← θ·(1 − lr_t·wd), with the clipped lr_t.
        # The backend is chosen here because optimi 0.3.3's auto-choice inspects an empty list and so picks
        # Triton for CPU tensors too whenever triton is installed (then fails: "0 active drivers"). Off CUDA we
        # take the for-loop path, not foreach: optimi's foreach path uses p.grad as scratch space, so after
        # step() the gradients are garbage and the spike monitor (which reads them) would see RMS = 1 always.
        return StableAdamW(param_groups, lr=lr, betas=betas, eps=eps, triton=all_cuda, foreach=False)

    cls = _bnb_classes()[name]
    return cls(param_groups, lr=lr, betas=betas, eps=eps, keep_32bit=keep_32bit, min_8bit_size=min_8bit_size)


@functools.cache
def _bnb_classes() -> dict[str, type]:
    """Our bitsandbytes subclasses, built on first use: importing bitsandbytes costs seconds and logs about
    backends, and it is an optional dependency (extra ``bnb``)."""
    try:
        import bitsandbytes as bnb
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("8-bit optimizers need bitsandbytes: pip install 'hf_switchback[bnb]'") from e
    for base in (bnb.optim.AdamW8bit, bnb.optim.PagedAdamW8bit):
        check_optimizer_hooks(base)

    class _Keep32Bit:
        """Per-instance fp32-state overrides. bitsandbytes' GlobalOptimManager does the same through a
        process-wide singleton keyed by id(param), which leaks between optimizers (and onto new tensors that
        reuse a freed id); scoping the set to the optimizer avoids that."""

        def _init_keep_32bit(self, keep_32bit: Iterable[torch.Tensor]) -> None:
            self._keep_32bit_ids = {id(p) for p in keep_32bit}

        def get_config(self, gindex, pindex, group):
            config = super().get_config(gindex, pindex, group)
            if id(group["params"][pindex]) in self._keep_32bit_ids:
                config["optim_bits"] = 32
            return config

    class AdamW8bit(_Keep32Bit, bnb.optim.AdamW8bit):
        def __init__(self, params, *, keep_32bit=(), **kwargs):
            super().__init__(params, **kwargs)
            self._init_keep_32bit(keep_32bit)

    class PagedAdamW8bit(_Keep32Bit, bnb.optim.PagedAdamW8bit):
        def __init__(self, params, *, keep_32bit=(), **kwargs):
            super().__init__(params, **kwargs)
            self._init_keep_32bit(keep_32bit)

    class StableAdamW8bit(AdamW8bit):
        """bitsandbytes AdamW8bit with StableAdamW's per-tensor learning-rate clipping.

        Before a tensor's update we rebuild its new second moment in fp32, v_t = β2·v_{t-1} + (1-β2)·g², from
        the (dequantized) state, bias-correct it, and run the unchanged 8-bit kernel with
        lr_t = lr / max(1, sqrt(mean(g² / max(v̂_t, eps²)))). Weight decay uses lr_t too, as in the paper. The
        fp32 copy lives for one tensor at a time, so peak memory grows by one parameter's size, not the model's.
        """

        def update_step(self, group, p, gindex, pindex):
            state = self.state[p]
            beta2 = group["betas"][1]
            step = state["step"] + 1  # bitsandbytes increments it inside update_step
            v_prev = second_moment(state)
            grad = p.grad.float()
            v_hat = (v_prev * beta2).addcmul_(grad, grad, value=1 - beta2).div_(1 - beta2**step)
            rms = grad.square().div_(v_hat.clamp_min_(group["eps"] ** 2)).mean().sqrt().item()
            lr = group["lr"]
            group["lr"] = lr / max(1.0, rms)
            try:
                super().update_step(group, p, gindex, pindex)
            finally:
                group["lr"] = lr

    return {"adamw8bit": AdamW8bit, "paged_adamw8bit": PagedAdamW8bit, "stableadamw8bit": StableAdamW8bit}


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
