"""fc1 and the activation of a SwitchBack MLP as one backward node (config.fuse_activation, blocks/mlp.py).

forward   h = fc1's 8-bit GEMM (its input quantized, or the LayerNorm's 8-bit form), then one kernel writes
          a = act(h) (16-bit, fc2's grad-weight operand) and fc2's 8-bit input (q, scale) from h. The kernels
          run outside autograd (q and scale carry no gradient); a is given its gradient by a one-output
          autograd op, as in blocks/producers.py (why one output: see there).
backward  one kernel reads fc2's input gradient g and h once and writes g_h = g * act'(h) (16-bit, for fc1's
          grad-weight GEMM), its row-wise 8-bit form (fc1's grad-input GEMM) and its float32 column sum
          (fc1's bias gradient): the activation's backward and fc1's output-gradient quantize, which the
          separate ops run as two passes over the (tokens, 4d) gradient. Then fc1's backward as in
          functional.linear_grads.

Numerics: those of switchback_linear followed by the activation and the quantize of act(h), except that g_h
comes from the kernels' activation derivative (kernels/reference.activation_backward states it) instead of
aten.gelu_backward; both compute in float32 and round once to g's dtype.
"""

from __future__ import annotations

import torch

from ..config import SwitchBackConfig
from ..functional import (
    _autocast_off,
    _flatten_input,
    check_config,
    check_quantized_input,
    check_weight_operands,
    linear_grads,
    linear_spec,
    quantize_weight,
    quantized_dtypes,
)
from ..kernels import graph_leaf
from ..kernels.backends import get_kernels


class _LinearActivationGradFn(torch.autograd.Function):
    """Returns a = act(h) as the fused kernel wrote it, with the backward of act(fc1(x)) attached."""

    @staticmethod
    def forward(ctx, x, weight, bias, a, h, spec, activation, kernels, x_q=None, x_scale=None, weight_t=()):
        memory_efficient = spec[1]
        # weight_t: the weight's cached transposed 8-bit form (wt_q, wt_scale), or () (quantized in backward)
        ctx.save_for_backward(h, *((x_q, x_scale, weight) if memory_efficient else (x, weight)), *weight_t)
        ctx.config = (spec, activation, x.dtype, None if bias is None else bias.dtype)
        ctx.kernels = kernels  # the forward's kernel set (kernels/graph_leaf.py says why)
        return a.view_as(a)

    @staticmethod
    def backward(ctx, grad_a):
        spec, activation, x_dtype, bias_dtype = ctx.config
        h, *saved = ctx.saved_tensors
        kept = 3 if spec[1] else 2
        saved, weight_t = saved[:kept], saved[kept:]
        grad_qdtype, options, kernels = spec[3], spec[5], ctx.kernels
        grad_h, _, g_q, g_scale, g_colsum = kernels.act_backward_quantize_colsum(
            grad_a.contiguous(), h, grad_qdtype, activation, False, options=options
        )
        grads = linear_grads(
            spec,
            x_dtype,
            bias_dtype,
            ctx.needs_input_grad[:3],
            tuple(saved),
            grad_h,
            (g_q, g_scale, g_colsum),
            kernels,
            tuple(weight_t) or None,
        )
        return *grads, None, None, None, None, None, None, None, None


@graph_leaf.op("switchback_linear_activation")
def _linear_activation(x2d, weight, bias, spec, activation, x_q, x_scale, weight_operands) -> tuple:
    """(a, a_q, a_scale) of switchback_linear_activation's 8-bit path for a contiguous x2d (M, K)."""
    weight_scaling, _, fwd_qdtype, _, backend, options, _ = spec
    kernels = get_kernels(backend, x2d.device, options)
    with _autocast_off(x2d.device.type):  # as in functional._linear_op
        with torch.no_grad():
            if x_q is None:
                x_q, x_scale = kernels.quantize_rowwise(x2d, fwd_qdtype, options=options)
            if weight_operands is None:
                w_q, w_scale = quantize_weight(kernels, weight.detach(), weight_scaling, fwd_qdtype, options)
                weight_t = ()
            else:
                w_q, w_scale, *weight_t = weight_operands
            b = None if bias is None else bias.detach()
            h = kernels.scaled_matmul(x_q, w_q, x_scale, w_scale, b, x2d.dtype, options=options)
            del w_q
            a, a_q, a_scale = kernels.act_and_quantize_rowwise(h, fwd_qdtype, activation, options=options)
        a = _LinearActivationGradFn.apply(
            x2d, weight, bias, a, h, spec, activation, kernels, x_q, x_scale, tuple(weight_t)
        )
    return a, a_q, a_scale


def switchback_linear_activation(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    config: SwitchBackConfig,
    *,
    quantized_input: tuple[torch.Tensor, torch.Tensor] | None = None,
    weight_operands: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """act(switchback_linear(x, weight, bias)) (*, N) in the compute dtype, and its row-wise 8-bit form in the
    config's forward format: (a, (q (tokens, N), scale (tokens,))), for the next SwitchBack linear.

    activation: a kernels activation name ("gelu", "gelu_tanh", "quick_gelu"). quantized_input,
    weight_operands: as in switchback_linear. The 8-bit path only: callers check functional.runs_8bit first (below the token floor
    the separate layers run their exact 16-bit path).
    """
    if type(config) is not SwitchBackConfig:  # (no call in the usual case: a frame more for Dynamo to trace)
        check_config("switchback_linear_activation", config)
    a, a_q, a_scale = graph_leaf.call(
        "switchback_linear_activation_call",
        x,
        weight,
        bias,
        activation,
        config,
        quantized_input,
        weight_operands,
    )
    return a, (a_q, a_scale)


# one leaf under torch.compile, as functional.switchback_linear
@graph_leaf.op("switchback_linear_activation_call")
def _switchback_linear_activation(
    x, weight, bias, activation, config, quantized_input, weight_operands
) -> tuple:
    shape = (weight.shape[1], weight.shape[0])
    config, x2d, leading, exact = _flatten_input(x, weight, config, (shape,))
    if exact:
        raise ValueError(
            "switchback_linear_activation runs the 8-bit path only; below the token floor call "
            "switchback_linear and the activation (functional.runs_8bit tells which)"
        )
    fwd_qdtype, grad_qdtype = quantized_dtypes(config, x2d.device)
    x_q, x_scale = check_quantized_input("switchback_linear_activation", quantized_input, x2d, fwd_qdtype)
    spec = linear_spec(config, fwd_qdtype, grad_qdtype)
    operands = check_weight_operands(
        "switchback_linear_activation", weight_operands, weight, (fwd_qdtype, grad_qdtype)
    )
    a, a_q, a_scale = graph_leaf.call(
        "switchback_linear_activation",
        x2d.contiguous(),
        weight,
        bias,
        spec,
        activation,
        x_q,
        x_scale,
        operands,
    )
    return a.reshape(*leading, weight.shape[0]), a_q, a_scale


__all__ = ["switchback_linear_activation"]
