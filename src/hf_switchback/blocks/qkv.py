"""SwitchBack q/k/v projections of one input as one op: one quantize of the input, one N = 3d 8-bit GEMM.

forward     [Q K V] = X [Wq Wk Wv]ᵀ + [bq bk bv]   X quantized row-wise once; each W quantized on its own
            (as three SwitchBackLinear layers would), stacked along N; the dequantize epilogue takes
            one scale per output column (each projection's tensor scale repeated, or its row scales),
            so the outputs equal the separate layers' bit for bit on the reference kernels.
grad-input  dX = [dQ dK dV] [Wq Wk Wv]   ONE 8-bit GEMM with inner dimension 3d. Its weight operand
            must carry one scale per inner index, so with tensor-wise weight scaling each projection's
            scale is folded into its gradient columns (sq dQ, sk dK, sv dV: the weights stay exactly the
            separate layers' 8-bit values) before the (tokens, 3d) gradient is quantized row-wise; with
            row-wise scaling the stacked weight is quantized per input channel across all three. Either way
            a token's gradient row shares one scale across q, k and v where the separate layers had three:
            the only numerics difference, within the separate layers' own 8-bit error.
grad-weight [dWq dWk dWv] = [dQ dK dV]ᵀ X   one 16-bit GEMM (the paper's "switch back"), split by rows.
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
    quantize_weight,
    quantized_dtypes,
    switchback_linear,
)
from ..kernels import graph_leaf
from ..kernels.backends import get_kernels
from ..kernels.wgrad import RowQuantized, weight_grad


def _stacked_weight_scale(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """One projection's forward weight scale as one float32 value per output column: (rows,)."""
    return scale.float().reshape(-1).expand(rows) if scale.dim() == 0 else scale.float()


class _SwitchBackQKVFn(torch.autograd.Function):
    """2-D core. x (M, K); wq, wk, wv (n_i, K); biases (n_i,) all or none -> (M, n_q + n_k + n_v) in x's dtype.
    x_q, x_scale: x's 8-bit form when its producer wrote it (the LayerNorm before q/k/v), else None.
    weight_operands: the three layers' cached 8-bit weight forms (weight_operands.py), else None. Forward stacks
    their forward forms; backward uses their transposed forms with weight_scaling="tensor" (with "row" the
    stacked transposed weight shares one scale per input feature across q, k and v: quantized here)."""

    @staticmethod
    def forward(
        ctx,
        x,
        wq,
        wk,
        wv,
        bq,
        bk,
        bv,
        weight_scaling,
        memory_efficient,
        fq,
        gq,
        backend,
        options,
        wgrad,
        x_q=None,
        x_scale=None,
        weight_operands=None,
    ):
        kernels = get_kernels(backend, x.device, options)
        weights = (wq, wk, wv)
        if x_q is None:
            x_q, x_scale = kernels.quantize_rowwise(x, fq, options=options)
        if weight_operands is None:
            quantized = [quantize_weight(kernels, w, weight_scaling, fq, options) for w in weights]
            weight_t = ()
        else:
            quantized = [operands[:2] for operands in weight_operands]
            weight_t = () if weight_scaling != "tensor" else tuple(t for o in weight_operands for t in o[2:])
        w_q = torch.cat([q for q, _ in quantized])
        w_scale = torch.cat(
            [_stacked_weight_scale(s, w.shape[0]) for (_, s), w in zip(quantized, weights, strict=True)]
        )
        del quantized
        bias = None if bq is None else torch.cat([b.float() for b in (bq, bk, bv)])
        out = kernels.scaled_matmul(x_q, w_q, x_scale, w_scale, bias, x.dtype, options=options)
        if memory_efficient:
            ctx.save_for_backward(x_q, x_scale, wq, wk, wv, *weight_t)
        else:
            ctx.save_for_backward(x, wq, wk, wv, *weight_t)
        ctx.config = (weight_scaling, memory_efficient, gq, backend, options, x.dtype)
        ctx.wgrad = wgrad
        ctx.bias_dtypes = None if bq is None else (bq.dtype, bk.dtype, bv.dtype)
        ctx.kernels = kernels  # backward runs the forward's set (kernels/graph_leaf.py says why)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        weight_scaling, memory_efficient, gq, _, options, x_dtype = ctx.config
        if memory_efficient:
            x_q, x_scale, *weights = ctx.saved_tensors
        else:
            x, *weights = ctx.saved_tensors
        weights, cached_t = weights[:3], weights[3:]  # cached_t: (wt_q, wt_scale) x 3, or ()
        kernels = ctx.kernels
        g = grad_out.contiguous()
        rows = [w.shape[0] for w in weights]
        need_x = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[1:4]
        need_b = ctx.needs_input_grad[4:7] if ctx.bias_dtypes is not None else (False,) * 3
        grad_x = None
        grad_w = [None] * 3
        grad_b = [None] * 3

        if need_x:
            if weight_scaling == "tensor":
                if cached_t:
                    wt = [cached_t[i : i + 2] for i in (0, 2, 4)]
                else:
                    wt = [kernels.quantize_tensorwise_transposed(w, gq, options=options) for w in weights]
                # Fold each projection's weight scale into its gradient columns (float32, so the scale is not
                # rounded to the gradient's dtype): the stacked weight operand then needs no scale of its own.
                folded = torch.cat(
                    [part.float() * s for part, (_, s) in zip(g.split(rows, dim=1), wt, strict=True)], dim=1
                )
                g_q, g_scale = kernels.quantize_rowwise(folded, gq, options=options)
                del folded
                wt_q = torch.cat([q for q, _ in wt], dim=1)
                wt_scale = torch.ones((), dtype=torch.float32, device=g.device)
            else:
                g_q, g_scale = kernels.quantize_rowwise(g, gq, options=options)
                wt_q, wt_scale = kernels.quantize_rowwise_transposed(torch.cat(weights), gq, options=options)
            grad_x = kernels.scaled_matmul(g_q, wt_q, g_scale, wt_scale, None, x_dtype, options=options)
            del g_q, wt_q

        if any(need_w):
            if memory_efficient:
                x = RowQuantized(x_q, x_scale, x_dtype)
            # per-output-feature gradient scales: the stacked GEMM equals the three separate ones in any precision
            stacked = weight_grad(g, x, g.dtype, ctx.wgrad, kernels, options)
            grad_w = [
                part.to(w.dtype) if need else None
                for part, w, need in zip(stacked.split(rows), weights, need_w, strict=True)
            ]

        if any(need_b):
            colsum = g.sum(dim=0, dtype=torch.float32)
            grad_b = [
                part.to(dtype) if need else None
                for part, dtype, need in zip(colsum.split(rows), ctx.bias_dtypes, need_b, strict=True)
            ]
        return (grad_x, *grad_w, *grad_b) + (None,) * 10


@graph_leaf.op("switchback_qkv")
def _qkv_op(x, *args):
    with _autocast_off(x.device.type):  # as in functional._linear_op
        return _SwitchBackQKVFn.apply(x, *args)


def switchback_qkv(
    x: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    config: SwitchBackConfig | None = None,
    *,
    quantized_input: tuple[torch.Tensor, torch.Tensor] | None = None,
    weight_operands: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three SwitchBack projections of one input: (switchback_linear(x, w_i, b_i, config) for i in q, k, v).

    x (*, K) float; weights three (n_i, K); biases three (n_i,) or three None -> three (*, n_i) in x's dtype
    (or the autocast dtype). Below the config's token floor the three exact 16-bit matmuls run instead.
    quantized_input: as in switchback_linear. weight_operands: the three layers' (q's, k's, v's), as in
    switchback_linear, or None.
    """
    if type(config) is not SwitchBackConfig:  # (no call in the usual case: a frame more for Dynamo to trace)
        check_config("switchback_qkv", config)
    return graph_leaf.call(
        "switchback_qkv_call", x, tuple(weights), tuple(biases), config, quantized_input, weight_operands
    )


# one leaf under torch.compile, as functional.switchback_linear
@graph_leaf.op("switchback_qkv_call")
def _switchback_qkv(x, weights, biases, config, quantized_input, weight_operands) -> tuple:
    if len(weights) != 3 or len(biases) != 3:
        raise ValueError(
            f"switchback_qkv: expected 3 weights and 3 biases, got {len(weights)} and {len(biases)}"
        )
    if len({w.shape[1] for w in weights}) != 1:
        raise RuntimeError(
            f"switchback_qkv: the weights must share in_features, got {[tuple(w.shape) for w in weights]}"
        )
    if len({b is None for b in biases}) != 1:
        raise ValueError("switchback_qkv: give all three projections a bias, or none of them")
    shapes = tuple((w.shape[1], w.shape[0]) for w in weights)
    config, x2d, leading, exact = _flatten_input(x, weights[0], config, shapes)
    if exact:
        return tuple(switchback_linear(x, w, b, config) for w, b in zip(weights, biases, strict=True))
    fq, gq = quantized_dtypes(config, x2d.device)
    x_q, x_scale = check_quantized_input("switchback_qkv", quantized_input, x2d, fq)
    if weight_operands is not None and None in weight_operands:  # all three layers' or none
        weight_operands = None
    if weight_operands is not None:
        weight_operands = tuple(
            check_weight_operands("switchback_qkv", o, w, (fq, gq))
            for o, w in zip(weight_operands, weights, strict=True)
        )
    out = graph_leaf.call(
        "switchback_qkv",
        x2d.contiguous(),
        *weights,
        *biases,
        config.weight_scaling,
        config.memory_efficient,
        fq,
        gq,
        config.backend,
        config.kernel_options,
        config.wgrad_precision,
        x_q,
        x_scale,
        weight_operands,
    )
    return tuple(
        part.reshape(*leading, w.shape[0])
        for part, w in zip(out.split([w.shape[0] for w in weights], dim=1), weights, strict=True)
    )


__all__ = ["switchback_qkv"]
