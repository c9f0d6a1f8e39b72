"""Producers that quantize: a LayerNorm, or the MLP's activation, that also writes the next linear's 8-bit input,
so no separate quantize pass reads its output (config.fuse_norm: blocks/encoder_layer.py wires the LayerNorms
before q/k/v and fc1; config.fuse_activation: blocks/mlp.py wires the activation before fc2).

forward   y = the producer's output in the linear's input dtype, and (q, scale) = quantize_rowwise(y) from the
          same kernel (operators layernorm_quantize_rowwise and act_and_quantize_rowwise: their torch twins
          state the numerics), run outside autograd. q and scale are handed to the linear's op as
          `quantized_input` and carry no gradient; y is then given the producer's gradient by a one-output
          autograd op: the linear's 16-bit grad-weight GEMM (or nothing, with memory_efficient) reads it. (One
          op with the three outputs, q and scale marked non-differentiable, got wrong gradients under
          torch.compile on torch 2.11.)
backward  the stock LayerNorm backward (aten.native_layer_norm_backward) from x and the kernel's float32 mean
          and rstd; the stock GELU backward (aten.gelu_backward) at the saved input, quick_gelu's derivative in
          float32 (kernels/reference.activation_backward).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import SwitchBackConfig
from ..functional import _autocast_off, quantized_dtypes
from ..kernels import graph_leaf
from ..kernels.backends import get_kernels
from ..kernels.reference import activation_backward


class _LayerNormGradFn(torch.autograd.Function):
    """Returns y (M, K), LayerNorm(x) as the fused kernel wrote it, with LayerNorm's backward attached; with
    outputs=n > 1, n views of y (one per consumer: q, k and v), whose gradients the backward sums in x's dtype
    (float32 under autocast), as the stock graph sums them after each linear's autocast cast.
    x (M, K); weight, bias (K,) in x's dtype or None; mean, rstd (M,) float32 from the same kernel."""

    @staticmethod
    def forward(ctx, x, weight, bias, y, mean, rstd, outputs=1):
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        if outputs == 1:
            return y.view_as(y)
        return tuple(y.view_as(y) for _ in range(outputs))

    @staticmethod
    def backward(ctx, *grads):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        m, k = x.shape
        if not x.is_cuda:  # torch's CPU LayerNorm keeps its statistics in x's dtype (CUDA's: float32)
            mean, rstd = mean.to(x.dtype), rstd.to(x.dtype)
        grad_y = None
        for g in grads:
            if g is not None:
                # plain adds: a compiled backward fuses them into the LayerNorm backward kernel, as in the stock
                # graph (a torch.stack(...).sum(0) was a pass of its own that wrote the float32 sum)
                grad_y = g.to(x.dtype) if grad_y is None else grad_y + g.to(x.dtype)
        grad_x, grad_w, grad_b = torch.ops.aten.native_layer_norm_backward(
            grad_y,
            x,
            [k],
            mean.view(m, 1),
            rstd.view(m, 1),
            weight,
            bias,
            [True, weight is not None, bias is not None],
        )
        return grad_x, grad_w, grad_b, None, None, None, None


def fusable_norm(norm: nn.Module, width: int, dtype: torch.dtype) -> bool:
    """Whether `norm` can run as layernorm_quantize on rows of `width` values of `dtype`: a plain nn.LayerNorm
    over them, no hooks (its forward is not called), parameters (if any) in that dtype (the stock backward
    takes one dtype)."""
    if type(norm) is not nn.LayerNorm or norm._forward_hooks or norm._forward_pre_hooks:
        return False
    if tuple(norm.normalized_shape) != (width,):
        return False
    weight, bias = norm.weight, norm.bias  # no generator expression: Dynamo traces this at every compile
    return (weight is None or weight.dtype == dtype) and (bias is None or bias.dtype == dtype)


class _AddGradFn(torch.autograd.Function):
    """Returns h = x + delta as the fused kernel wrote it, with the add's backward attached."""

    @staticmethod
    def forward(ctx, x, delta, h):
        ctx.dtypes = (x.dtype, delta.dtype)
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad_h):
        x_dtype, delta_dtype = ctx.dtypes
        return grad_h.to(x_dtype), grad_h.to(delta_dtype), None


def _dtypes(x: torch.Tensor, config: SwitchBackConfig) -> tuple[torch.dtype, torch.dtype]:
    """(the 8-bit dtype, the output dtype: autocast's under autocast, else x's), read inside the leaf."""
    device_type = x.device.type
    out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    return quantized_dtypes(config, x.device)[0], out_dtype


def _detached(*tensors: torch.Tensor | None) -> tuple:
    return tuple(None if t is None else t.detach() for t in tensors)


# The public functions below hand the whole call to one leaf (kernels/graph_leaf.py), the config included: under
# torch.compile Dynamo records it without interpreting the dtype choices and reshapes, which AOT autograd traces.
@graph_leaf.op("layernorm_quantize")
def _layernorm_quantize(x, weight, bias, eps, config, outputs) -> tuple:
    """(*the `outputs` views of y, q, scale): layernorm_quantize (see there)."""
    x2d = x.reshape(-1, x.shape[-1])
    qdtype, out_dtype = _dtypes(x, config)
    options = config.kernel_options
    kernels = get_kernels(config.backend, x2d.device, options)
    q, scale, y, mean, rstd = kernels.layernorm_quantize_rowwise(
        *_detached(x2d, weight, bias), eps, qdtype, out_dtype, options=options
    )
    with _autocast_off(x2d.device.type):
        ys = _LayerNormGradFn.apply(x2d, weight, bias, y, mean, rstd, outputs)
    ys = (ys,) if outputs == 1 else ys
    return (*(y.view(x.shape) for y in ys), q, scale)


def layernorm_quantize(
    x: torch.Tensor, norm: nn.LayerNorm, config: SwitchBackConfig, outputs: int = 1
) -> tuple[torch.Tensor | tuple[torch.Tensor, ...], tuple[torch.Tensor, torch.Tensor]]:
    """norm(x) as the next SwitchBack linear receives it, and its row-wise 8-bit form in the config's forward
    format: (y (*, K) in the autocast dtype under autocast, else x's; (q (tokens, K), scale (tokens,))).
    outputs=n > 1: a tuple of n views of y, one per linear that reads it (see _LayerNormGradFn).
    Check fusable_norm first."""
    *ys, q, scale = graph_leaf.call(
        "layernorm_quantize", x, norm.weight, norm.bias, norm.eps, config, outputs
    )
    return (ys[0] if outputs == 1 else tuple(ys)), (q, scale)


@graph_leaf.op("add_layernorm_quantize")
def _add_layernorm_quantize(x, delta, weight, bias, eps, config) -> tuple:
    """(h, y, q, scale): add_layernorm_quantize (see there)."""
    x2d, delta2d = x.reshape(-1, x.shape[-1]), delta.reshape(-1, x.shape[-1])
    qdtype, out_dtype = _dtypes(x, config)
    options = config.kernel_options
    kernels = get_kernels(config.backend, x2d.device, options)
    h, q, scale, y, mean, rstd = kernels.add_layernorm_quantize_rowwise(
        *_detached(x2d, delta2d, weight, bias), eps, qdtype, out_dtype, options=options
    )
    with _autocast_off(x2d.device.type):
        h = _AddGradFn.apply(x2d, delta2d, h)
        y = _LayerNormGradFn.apply(h, weight, bias, y, mean, rstd)
    return h.view(x.shape), y.view(x.shape), q, scale


def add_layernorm_quantize(
    x: torch.Tensor, delta: torch.Tensor, norm: nn.LayerNorm, config: SwitchBackConfig
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The residual add x + delta (same shape) and layernorm_quantize of it from one kernel: (h = x + delta in
    torch's promoted dtype, y, (q, scale)). Check fusable_norm on h's dtype first."""
    h, y, q, scale = graph_leaf.call(
        "add_layernorm_quantize", x, delta, norm.weight, norm.bias, norm.eps, config
    )
    return h, y, (q, scale)


def quantize_rows(x: torch.Tensor, config: SwitchBackConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The row-wise 8-bit form (q (tokens, K), scale (tokens,)) of x (*, K), in the config's forward format, from
    our one-pass kernel also under torch.compile, for an input that no compiled kernel can quantize as it
    writes it: the attention output, written by the attention kernel. (Elsewhere the compiled graph leaves
    the quantize to Inductor, which fuses it into the producer; here it would be a kernel of its own that
    reads each row twice: BENCHMARKS.md, Whole training step.)"""
    return graph_leaf.call("quantize_rows", x, config)


@graph_leaf.op("quantize_rows")
def _quantize_rows(x, config) -> tuple[torch.Tensor, torch.Tensor]:
    qdtype, _ = quantized_dtypes(config, x.device)
    x2d = x.reshape(-1, x.shape[-1]).detach()
    kernels = get_kernels(config.backend, x2d.device, config.kernel_options)
    if kernels.name == "compiled":  # the traced operator, not the compiled set's choice (Inductor's code)
        return torch.ops.hf_switchback.quantize_rowwise(x2d, qdtype)
    return kernels.quantize_rowwise(x2d, qdtype, options=config.kernel_options)


_GELU_APPROXIMATE = {"gelu": "none", "gelu_tanh": "tanh"}


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
        if ctx.activation in _GELU_APPROXIMATE:
            # the stock GELU module's own backward kernel (float32 inside, one rounding), one pass in eager too
            approximate = _GELU_APPROXIMATE[ctx.activation]
            return torch.ops.aten.gelu_backward(grad_a, h, approximate=approximate), None, None
        return activation_backward(grad_a, h, ctx.activation), None, None


def activation_quantize(
    h: torch.Tensor, activation: str, config: SwitchBackConfig
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """act(h) (*, K) in h's dtype, as the stock activation module computes it, and its row-wise 8-bit form in the
    config's forward format: (a, (q (tokens, K), scale (tokens,))). activation: a kernels activation name."""
    a, q, scale = graph_leaf.call("activation_quantize", h, activation, config)
    return a, (q, scale)


@graph_leaf.op("activation_quantize")
def _activation_quantize(h, activation, config) -> tuple:
    """(a, q, scale): activation_quantize (see there)."""
    qdtype, _ = quantized_dtypes(config, h.device)
    h2d = h.reshape(-1, h.shape[-1])
    options = config.kernel_options
    kernels = get_kernels(config.backend, h2d.device, options)
    a, q, scale = kernels.act_and_quantize_rowwise(h2d.detach(), qdtype, activation, options=options)
    with _autocast_off(h2d.device.type):
        a = _ActivationGradFn.apply(h2d, a, activation)
    return a.view(h.shape), q, scale


__all__ = [
    "activation_quantize",
    "add_layernorm_quantize",
    "fusable_norm",
    "layernorm_quantize",
    "quantize_rows",
]
