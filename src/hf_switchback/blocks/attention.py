"""Fused q/k/v for transformers CLIP / SigLIP attention blocks: the three projections as one SwitchBack op.

When apply_switchback converts q_proj, k_proj and v_proj of a `CLIPAttention` (or `SiglipAttention` /
`Siglip2Attention`) with one config whose `fuse_qkv` is on, the block's class is swapped for a generated
subclass whose forward computes q, k, v with `blocks.qkv.switchback_qkv` (input quantized once, one N = 3d
GEMM) and then runs the stock attention and out_proj. With `fuse_norm` too, that forward takes the input's
8-bit form as `quantized_input` when the LayerNorm before it wrote that form (blocks/encoder_layer.py). Not
without fuse_qkv: the three separate layers would each return a gradient in the LayerNorm output's 16-bit dtype,
summed there in 16 bits, where the stock path sums them in float32 under autocast. Nothing else changes: the module is still an instance of
its class, q_proj / k_proj / v_proj stay the same SwitchBackLinear modules holding the same Parameters, so
state_dict keys, FSDP2's parameter records and PEFT target names are untouched, and remove_switchback restores
the original class. The forward re-checks at every call that the block still qualifies (the three layers plain
SwitchBackLinear with one fusing config, no hooks on them, no inference weight cache) and otherwise runs the
stock forward: a PEFT LoRA wrapper on q_proj, a narrower re-conversion or hooks get the layer path.
"""

from __future__ import annotations

import functools
import importlib

import torch
from torch import nn

from ..modules import SwitchBackLinear
from ..stock_blocks import stock_classes
from ..weight_cache import has_weight_cache
from .qkv import switchback_qkv

_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
# Class attribute of the generated subclasses: the stock class they were made from.
_BASE_ATTR = "_switchback_attention_base"


@functools.cache
def _attention_classes() -> dict[type, bool]:
    """The transformers attention blocks whose forward this module reproduces, each mapped to whether that
    forward passes its **kwargs on to the attention function (CLIP does; SigLIP passes is_causal instead)."""
    return {cls: module == "clip" for module, cls in stock_classes("Attention").items()}


def _base_class(module: nn.Module) -> type:
    return getattr(type(module), _BASE_ATTR, type(module))


def _stock_class(base: type) -> type | None:
    """The transformers class whose unmodified forward `base` runs, else None."""
    for cls in _attention_classes():
        if issubclass(base, cls) and base.forward is cls.forward:
            return cls
    return None


def _fusable(module: nn.Module):
    """The shared SwitchBackConfig when q/k/v of `module` can run fused right now, else None."""
    layers = [getattr(module, name, None) for name in _PROJECTIONS]
    # Exact type: a subclass (or a PEFT wrapper, which is not a SwitchBackLinear at all) may compute more.
    if any(type(layer) is not SwitchBackLinear for layer in layers):
        return None
    cfg = layers[0].switchback_config
    if not cfg.fuse_qkv or any(layer.switchback_config != cfg for layer in layers[1:]):
        return None
    if (
        len({layer.in_features for layer in layers}) != 1
        or len({layer.bias is None for layer in layers}) != 1
    ):
        return None
    # The fused op calls no layer's forward: hooks on a layer (or an inference weight cache its forward would
    # serve) would be skipped, so those blocks take the layer path.
    if any(layer._forward_hooks or layer._forward_pre_hooks or has_weight_cache(layer) for layer in layers):
        return None
    return cfg


def quantized_input_config(module: nn.Module):
    """The SwitchBackConfig with which `module`'s forward takes its input's 8-bit form (`quantized_input`) right
    now, else None."""
    cfg = _fusable(module) if type(module) is _FUSED_CLASSES.get(_base_class(module)) else None
    return cfg if cfg is not None and cfg.fuse_norm else None


def _fused_forward(
    self,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    quantized_input: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs,
):
    cls = type(self)
    cfg = _fusable(self)
    if cfg is None:
        # (a quantized_input is only ever the LayerNorm output's 8-bit form: dropping it changes nothing)
        return getattr(cls, _BASE_ATTR).forward(self, hidden_states, attention_mask, **kwargs)
    if not cfg.fuse_norm:
        quantized_input = None
    attention_functions, eager_attention, passes_kwargs = cls._switchback_attention_impl

    layers = [getattr(self, name) for name in _PROJECTIONS]
    queries, keys, values = switchback_qkv(
        hidden_states,
        tuple(m.weight for m in layers),
        tuple(m.bias for m in layers),
        cfg,
        quantized_input=quantized_input,
    )
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    queries = queries.view(hidden_shape).transpose(1, 2)
    keys = keys.view(hidden_shape).transpose(1, 2)
    values = values.view(hidden_shape).transpose(1, 2)

    attention_interface = attention_functions.get_interface(self.config._attn_implementation, eager_attention)
    # The keyword arguments each stock forward passes (see _attention_classes).
    extra = kwargs if passes_kwargs else {"is_causal": self.is_causal}
    attn_output, attn_weights = attention_interface(
        self,
        queries,
        keys,
        values,
        attention_mask,
        scaling=self.scale,
        dropout=0.0 if not self.training else self.dropout,
        **extra,
    )
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.out_proj(attn_output), attn_weights


# base class -> its generated subclass, as _fused_class made them: read per call by quantized_input_config,
# where a functools.cache call would be one more frame for torch.compile to trace
_FUSED_CLASSES: dict[type, type] = {}


@functools.cache
def _fused_class(base: type) -> type:
    stock = _stock_class(base)
    stock_module = importlib.import_module(stock.__module__)
    # Resolved once here, so the traced forward calls no cached or import machinery (torch.compile).
    impl = (
        stock_module.ALL_ATTENTION_FUNCTIONS,
        stock_module.eager_attention_forward,
        _attention_classes()[stock],
    )
    fused = type(
        f"SwitchBackQKV{base.__name__}",
        (base,),
        {
            "forward": _fused_forward,
            _BASE_ATTR: base,
            "_switchback_attention_impl": impl,
            "__module__": __name__,
        },
    )
    _FUSED_CLASSES[base] = fused
    return fused


def is_fused_attention(module: nn.Module) -> bool:
    """True when `module`'s class is one sync_fused_attention generated."""
    return getattr(type(module), _BASE_ATTR, None) is not None


def sync_fused_attention(model: nn.Module) -> int:
    """Fuse q/k/v of every attention block that qualifies, unfuse every fused block that no longer does;
    returns the number fused."""
    fused = 0
    for module in model.modules():
        base = _base_class(module)
        if _stock_class(base) is not None and _fusable(module) is not None:
            if not is_fused_attention(module):
                # A subclass of the module's own class that only adds a forward: the instance (Parameters, hooks,
                # fully_shard's state) is untouched, and no other library's private state is read or written.
                module.__class__ = _fused_class(base)
            fused += 1
        elif is_fused_attention(module) and type(module) is _fused_class(base):
            # (A class derived from ours later, e.g. by fully_shard, is left as is: its forward falls back.)
            module.__class__ = base
    return fused


__all__ = ["is_fused_attention", "quantized_input_config", "sync_fused_attention"]
