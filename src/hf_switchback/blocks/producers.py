"""Producers that quantize: a LayerNorm, or the MLP's activation, that also writes the next linear's 8-bit input,
so no separate quantize pass reads its output (config.fuse_norm: blocks/encoder_layer.py wires the LayerNorms
before q/k/v and fc1; config.fuse_activation: mlp.py wires the activation before fc2).

forward   y = the producer's output in the linear's input dtype, and (q, scale) = quantize_rowwise(y) from the
          same kernel (operators layernorm_quantize_rowwise and act_and_quantize_rowwise: their torch twins
          state the numerics), run outside autograd. q and scale are handed to the linear's op as
          `quantized_input` and carry no gradient; y is then given the producer's gradient by a one-output
          autograd op: the linear's 16-bit grad-weight GEMM (or nothing, with memory_efficient) reads it. (One
          op with the three outputs, q and scale marked non-differentiable, got wrong gradients under
          torch.compile on torch 2.11.)
backward  the stock LayerNorm backward (aten.native_layer_norm_backward) from x and the kernel's float32 mean
          and rstd; the activation's derivative at the saved input (kernels/reference.activation_backward).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import SwitchBackConfig
from ..functional import _autocast_off, quantized_dtypes
from ..kernels.backends import get_kernels
from ..kernels.reference import activation_backward


class _LayerNormGradFn(torch.autograd.Function):
    """Returns y (M, K), LayerNorm(x) as the fused kernel wrote it, with LayerNorm's backward attached.
    x (M, K); weight, bias (K,) in x's dtype or None; mean, rstd (M,) float32 from the same kernel."""

    @staticmethod
    def forward(ctx, x, weight, bias, y, mean, rstd):
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        m, k = x.shape
        grad_x, grad_w, grad_b = torch.ops.aten.native_layer_norm_backward(
            grad_y.to(x.dtype),
            x,
            [k],
            mean.view(m, 1),
            rstd.view(m, 1),
            weight,
            bias,
            [True, weight is not None, bias is not None],
        )
        return grad_x, grad_w, grad_b, None, None, None


def fusable_norm(norm: nn.Module, x: torch.Tensor) -> bool:
    """Whether `norm` can run as layernorm_quantize: a plain nn.LayerNorm over x's last axis, no hooks (its
    forward is not called), parameters (if any) in x's dtype (the stock backward takes one dtype)."""
    if type(norm) is not nn.LayerNorm or norm._forward_hooks or norm._forward_pre_hooks:
        return False
    if tuple(norm.normalized_shape) != (x.shape[-1],):
        return False
    return all(p is None or p.dtype == x.dtype for p in (norm.weight, norm.bias))


def layernorm_quantize(
    x: torch.Tensor, norm: nn.LayerNorm, config: SwitchBackConfig
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """norm(x) as the next SwitchBack linear receives it, and its row-wise 8-bit form in the config's forward
    format: (y (*, K) in the autocast dtype under autocast, else x's; (q (tokens, K), scale (tokens,))).
    Check fusable_norm first."""
    device_type = x.device.type
    out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    qdtype, _ = quantized_dtypes(config, x.device)
    options = config.kernel_options
    kernels = get_kernels(config.backend, x.device, options)
    x2d = x.reshape(-1, x.shape[-1])
    weight, bias = norm.weight, norm.bias
    q, scale, y, mean, rstd = kernels.layernorm_quantize_rowwise(
        x2d.detach(),
        None if weight is None else weight.detach(),
        None if bias is None else bias.detach(),
        norm.eps,
        qdtype,
        out_dtype,
        options=options,
    )
    with _autocast_off(device_type):
        y = _LayerNormGradFn.apply(x2d, weight, bias, y, mean, rstd)
    return y.reshape(x.shape), (q, scale)


class _ActivationGradFn(torch.autograd.Function):
    """Returns a (M, K) = act(h) as the fused kernel wrote it, with the activation's backward attached."""

    @staticmethod
    def forward(ctx, h, a, activation):
        ctx.save_for_backward(h)
        ctx.activation = activation
        return a.view_as(a)

    @staticmethod
    def backward(ctx, grad_a):
        (h,) = ctx.saved_tensors
        return activation_backward(grad_a, h, ctx.activation), None, None


def activation_quantize(
    h: torch.Tensor, activation: str, config: SwitchBackConfig
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """act(h) (*, K) in h's dtype, as the stock activation module computes it, and its row-wise 8-bit form in the
    config's forward format: (a, (q (tokens, K), scale (tokens,))). activation: a kernels activation name."""
    qdtype, _ = quantized_dtypes(config, h.device)
    options = config.kernel_options
    kernels = get_kernels(config.backend, h.device, options)
    h2d = h.reshape(-1, h.shape[-1])
    a, q, scale = kernels.act_and_quantize_rowwise(h2d.detach(), qdtype, activation, options=options)
    with _autocast_off(h.device.type):
        a = _ActivationGradFn.apply(h2d, a, activation)
    return a.reshape(h.shape), (q, scale)


__all__ = ["activation_quantize", "fusable_norm", "layernorm_quantize"]
