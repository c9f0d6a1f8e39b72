"""Quantize in the producer: transformers CLIP / SigLIP encoder layers whose LayerNorms write the next linear's
8-bit input (config.fuse_norm).

A stock encoder layer computes x + attn(LN1(x)), then x + mlp(LN2(x)); with SwitchBack, the attention block's
q/k/v op(s) and the MLP's fc1 op each quantize the LayerNorm's output in a pass of their own. When the attention
block or the MLP runs as one of our generated classes with a fuse_norm config (blocks/attention.py, blocks/mlp.py),
apply_switchback swaps the layer's class for a generated subclass whose forward is the stock one except that
the LayerNorm before that block runs as blocks/producers.layernorm_quantize and hands the block its output's
8-bit form as `quantized_input`. Nothing else changes: parameters, state_dict keys, the attention and MLP
modules and their hooks (they are still called as modules), gradient checkpointing (the layer's __call__);
remove_switchback restores the class. The encoder holding fused layers gets one forward pre-hook that makes its
input contiguous (same values; _contiguous_input says why), removed with them. The forward re-checks at every call what still qualifies (a block
converted back, a LayerNorm replaced or hooked, parameters of another dtype, a batch below the token floor)
and runs the stock LayerNorm where not. Where every part of the layer runs 8-bit (blocks/layer_leaves.plan, asked
first), the same ops run as two graph leaves around the stock attention instead of through the blocks' forwards
(blocks/layer_leaves.py: less for torch.compile's Dynamo to interpret); where every linear is below its token
floor, as the stock layer's torch calls (blocks/layer_16bit.py).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..functional import runs_8bit
from ..stock_blocks import runs_stock_forward
from . import layer_leaves
from .attention import quantized_input_config as attention_quantized_input_config
from .mlp import quantized_input_config as mlp_quantized_input_config
from .producers import add_layernorm_quantize, fusable_norm, layernorm_quantize

_BASE_ATTR = "_switchback_layer_base"


def _base_class(module: nn.Module) -> type:
    return getattr(type(module), _BASE_ATTR, type(module))


def _is_stock(base: type) -> bool:
    # the encoder layers whose forward _fused_forward reproduces (the same in all of them)
    return runs_stock_forward(base, "EncoderLayer")


# The (in_features, out_features) of the linears a block's 8-bit path runs, written out: Dynamo interprets this
# at every trace (every process), where a loop over names cost it ~50 bytecode steps per block.
def _attention_shapes(attn: nn.Module) -> tuple[tuple[int, int], ...]:
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    return ((q.in_features, q.out_features), (k.in_features, k.out_features), (v.in_features, v.out_features))


def _mlp_shapes(mlp: nn.Module, whole: bool) -> tuple[tuple[int, int], ...]:
    """fc1's shape, and fc2's where the MLP runs as one op (whole)."""
    fc1 = mlp.fc1
    if not whole:
        return ((fc1.in_features, fc1.out_features),)
    fc2 = mlp.fc2
    return ((fc1.in_features, fc1.out_features), (fc2.in_features, fc2.out_features))


def _qualifies_now(norm: nn.Module, x: torch.Tensor, dtype: torch.dtype, config, shapes) -> bool:
    return config is not None and fusable_norm(norm, x.shape[-1], dtype) and runs_8bit(config, x, *shapes)


def _normalize(norm: nn.Module, x: torch.Tensor, config, shapes, fan_out: bool = False) -> tuple:
    """(norm(x), the keyword arguments that hand the next block its 8-bit form: none where it does not
    qualify). fan_out: the block's three projections each read norm(x) (attention without fuse_qkv), handed
    one view each as `projection_inputs` (blocks/attention.py says why)."""
    if not _qualifies_now(norm, x, x.dtype, config, shapes):
        return norm(x), {}
    if fan_out:
        ys, quantized = layernorm_quantize(x, norm, config, outputs=len(shapes))
        return ys[0], {"quantized_input": quantized, "projection_inputs": ys}
    y, quantized = layernorm_quantize(x, norm, config)
    return y, {"quantized_input": quantized}


def _add_normalize(norm: nn.Module, x: torch.Tensor, delta: torch.Tensor, config, shapes) -> tuple:
    """(x + delta, norm(x + delta), the keyword arguments as in _normalize): one kernel where it qualifies."""
    dtype = torch.promote_types(x.dtype, delta.dtype)
    if delta.shape != x.shape or not _qualifies_now(norm, x, dtype, config, shapes):
        h = x + delta
        return (h, *_normalize(norm, h, config, shapes))
    h, y, quantized = add_layernorm_quantize(x, delta, norm, config)
    return h, y, {"quantized_input": quantized}


def _fused_forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, **kwargs) -> torch.Tensor:
    # every part 8-bit: two graph leaves around the stock attention (blocks/layer_leaves.py); every linear below
    # its token floor: the stock layer's calls (blocks/layer_16bit.py)
    layer_plan = layer_leaves.plan(self, hidden_states)
    if layer_plan is not None:
        return layer_leaves.forward(self, layer_plan, hidden_states, attention_mask, kwargs)
    attn, mlp = self.self_attn, self.mlp
    residual = hidden_states
    attn_config = attention_quantized_input_config(attn)
    mlp_config = mlp_quantized_input_config(mlp)
    shapes = _attention_shapes(attn) if attn_config is not None else ()
    fan_out = attn_config is not None and not attn_config.fuse_qkv
    normed, quantized = _normalize(self.layer_norm1, hidden_states, attn_config, shapes, fan_out)
    if attn_config is not None:  # the block need not check again what was just checked
        quantized["checked_config"] = attn_config
    attn_out, _ = attn(hidden_states=normed, attention_mask=attention_mask, **quantized, **kwargs)

    # fc1 alone decides a separate fc1's floor; a fused block needs both linears to pay (switchback_mlp)
    shapes = _mlp_shapes(mlp, mlp_config.fuses_mlp) if mlp_config is not None else ()
    # the residual add joins LayerNorm 2's kernel: a separate add would write its sum and the LayerNorm read it
    # back, where the stock layer's compiled add + LayerNorm is one kernel
    hidden_states, normed, quantized = _add_normalize(
        self.layer_norm2, residual, attn_out, mlp_config, shapes
    )
    residual = hidden_states
    if mlp_config is not None:
        quantized["checked_config"] = mlp_config
    hidden_states = mlp(normed, **quantized)
    return residual + hidden_states


@functools.cache
def _fused_class(base: type) -> type:
    return type(
        f"SwitchBackNorm{base.__name__}",
        (base,),
        {"forward": _fused_forward, _BASE_ATTR: base, "__module__": __name__},
    )


def is_fused_layer(module: nn.Module) -> bool:
    """True when `module`'s class is one sync_fused_layers generated."""
    return getattr(type(module), _BASE_ATTR, None) is not None


def _qualifies(module: nn.Module) -> bool:
    if not _is_stock(_base_class(module)):
        return False
    blocks = (getattr(module, "self_attn", None), getattr(module, "mlp", None))
    return (blocks[0] is not None and attention_quantized_input_config(blocks[0]) is not None) or (
        blocks[1] is not None and mlp_quantized_input_config(blocks[1]) is not None
    )


def _contiguous_input(encoder: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of an encoder that holds fused layers: its input made contiguous (same values).

    A fused layer returns a contiguous tensor, where the stock layer keeps its input's layout. SigLIP's vision
    embeddings are a transposed view (no class token is concatenated, as in CLIP), so without this the first
    layer of a compiled-per-layer tower would see other strides than the rest, and torch.compile would compile
    that tower's layer twice (a third graph, its Dynamo trace and Inductor compile, every start)."""
    if args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous():
        return (args[0].contiguous(), *args[1:]), kwargs
    x = kwargs.get("inputs_embeds")
    if isinstance(x, torch.Tensor) and not x.is_contiguous():
        return args, {**kwargs, "inputs_embeds": x.contiguous()}
    return None


def _sync_encoder_hook(encoder: nn.Module, fused: bool) -> None:
    # found by value in the module's hook dict (no handle kept: nothing extra to copy or pickle with the model)
    ours = [key for key, hook in encoder._forward_pre_hooks.items() if hook is _contiguous_input]
    if fused and not ours:
        encoder.register_forward_pre_hook(_contiguous_input, with_kwargs=True)
    elif not fused:
        for key in ours:
            del encoder._forward_pre_hooks[key]
            encoder._forward_pre_hooks_with_kwargs.pop(key, None)


def sync_fused_layers(model: nn.Module) -> int:
    """Give every encoder layer whose attention block or MLP takes an 8-bit input from its LayerNorm the fused
    forward, and every fused layer that no longer qualifies its class back; returns the number fused. Run after
    sync_fused_attention and sync_fused_mlps (which give the blocks their classes). An encoder (a module with
    `layers`) holding a fused layer gets _contiguous_input as a forward pre-hook, removed with the last one."""
    fused = 0
    for module in model.modules():
        base = _base_class(module)
        if _qualifies(module):
            if not is_fused_layer(module):
                # A subclass that only adds a forward, as in blocks/attention.py: the instance is untouched.
                module.__class__ = _fused_class(base)
            fused += 1
        elif is_fused_layer(module) and type(module) is _fused_class(base):
            module.__class__ = base
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList):
            _sync_encoder_hook(module, any(is_fused_layer(layer) for layer in layers))
    return fused


__all__ = ["is_fused_layer", "sync_fused_layers"]
