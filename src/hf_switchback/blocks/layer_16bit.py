"""A fused encoder layer whose every linear is below its token floor, run as the stock layer's torch calls.

Below its token floor a SwitchBack linear runs the exact 16-bit matmul (functional.token_floor): a short text
tower (ViT-L/14 at batch 128: 9,856 tokens against the default benchmark floor of 16,384), or every layer of a
width where 8-bit never paid on this GPU. The block path (blocks/encoder_layer.py) still reaches those matmuls
through the attention block's and the MLP's forwards and their checks, each linear a graph leaf of its own: for
torch.compile's Dynamo, which interprets that Python at every start (the warm one too), 1.8x the stock layer's
trace on a CPU, for a layer that computes what the stock layer computes. Where blocks/layer_leaves.plan finds
the layer plain (its checks) and each of its six linears below its own floor, the layer runs `forward` here
instead: the ops the block path runs there, written as the stock layer's torch calls, which Dynamo traces about
as fast as the stock layer's (BENCHMARKS.md, Compile warm-up). Results are the block path's
(tests/test_layer_leaves.py: bitwise in eager, with and without autocast, every MLP mode).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.reference import apply_activation
from .attention import attend


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, autocast_dtype) -> torch.Tensor:
    """What a SwitchBack linear computes below its token floor (functional's exact path, which casts x, weight and
    bias to the autocast dtype where autocast is on, else to x's dtype, and multiplies x's rows as one 2-D
    matrix). Under autocast (autocast_dtype: its dtype, else None), F.linear on x as it is: autocast makes the
    same casts, and torch multiplies a contiguous x's rows as one matrix (as with a 2-D x). Casts only where a
    dtype differs: each is a node more that Dynamo records and runs on fake tensors."""
    if autocast_dtype is not None:
        if x.dtype is not torch.float64:  # (which autocast leaves as it is)
            return F.linear(x, weight, bias)
        dtype = autocast_dtype
        x = x.to(dtype)
    else:
        dtype = x.dtype
    if weight.dtype is not dtype:
        weight = weight.to(dtype)
    if bias is not None and bias.dtype is not dtype:
        bias = bias.to(dtype)
    return F.linear(x, weight, bias)


def forward(
    layer: nn.Module, kind: str | None, whole: bool, hidden_states: torch.Tensor, attention_mask, kwargs: dict
) -> torch.Tensor:
    """The layer's output where blocks/layer_leaves.plan found every linear below its floor. kind, whole: the
    MLP's activation and whether it runs as one op (functional.switchback_mlp, whose 16-bit path applies the
    activation as kernels/reference.apply_activation; otherwise the block calls its activation module)."""
    attn, mlp, norm1, norm2 = layer.self_attn, layer.mlp, layer.layer_norm1, layer.layer_norm2
    q, k, v, out, fc1, fc2 = attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj, mlp.fc1, mlp.fc2
    # asked once for the six linears (each ask is a call Dynamo interprets at every trace)
    device_type = hidden_states.device.type
    cast = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    residual = hidden_states
    normed = F.layer_norm(hidden_states, norm1.normalized_shape, norm1.weight, norm1.bias, norm1.eps)
    attn_output, _ = attend(
        attn,
        _linear(normed, q.weight, q.bias, cast),
        _linear(normed, k.weight, k.bias, cast),
        _linear(normed, v.weight, v.bias, cast),
        attention_mask,
        kwargs,
    )
    hidden_states = residual + _linear(attn_output, out.weight, out.bias, cast)
    residual = hidden_states
    normed = F.layer_norm(hidden_states, norm2.normalized_shape, norm2.weight, norm2.bias, norm2.eps)
    h = _linear(normed, fc1.weight, fc1.bias, cast)
    h = apply_activation(h, kind) if whole else mlp.activation_fn(h)
    return residual + _linear(h, fc2.weight, fc2.bias, cast)


__all__ = ["forward"]
