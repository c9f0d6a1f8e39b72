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
nodes and interprets only the checks. The checks are those of the block path, plus what calling the blocks as
modules honoured: no hooks on the attention block or the MLP (nor global module hooks), no forward set on their
instances, no module.compile() of them. Anything else (a part below its token floor, a hook, another dtype, a
replaced module) takes the block path. Note that transformers registers a forward hook on every attention block
at the first call that asks for output_attentions or output_hidden_states and keeps it: from then on the layers
take the block path (same results, the block path's longer trace). Dynamo's trace per layer, with and without
the leaves: benchmarks/dynamo_trace.py, BENCHMARKS.md (Compile warm-up). HF_SWITCHBACK_LAYER_LEAVES=0 turns this
path off (measurements of the block path).
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.nn.modules import module as module_globals

from ..functional import runs_8bit, switchback_linear, switchback_mlp
from ..kernels import graph_leaf
from ..modules import is_plain_layer
from ..weight_operands import operands_for
from .attention import attend
from .linear_activation import switchback_linear_activation
from .mlp import ACTIVATION_ATTR, activation_feeds_fc2
from .producers import fusable_norm, quantize_rows
from .qkv import switchback_qkv

# Read once: the switch changes which graph Dynamo records, not what a graph computes.
ENABLED = os.environ.get("HF_SWITCHBACK_LAYER_LEAVES", "1") != "0"


def _called_plainly(module: nn.Module) -> bool:
    """Whether calling `module` runs just its class's forward: no hooks, no forward set on the instance, no
    module.compile() (its __call__ honours each of them, and the leaves do not call it)."""
    return not (
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or "forward" in module.__dict__
        or getattr(module, "_compiled_call_impl", None) is not None
    )


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


def _global_hooks() -> bool:
    return bool(_GLOBAL_FORWARD or _GLOBAL_FORWARD_PRE or _GLOBAL_BACKWARD or _GLOBAL_BACKWARD_PRE)


def plan(layer: nn.Module, x: torch.Tensor, attn_config, mlp_config) -> tuple | None:
    """What the two leaves need beyond tensors when every part of `layer` runs 8-bit on its input x right now,
    else None (the block path runs). attn_config, mlp_config: what the blocks' quantized_input_config returned
    (not None). Written flat, without loops or helper frames where one will do: Dynamo interprets it per trace."""
    attn, mlp = layer.self_attn, layer.mlp
    if not ENABLED or not (_called_plainly(attn) and _called_plainly(mlp)) or _global_hooks():
        return None
    width, dtype = x.shape[-1], x.dtype
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        # the residual add's dtype: the attention output comes back in the autocast dtype
        dtype = torch.promote_types(dtype, torch.get_autocast_dtype(device_type))
    if not (
        fusable_norm(layer.layer_norm1, width, x.dtype) and fusable_norm(layer.layer_norm2, width, dtype)
    ):
        return None
    q, k, v, out = attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj
    if not runs_8bit(
        attn_config,
        x,
        (q.in_features, q.out_features),
        (k.in_features, k.out_features),
        (v.in_features, v.out_features),
    ):
        return None
    # (the residual add joins LayerNorm 2's kernel only for out_proj's output of the residual's shape)
    if not is_plain_layer(out) or out.out_features != width or out.switchback_config is not attn_config:
        return None
    if mlp_config is not attn_config or not runs_8bit(attn_config, x, (out.in_features, out.out_features)):
        return None
    fc1, fc2 = mlp.fc1, mlp.fc2
    kind, _, whole = getattr(mlp, ACTIVATION_ATTR)
    fc1_shape = (fc1.in_features, fc1.out_features)
    if whole:
        if not runs_8bit(attn_config, x, fc1_shape, (fc2.in_features, fc2.out_features)):
            return None
    else:
        kind = activation_feeds_fc2(mlp, attn_config, x)
        if (
            kind is None
            or fc2.switchback_config is not attn_config
            or not runs_8bit(attn_config, x, fc1_shape)
        ):
            return None
    return attn_config, kind, whole


def forward(layer: nn.Module, layer_plan: tuple, hidden_states: torch.Tensor, attention_mask, kwargs: dict):
    """The layer's output through the two leaves (see the module docstring); layer_plan: what plan returned."""
    config, kind, whole = layer_plan
    attn, mlp, norm1, norm2 = layer.self_attn, layer.mlp, layer.layer_norm1, layer.layer_norm2
    q, k, v, out, fc1, fc2 = attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj, mlp.fc1, mlp.fc2
    queries, keys, values = graph_leaf.call(
        "layer_attention_inputs",
        hidden_states,
        norm1.weight,
        norm1.bias,
        norm1.eps,
        (q.weight, k.weight, v.weight),
        (q.bias, k.bias, v.bias),
        config,
        (operands_for(q), operands_for(k), operands_for(v)),
    )
    attn_output, _ = attend(attn, queries, keys, values, attention_mask, kwargs)
    return graph_leaf.call(
        "layer_attention_output",
        attn_output,
        hidden_states,
        (out.weight, out.bias, operands_for(out)),
        (norm2.weight, norm2.bias, norm2.eps),
        (fc1.weight, fc1.bias, operands_for(fc1)),
        (fc2.weight, fc2.bias, operands_for(fc2)),
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
