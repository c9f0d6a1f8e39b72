"""Our forward for transformers CLIP / SigLIP attention blocks: q/k/v as one SwitchBack op, or the three layers'
ops fed by the LayerNorm's 8-bit output.

When apply_switchback converts q_proj, k_proj and v_proj of a `CLIPAttention` (or `SiglipAttention` /
`Siglip2Attention`) with one config whose `fuse_qkv` or `fuse_norm` is on, the block's class is swapped for a
generated subclass whose forward is the stock one except that:
- with fuse_qkv, q, k, v come from `blocks.qkv.switchback_qkv` (input quantized once, one N = 3d GEMM);
- with fuse_norm, the forward takes its input's 8-bit form as `quantized_input` when the LayerNorm before it
  wrote that form (blocks/encoder_layer.py). Without fuse_qkv it also takes `projection_inputs`, one view of
  the LayerNorm's output per projection, so that their three gradients are summed in the LayerNorm's input
  dtype (float32 under autocast) as in the stock graph, not in the 16-bit dtype the linears return them in;
- with fuse_norm, out_proj's 8-bit input comes from our one-pass kernel (blocks/producers.quantize_rows).
Nothing else changes: the module is still an instance of its class, q_proj / k_proj / v_proj stay the same
SwitchBackLinear modules holding the same Parameters, so state_dict keys, FSDP2's parameter records and PEFT
target names are untouched, and remove_switchback restores the original class. The forward re-checks at every
call that the block still qualifies (the three layers plain SwitchBackLinear with one config, no hooks on them,
no inference weight cache; out_proj likewise for its own path) and otherwise runs the stock forward: a PEFT
LoRA wrapper on q_proj, a narrower re-conversion or hooks get the layer path.
"""

from __future__ import annotations

import functools
import importlib

import torch
from torch import nn

from ..functional import runs_8bit, switchback_linear
from ..modules import SwitchBackLinear, is_plain_layer
from ..stock_blocks import stock_classes
from ..weight_cache import has_weight_cache
from ..weight_operands import operands_for
from .producers import quantize_rows
from .qkv import switchback_qkv

# Class attribute of the generated subclasses: the stock class they were made from.
BASE_ATTR = "_switchback_attention_base"


@functools.cache
def _attention_classes() -> dict[type, bool]:
    """The transformers attention blocks whose forward this module reproduces, each mapped to whether that
    forward passes its **kwargs on to the attention function (CLIP does; SigLIP passes is_causal instead)."""
    return {cls: module == "clip" for module, cls in stock_classes("Attention").items()}


def _base_class(module: nn.Module) -> type:
    return getattr(type(module), BASE_ATTR, type(module))


def _stock_class(base: type) -> type | None:
    """The transformers class whose unmodified forward `base` runs, else None."""
    for cls in _attention_classes():
        if issubclass(base, cls) and base.forward is cls.forward:
            return cls
    return None


def _fusable(module: nn.Module):
    """The shared SwitchBackConfig when q/k/v of `module` can run as our forward right now (one op with
    fuse_qkv, the three layers' ops with fuse_norm), else None."""
    # Runs at every forward, twice per block, and torch.compile's Dynamo interprets it each time it traces (every
    # process, the warm start too): plain comparisons, no generator expressions (each one a frame to trace).
    q, k, v = (
        getattr(module, "q_proj", None),
        getattr(module, "k_proj", None),
        getattr(module, "v_proj", None),
    )
    # Exact type: a subclass (or a PEFT wrapper, which is not a SwitchBackLinear at all) may compute more.
    if type(q) is not SwitchBackLinear or type(k) is not SwitchBackLinear or type(v) is not SwitchBackLinear:
        return None
    cfg = q.switchback_config
    if not (cfg.fuse_qkv or cfg.fuse_norm) or not (_same_config(k, cfg) and _same_config(v, cfg)):
        return None
    if not (q.in_features == k.in_features == v.in_features) or not (
        (q.bias is None) == (k.bias is None) == (v.bias is None)
    ):
        return None
    # Our forward calls no layer's forward: hooks on a layer (or an inference weight cache its forward would
    # serve) would be skipped, so those blocks take the layer path.
    if not (_unhooked(q) and _unhooked(k) and _unhooked(v)):
        return None
    return cfg


def _same_config(layer: SwitchBackLinear, cfg) -> bool:
    # identity first: one config object is the usual case, and comparing two dataclasses is ~30 traced steps
    return layer.switchback_config is cfg or layer.switchback_config == cfg


def _unhooked(layer: SwitchBackLinear) -> bool:
    return not (layer._forward_hooks or layer._forward_pre_hooks or has_weight_cache(layer))


def quantized_input_config(module: nn.Module):
    """The SwitchBackConfig with which `module`'s forward takes its input's 8-bit form (`quantized_input`) right
    now, else None. Without fuse_qkv the forward also takes `projection_inputs`: one view of the LayerNorm's
    output per projection (blocks/producers.layernorm_quantize with outputs=3)."""
    cfg = _fusable(module) if type(module) is FUSED_CLASSES.get(_base_class(module)) else None
    return cfg if cfg is not None and cfg.fuse_norm else None


def _out_projection(self, attn_output: torch.Tensor) -> torch.Tensor:
    """out_proj(attn_output); with fuse_norm, the input's 8-bit form from our one-pass kernel (the attention
    kernel that writes attn_output cannot quantize it, and under torch.compile a quantize left to Inductor
    would be a pass of its own that reads each row twice: blocks/producers.quantize_rows)."""
    out_proj = self.out_proj
    if not is_plain_layer(out_proj):
        return out_proj(attn_output)
    cfg = out_proj.switchback_config
    if not cfg.fuse_norm or not runs_8bit(cfg, attn_output, (out_proj.in_features, out_proj.out_features)):
        return out_proj(attn_output)
    quantized = quantize_rows(attn_output, cfg)
    operands = operands_for(out_proj)
    return switchback_linear(
        attn_output, out_proj.weight, out_proj.bias, cfg, quantized_input=quantized, weight_operands=operands
    )


def _projections(self, cfg, hidden_states, quantized_input, projection_inputs):
    """(queries, keys, values) as (batch, tokens, heads x head_dim)."""
    q, k, v = self.q_proj, self.k_proj, self.v_proj
    # the cached weight operands: the 8-bit path runs where the LayerNorm wrote its input's 8-bit form, else
    # operands_for asks the token floor
    probe = hidden_states if quantized_input is None else None
    operands = (operands_for(q, probe), operands_for(k, probe), operands_for(v, probe))
    if cfg.fuse_qkv:
        return switchback_qkv(
            hidden_states,
            (q.weight, k.weight, v.weight),
            (q.bias, k.bias, v.bias),
            cfg,
            quantized_input=quantized_input,
            weight_operands=operands,
        )
    # (three calls written out: a generator expression is one more frame for torch.compile's Dynamo to trace)
    x_q, x_k, x_v = projection_inputs or (hidden_states,) * 3
    o_q, o_k, o_v = operands
    return (
        switchback_linear(x_q, q.weight, q.bias, cfg, quantized_input=quantized_input, weight_operands=o_q),
        switchback_linear(x_k, k.weight, k.bias, cfg, quantized_input=quantized_input, weight_operands=o_k),
        switchback_linear(x_v, v.weight, v.bias, cfg, quantized_input=quantized_input, weight_operands=o_v),
    )


def _fused_forward(
    self,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    quantized_input: tuple[torch.Tensor, torch.Tensor] | None = None,
    projection_inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    checked_config=None,
    **kwargs,
):
    cls = type(self)
    # checked_config: what quantized_input_config just returned for this block (the encoder layer's forward
    # passes it on: checking again would be ~110 more bytecode steps per block for Dynamo, every process)
    cfg = checked_config if checked_config is not None else _fusable(self)
    if cfg is None:
        # (a quantized_input is only ever the LayerNorm output's 8-bit form, and projection_inputs views of
        # hidden_states: dropping them changes nothing)
        return getattr(cls, BASE_ATTR).forward(self, hidden_states, attention_mask, **kwargs)
    if not cfg.fuse_norm:
        quantized_input = projection_inputs = None
    queries, keys, values = _projections(self, cfg, hidden_states, quantized_input, projection_inputs)
    attn_output, attn_weights = attend(self, queries, keys, values, attention_mask, kwargs)
    return _out_projection(self, attn_output), attn_weights


def attend(self, queries, keys, values, attention_mask, kwargs: dict) -> tuple:
    """The stock forward between the projections and out_proj, for a block of our class: (the attention's output
    as (batch, tokens, heads x head_dim), contiguous, as out_proj reads it; its weights or None). queries, keys,
    values: (batch, tokens, heads x head_dim); kwargs: the block's keyword arguments."""
    attention_functions, eager_attention, passes_kwargs = type(self)._switchback_attention_impl
    input_shape = queries.shape[:-1]
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
    return attn_output.reshape(*input_shape, -1).contiguous(), attn_weights


# base class -> its generated subclass, as _fused_class made them: read per call by quantized_input_config and
# blocks/layer_leaves.plan, where a functools.cache call would be one more frame for torch.compile to trace
FUSED_CLASSES: dict[type, type] = {}


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
        f"SwitchBack{base.__name__}",
        (base,),
        {
            "forward": _fused_forward,
            BASE_ATTR: base,
            "_switchback_attention_impl": impl,
            "__module__": __name__,
        },
    )
    FUSED_CLASSES[base] = fused
    return fused


def _has_our_class(module: nn.Module) -> bool:
    return getattr(type(module), BASE_ATTR, None) is not None


def is_fused_attention(module: nn.Module) -> bool:
    """True when `module` runs q/k/v as one op right now (our class, fuse_qkv): not for a block of our class that
    runs the three layers' ops with the LayerNorm's 8-bit input (fuse_norm)."""
    if not _has_our_class(module):
        return False
    cfg = _fusable(module)
    return cfg is not None and cfg.fuse_qkv


def sync_fused_attention(model: nn.Module) -> int:
    """Give every attention block that qualifies our forward, and every block of ours that no longer does its
    class back; returns the number whose q/k/v run as one op."""
    fused = 0
    for module in model.modules():
        base = _base_class(module)
        cfg = _fusable(module) if _stock_class(base) is not None else None
        if cfg is not None:
            if not _has_our_class(module):
                # A subclass of the module's own class that only adds a forward: the instance (Parameters, hooks,
                # fully_shard's state) is untouched, and no other library's private state is read or written.
                module.__class__ = _fused_class(base)
            fused += cfg.fuse_qkv
        elif _has_our_class(module) and type(module) is _fused_class(base):
            # (A class derived from ours later, e.g. by fully_shard, is left as is: its forward falls back.)
            module.__class__ = base
    return fused


__all__ = ["attend", "is_fused_attention", "quantized_input_config", "sync_fused_attention"]
