"""Torch twin of kernels/norm_quant.py: LayerNorm whose output is also quantized row-wise for the next GEMM.

The readable statement of the numerics, the CPU path and the oracle the Triton kernel is tested against:
statistics in float32 (mean, then the biased variance of x - mean, rstd = 1 / sqrt(var + eps)); y = (x - mean)
* rstd * weight + bias in float32, rounded once to x's dtype (the tensor an unfused LayerNorm would write);
that rounded y is quantized exactly as kernels/reference.quantize_rowwise quantizes it (scale = absmax / QMAX,
round half-even for int8, clamp, an all-zero row gives scale 0 and q 0). So the 8-bit operand equals the
unfused LayerNorm -> quantize_rowwise pipeline's whenever the two LayerNorms round y alike.
"""

from __future__ import annotations

import torch

from .reference import quantize_rowwise


def layernorm_quantize_rowwise(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    qdtype: torch.dtype = torch.int8,
    *,
    want_normalized: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """LayerNorm over the last axis of x (M, K) float, and its output quantized row-wise.

    weight, bias: (K,) any float dtype, or None. Returns (q (M, K) qdtype, scale (M,) float32,
    y (M, K) x.dtype or None when not want_normalized, mean (M,) float32, rstd (M,) float32); mean and rstd
    are what a LayerNorm backward needs.
    """
    if x.dim() != 2:
        raise ValueError(f"layernorm_quantize_rowwise: x must be 2-D (M, K), got shape {tuple(x.shape)}")
    xf = x.float()
    mean = xf.mean(dim=1)
    diff = xf - mean[:, None]
    rstd = torch.rsqrt((diff * diff).mean(dim=1) + eps)
    y = diff * rstd[:, None]
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    q, scale = quantize_rowwise(y, qdtype)
    return q, scale, (y if want_normalized else None), mean, rstd


__all__ = ["layernorm_quantize_rowwise"]
