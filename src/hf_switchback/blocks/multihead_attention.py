"""SwitchBack for torch's nn.MultiheadAttention (OpenCLIP's attention), Parameters and state_dict kept.

nn.MultiheadAttention never calls a linear module: it multiplies by its packed `in_proj_weight` (3d, d) and
reads `out_proj.weight` directly, so swapping linears cannot reach it. Here the module's class is swapped
(the technique `fully_shard` and `hf_switchback.blocks.mlp` use) for a subclass whose forward runs

    qkv = switchback_linear(x, in_proj_weight, in_proj_bias)      one 8-bit GEMM with N = 3d
    out = scaled_dot_product_attention(q, k, v, mask, dropout)
    out = switchback_linear(out, out_proj.weight, out_proj.bias)

Nothing else changes: the same object, the same Parameters (`in_proj_weight`, `in_proj_bias`, `out_proj.*`),
so optimizers, FSDP records and checkpoints are untouched and a saved state_dict loads in a stock
nn.MultiheadAttention. With weight_scaling="tensor" the packed weight gets one scale for q, k and v together,
as one linear holding all three would.

Self-attention only, as in OpenCLIP's blocks: the call must pass one tensor as query, key and value, ask for no
attention weights (need_weights=False) and no is_causal hint; the module must have kdim = vdim = embed_dim and
neither add_bias_kv nor add_zero_attn. Modules that cannot qualify are not converted (logged); a call that does
not qualify runs stock nn.MultiheadAttention math, with the reason logged once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import SwitchBackConfig
from ..functional import switchback_linear

logger = logging.getLogger(__name__)

# Reasons already logged by a fallback forward: a model calls its attention modules thousands of times.
_LOGGED: set[str] = set()


def static_unsupported_reason(module: nn.MultiheadAttention) -> str | None:
    """Why a module can never take the SwitchBack path (its construction arguments), or None."""
    if not module._qkv_same_embed_dim:
        return "kdim / vdim differ from embed_dim (separate q / k / v weights)"
    if module.bias_k is not None:
        return "add_bias_kv=True"
    if module.add_zero_attn:
        return "add_zero_attn=True"
    return None


def _call_unsupported_reason(query, key, value, need_weights: bool, is_causal: bool) -> str | None:
    if need_weights:
        return "need_weights=True (attention weights are not computed by scaled_dot_product_attention)"
    if not (query is key and key is value):
        return "query, key and value are not one tensor (only self-attention packs q/k/v into one GEMM)"
    if is_causal:
        return "the is_causal hint (pass the causal mask as attn_mask)"
    if query.dim() != 3:
        return "unbatched input"
    return None


def _additive_mask(mask: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype):
    """nn.MultiheadAttention's mask convention (bool True = masked out, float = added) as an additive float
    mask viewed to `shape`, which broadcasts against sdpa's (N, H, L, S) scores; None stays None."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    elif not mask.is_floating_point():
        raise TypeError(f"attention masks must be bool or float, got {mask.dtype}")
    return mask.to(dtype).view(shape)


class SwitchBackMultiheadAttention(nn.MultiheadAttention):
    """nn.MultiheadAttention whose input and output projections run SwitchBack (see the module docstring).

    Made by `convert_multihead_attention(module, config)` from an existing module, or constructed directly with
    nn.MultiheadAttention's arguments plus `config=`. Its config lives in `self.switchback_config`.
    """

    def __init__(self, *args, config: SwitchBackConfig | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        reason = static_unsupported_reason(self)
        if reason:
            raise ValueError(
                f"SwitchBackMultiheadAttention does not support {reason}; use nn.MultiheadAttention"
            )
        self.switchback_config = _checked(config)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, None]:
        """query = key = value: (N, L, d) with batch_first, else (L, N, d) -> (output of the same shape, None).

        attn_mask (L, L) or (N * num_heads, L, L), key_padding_mask (N, L): bool (True = not attended) or
        float (added to the scores), as in nn.MultiheadAttention.
        """
        reason = static_unsupported_reason(self) or _call_unsupported_reason(
            query, key, value, need_weights, is_causal
        )
        if reason:
            if reason not in _LOGGED:
                _LOGGED.add(reason)
                logger.warning(
                    "SwitchBackMultiheadAttention: %s; this call runs nn.MultiheadAttention", reason
                )
            return super().forward(
                query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
            )
        cfg, heads = self.switchback_config, self.num_heads
        qkv = switchback_linear(query, self.in_proj_weight, self.in_proj_bias, cfg)
        if self.batch_first:
            n, length, _ = query.shape
            q, k, v = qkv.view(n, length, 3, heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            length, n, _ = query.shape
            q, k, v = qkv.view(length, n, 3, heads, self.head_dim).permute(2, 1, 3, 0, 4).unbind(0)
        mask = _additive_mask(key_padding_mask, (n, 1, 1, length), q.dtype)
        if attn_mask is not None:
            shape = (length, length) if attn_mask.dim() == 2 else (n, heads, length, length)
            extra = _additive_mask(attn_mask, shape, q.dtype)
            mask = extra if mask is None else mask + extra
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0
        )  # (N, H, L, head_dim)
        out = out.transpose(1, 2) if self.batch_first else out.permute(2, 0, 1, 3)
        out = out.reshape(*query.shape[:2], self.embed_dim)
        return switchback_linear(out, self.out_proj.weight, self.out_proj.bias, cfg), None

    def extra_repr(self) -> str:
        return f"switchback={self.switchback_config.variant}, backend={self.switchback_config.backend}"


def _checked(config: SwitchBackConfig | None) -> SwitchBackConfig:
    if config is not None and not isinstance(config, SwitchBackConfig):
        raise TypeError(f"config must be a SwitchBackConfig, got {type(config).__name__}")
    return config or SwitchBackConfig()


def convert_multihead_attention(
    module: nn.MultiheadAttention, config: SwitchBackConfig | None = None
) -> SwitchBackMultiheadAttention:
    """Turn `module` (an nn.MultiheadAttention, not a subclass) into SwitchBackMultiheadAttention in place and
    return it; on an already converted module, set the new config. ValueError when it cannot qualify."""
    if type(module) not in (nn.MultiheadAttention, SwitchBackMultiheadAttention):
        raise TypeError(
            f"convert_multihead_attention expects an nn.MultiheadAttention (not a subclass, whose forward may "
            f"differ), got {type(module).__name__}"
        )
    reason = static_unsupported_reason(module)
    if reason:
        raise ValueError(f"convert_multihead_attention: {reason} is not supported")
    # Our own subclass of nn.MultiheadAttention: the instance (Parameters, hooks, fully_shard's state) is
    # untouched, and no other library's private state is read or written.
    module.__class__ = SwitchBackMultiheadAttention
    module.switchback_config = _checked(config)
    return module


def restore_multihead_attention(model: nn.Module) -> int:
    """Turn every SwitchBackMultiheadAttention in `model` back into nn.MultiheadAttention; returns how many."""
    restored = [m for m in model.modules() if type(m) is SwitchBackMultiheadAttention]
    for module in restored:
        module.__class__ = nn.MultiheadAttention
        module.__dict__.pop("switchback_config", None)
    return len(restored)


def find_multihead_attention(model: nn.Module, selects: Callable[[str, nn.Module], bool]) -> list[str]:
    """Dotted names of the nn.MultiheadAttention modules to convert: those `selects(name, module)` accepts
    (apply_switchback: the name matches target_modules, e.g. OpenCLIP's "attn", and not exclude_modules).

    Selected modules that can never qualify are left out with a warning. Raises ValueError when a module
    converted earlier is not selected (it would keep its old config), as apply_switchback does for linears.
    Changes nothing.
    """
    selected, left_out = [], []
    for name, module in model.named_modules():
        if type(module) not in (nn.MultiheadAttention, SwitchBackMultiheadAttention):
            continue
        chosen = selects(name, module)
        reason = static_unsupported_reason(module)
        if chosen and reason:
            logger.warning("hf_switchback: %s stays nn.MultiheadAttention: %s", name, reason)
        elif chosen:
            selected.append(name)
        elif type(module) is SwitchBackMultiheadAttention:
            left_out.append(name)
    if left_out:
        raise ValueError(
            f"apply_switchback: {len(left_out)} attention modules already use SwitchBack but this call does not "
            f"select them ({', '.join(left_out[:4])}), so they would keep their old config. Select them too, or "
            "call remove_switchback(model) first."
        )
    return selected


def swap_multihead_attention(model: nn.Module, config: SwitchBackConfig, names: list[str]) -> int:
    """Convert the modules `names` (from find_multihead_attention) with `config`; returns how many."""
    for name in names:
        convert_multihead_attention(model.get_submodule(name), config)
    if names:
        logger.info(
            "hf_switchback: %d nn.MultiheadAttention modules use SwitchBack %s", len(names), config.variant
        )
    return len(names)


__all__ = [
    "SwitchBackMultiheadAttention",
    "convert_multihead_attention",
    "find_multihead_attention",
    "restore_multihead_attention",
    "static_unsupported_reason",
    "swap_multihead_attention",
]
