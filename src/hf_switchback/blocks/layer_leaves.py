"""A fused encoder layer whose every linear runs its 8-bit path, as two graph leaves (kernels/graph_leaf.py).

torch.compile's Dynamo interprets, bytecode by bytecode, the Python of whatever a compiled layer calls, at every
start (its work is not cached between processes: the warm start pays it too). A fused encoder layer
(blocks/encoder_layer.py) reaches its ops through the attention block's and the MLP's forwards, each op one leaf
behind its own public function, each leaf's config rebuilt from its fields in Dynamo's graph: Dynamo interpreted
~2,300 bytecode steps per layer, three times the stock layer's. Where the layer's checks find that every part
runs 8-bit (both LayerNorms write their linears' 8-bit inputs, out_proj takes its input from our quantize kernel,
the MLP runs as one op or as fc1 + activation feeding fc2) with one config object for all six linears (what
apply_switchback gives them; one config argument per leaf), the layer instead calls two leaves around the stock
attention:

    leaf "attention inputs"   LayerNorm 1 + its 8-bit form, then q/k/v (three ops, or one with fuse_qkv)
    stock attention           blocks/attention.attend: the transformers attention function, as the block runs it
    leaf "attention output"   out_proj's quantize and op, the residual add + LayerNorm 2 + its 8-bit form, the MLP
                              (fc1 + activation + fc2 as in blocks/mlp.py), the second residual add

The leaves call the same public ops in the same order as the blocks' forwards, so eager results are bitwise
those of the block path, and the graph AOT autograd traces from them holds the same operators. Dynamo records two
nodes and interprets only the checks (`plan`, one flat function that the layer's forward asks first). The checks
are those of the block path, stricter where that reads less (all six linears exactly SwitchBackLinear, unhooked,
with one config object), plus what calling the blocks as modules honoured: no hooks on the attention block or the
MLP (nor global module hooks), no forward set on their instances, no module.compile() of them. Where the same
checks find every linear below its token floor instead, the layer runs as the stock layer's torch calls
(blocks/layer_16bit.py). Anything else (some parts above their token floor and others below, a hook, another
dtype, a replaced module, equal but distinct configs) takes the block path, which checks each block on its own.
Note that transformers registers a forward hook on every attention block at the first call that asks for
output_attentions or output_hidden_states and keeps it: from then on the layers take the block path (same
results, the block path's longer trace). Dynamo's trace per layer, with and without
the leaves: benchmarks/dynamo_trace.py, BENCHMARKS.md (Compile warm-up). HF_SWITCHBACK_LAYER_LEAVES=0 turns both
paths off (measurements of the block path).
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.nn.modules import module as module_globals

from ..functional import switchback_linear, switchback_mlp, token_floor_range
from ..kernels import graph_leaf
from ..modules import SwitchBackLinear
from ..weight_cache import WEIGHT_Q
from ..weight_operands import operands_for
from . import attention, layer_16bit
from . import mlp as mlp_blocks
from .attention import attend
from .linear_activation import switchback_linear_activation
from .mlp import ACTIVATION_ATTR
from .producers import quantize_rows
from .qkv import switchback_qkv

# Read once: the switch changes which graph Dynamo records, not what a graph computes.
ENABLED = os.environ.get("HF_SWITCHBACK_LAYER_LEAVES", "1") != "0"


# torch's registries of global module hooks (torch.nn.modules.module.register_module_forward_hook & co.): private
# names, read where present (a torch without one has no such hooks to honour)
_GLOBAL_FORWARD, _GLOBAL_FORWARD_PRE, _GLOBAL_BACKWARD, _GLOBAL_BACKWARD_PRE = (
    getattr(module_globals, name, {})
    for name in (
        "_global_forward_hooks",
        "_global_forward_pre_hooks",
        "_global_backward_hooks",
        "_global_backward_pre_hooks",
    )
)


def plan(layer: nn.Module, x: torch.Tensor) -> tuple | None:
    """(config, activation kind, whole, below) when every part of `layer` runs 8-bit on its input x right now
    (below False), or every linear runs its exact 16-bit matmul, each below its own token floor (below True:
    blocks/layer_16bit.py), else None (then the block path runs, and each block checks itself again).

    What it asks is what the blocks' own checks and calling them as modules would ask, made stricter where that
    is cheaper (all six linears exactly SwitchBackLinear, unhooked, with one config object; the block path still
    takes the rest): the blocks of our generated classes (blocks/attention.py, blocks/mlp.py), called plainly (no
    hooks, global ones included, no forward set on the instance, no module.compile()); their linears without an
    inference weight cache; both LayerNorms plain, unhooked, over x's width, their parameters in the dtype they
    will see; the MLP's activation the one it was fused with and, unless the MLP runs as one op, writing fc2's
    8-bit input; x's rows at or above the token floor of all six linears (the largest of their floors, what
    each block's own check would require of its part), or below all six (the smallest). Written as one flat
    function that reads each attribute once: Dynamo interprets it at every trace (every process, the warm start
    too), and each frame it enters and each object it reads costs it time (BENCHMARKS.md, Compile warm-up)."""
    if not ENABLED:
        return None
    attn, mlp, norm1, norm2 = layer.self_attn, layer.mlp, layer.layer_norm1, layer.layer_norm2
    attn_type, mlp_type = type(attn), type(mlp)
    if attn_type is not attention.FUSED_CLASSES.get(getattr(attn_type, attention.BASE_ATTR, None)):
        return None
    if mlp_type is not mlp_blocks.FUSED_CLASSES.get(getattr(mlp_type, mlp_blocks.UNFUSED_ATTR, None)):
        return None
    q, k, v, out, fc1, fc2 = attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj, mlp.fc1, mlp.fc2
    if (
        type(q) is not SwitchBackLinear
        or type(k) is not SwitchBackLinear
        or type(v) is not SwitchBackLinear
        or type(out) is not SwitchBackLinear
        or type(fc1) is not SwitchBackLinear
        or type(fc2) is not SwitchBackLinear
    ):
        return None
    config = q.switchback_config
    if (
        k.switchback_config is not config
        or v.switchback_config is not config
        or out.switchback_config is not config
        or fc1.switchback_config is not config
        or fc2.switchback_config is not config
        or not config.fuse_norm
    ):
        return None
    # the token floors early: a layer with some linears above their floor and some below leaves here, before
    # the reads the block path then makes again
    lowest = floor = config.min_tokens
    if floor is None:
        lowest, floor = token_floor_range(
            config,
            x.device,
            (q.in_features, q.out_features),
            (k.in_features, k.out_features),
            (v.in_features, v.out_features),
            (out.in_features, out.out_features),
            (fc1.in_features, fc1.out_features),
            (fc2.in_features, fc2.out_features),
        )
    tokens = x.shape[:-1].numel()
    below = tokens < floor
    if tokens == 0 or (below and tokens >= lowest):
        return None
    if (
        attn._forward_hooks
        or attn._forward_pre_hooks
        or attn._backward_hooks
        or attn._backward_pre_hooks
        or mlp._forward_hooks
        or mlp._forward_pre_hooks
        or mlp._backward_hooks
        or mlp._backward_pre_hooks
        or "forward" in attn.__dict__
        or "forward" in mlp.__dict__
        or getattr(attn, "_compiled_call_impl", None) is not None
        or getattr(mlp, "_compiled_call_impl", None) is not None
        or _GLOBAL_FORWARD
        or _GLOBAL_FORWARD_PRE
        or _GLOBAL_BACKWARD
        or _GLOBAL_BACKWARD_PRE
    ):
        return None
    if (
        q._forward_hooks
        or q._forward_pre_hooks
        or k._forward_hooks
        or k._forward_pre_hooks
        or v._forward_hooks
        or v._forward_pre_hooks
        or out._forward_hooks
        or out._forward_pre_hooks
        or fc1._forward_hooks
        or fc1._forward_pre_hooks
        or fc2._forward_hooks
        or fc2._forward_pre_hooks
    ):
        return None
    # (weight_cache.has_weight_cache, written out)
    if (
        q._buffers.get(WEIGHT_Q) is not None
        or k._buffers.get(WEIGHT_Q) is not None
        or v._buffers.get(WEIGHT_Q) is not None
        or out._buffers.get(WEIGHT_Q) is not None
        or fc1._buffers.get(WEIGHT_Q) is not None
        or fc2._buffers.get(WEIGHT_Q) is not None
    ):
        return None
    width = x.shape[-1]
    # (the residual add joins LayerNorm 2's kernel only for out_proj's output of the residual's shape)
    if (
        not (q.in_features == k.in_features == v.in_features)
        or not ((q.bias is None) == (k.bias is None) == (v.bias is None))
        or out.out_features != width
    ):
        return None
    if (
        type(norm1) is not nn.LayerNorm
        or type(norm2) is not nn.LayerNorm
        or norm1._forward_hooks
        or norm1._forward_pre_hooks
        or norm2._forward_hooks
        or norm2._forward_pre_hooks
        or tuple(norm1.normalized_shape) != (width,)
        or tuple(norm2.normalized_shape) != (width,)
    ):
        return None
    dtype, device = x.dtype, x.device
    residual_dtype = dtype
    if torch.is_autocast_enabled(device.type):
        # the residual add's dtype: the attention output comes back in the autocast dtype
        residual_dtype = torch.promote_types(dtype, torch.get_autocast_dtype(device.type))
    weight1, bias1, weight2, bias2 = norm1.weight, norm1.bias, norm2.weight, norm2.bias
    if not (
        (weight1 is None or weight1.dtype == dtype)
        and (bias1 is None or bias1.dtype == dtype)
        and (weight2 is None or weight2.dtype == residual_dtype)
        and (bias2 is None or bias2.dtype == residual_dtype)
    ):
        return None
    kind, activation_type, whole = getattr(mlp, ACTIVATION_ATTR)
    if type(mlp.activation_fn) is not activation_type or config.fuses_mlp is not whole:
        return None
    if not whole and (kind is None or not config.fuse_activation):
        return None  # fc2 quantizes its own input: a path the leaves do not cover
    return config, kind, whole, below


def forward(layer: nn.Module, layer_plan: tuple, hidden_states: torch.Tensor, attention_mask, kwargs: dict):
    """The layer's output through the two leaves (see the module docstring), or where every linear is below its
    token floor, as the stock layer's calls (blocks/layer_16bit.py); layer_plan: what plan returned."""
    config, kind, whole, below = layer_plan
    if below:
        return layer_16bit.forward(layer, kind, whole, hidden_states, attention_mask, kwargs)
    attn, mlp, norm1, norm2 = layer.self_attn, layer.mlp, layer.layer_norm1, layer.layer_norm2
    q, k, v, out, fc1, fc2 = attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj, mlp.fc1, mlp.fc2
    # the cached weight operands, where the option keeps them (six lookups Dynamo would trace for nothing
    # otherwise; without them the ops quantize the weights themselves, the same numerics)
    if config.kernel_options.cache_weight_operands:
        operands = (operands_for(q), operands_for(k), operands_for(v))
        out_operands, fc1_operands, fc2_operands = operands_for(out), operands_for(fc1), operands_for(fc2)
    else:
        operands, out_operands, fc1_operands, fc2_operands = (None, None, None), None, None, None
    queries, keys, values = graph_leaf.call(
        "layer_attention_inputs",
        hidden_states,
        norm1.weight,
        norm1.bias,
        norm1.eps,
        (q.weight, k.weight, v.weight),
        (q.bias, k.bias, v.bias),
        config,
        operands,
    )
    attn_output, _ = attend(attn, queries, keys, values, attention_mask, kwargs)
    return graph_leaf.call(
        "layer_attention_output",
        attn_output,
        hidden_states,
        (out.weight, out.bias, out_operands),
        (norm2.weight, norm2.bias, norm2.eps),
        (fc1.weight, fc1.bias, fc1_operands),
        (fc2.weight, fc2.bias, fc2_operands),
        kind,
        whole,
        config,
    )


@graph_leaf.op("layer_attention_inputs")
def _attention_inputs(x, norm_weight, norm_bias, eps, weights, biases, config, operands) -> tuple:
    """(queries, keys, values) (*, n_i) from LayerNorm 1's 8-bit output, as blocks/attention._projections."""
    if config.fuse_qkv:
        y, q, scale = graph_leaf.call("layernorm_quantize", x, norm_weight, norm_bias, eps, config, 1)
        return switchback_qkv(
            y, weights, biases, config, quantized_input=(q, scale), weight_operands=operands
        )
    # one view of the LayerNorm's output per projection (blocks/attention.py says why)
    y_q, y_k, y_v, q, scale = graph_leaf.call("layernorm_quantize", x, norm_weight, norm_bias, eps, config, 3)
    quantized = (q, scale)
    return (
        switchback_linear(
            y_q, weights[0], biases[0], config, quantized_input=quantized, weight_operands=operands[0]
        ),
        switchback_linear(
            y_k, weights[1], biases[1], config, quantized_input=quantized, weight_operands=operands[1]
        ),
        switchback_linear(
            y_v, weights[2], biases[2], config, quantized_input=quantized, weight_operands=operands[2]
        ),
    )


@graph_leaf.op("layer_attention_output")
def _attention_output(attn_output, residual, out, norm, fc1, fc2, kind, whole, config) -> torch.Tensor:
    """residual + out_proj(attn_output), then that + MLP(LayerNorm 2(it)): out, fc1, fc2 (weight, bias,
    operands); norm (weight, bias, eps)."""
    out_weight, out_bias, out_operands = out
    quantized = quantize_rows(attn_output, config)
    delta = switchback_linear(
        attn_output, out_weight, out_bias, config, quantized_input=quantized, weight_operands=out_operands
    )
    fc1_weight, fc1_bias, fc1_operands = fc1
    fc2_weight, fc2_bias, fc2_operands = fc2
    h, y, q, scale = graph_leaf.call("add_layernorm_quantize", residual, delta, *norm, config)
    if whole:
        operands = None if fc1_operands is None or fc2_operands is None else (fc1_operands, fc2_operands)
        mlp_out = switchback_mlp(
            y,
            fc1_weight,
            fc1_bias,
            fc2_weight,
            fc2_bias,
            kind,
            config,
            quantized_input=(q, scale),
            weight_operands=operands,
        )
    else:
        a, a_quantized = switchback_linear_activation(
            y, fc1_weight, fc1_bias, kind, config, quantized_input=(q, scale), weight_operands=fc1_operands
        )
        mlp_out = switchback_linear(
            a, fc2_weight, fc2_bias, config, quantized_input=a_quantized, weight_operands=fc2_operands
        )
    return h + mlp_out


__all__ = ["forward", "plan"]
