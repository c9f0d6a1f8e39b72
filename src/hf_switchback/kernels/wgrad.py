"""The weight-gradient GEMM dW = Gᵀ X, in 16 bits (SwitchBack) or, opt-in, in fp8.

    G (M, N) the output gradient, X (M, K) the layer input, dW (N, K); M = batch x tokens is the reduction.

fp8 numerics (`reference_weight_grad` states them, `cublas_weight_grad` runs them on cuBLAS):
- Scales run along the reduction: one per row of Gᵀ (per output feature, absmax over all tokens) and one per
  column of X (per input feature, over all tokens). Per-token scales, as forward uses, would differ along
  the reduction and could not be pulled out of the sum; per-feature ones factor out of it, so the GEMM is
  cuBLAS's row-wise scaled fp8 GEMM: dW = (Gᵀ_q @ X_q) * g_scale[:, None] * x_scale[None, :].
- X in e4m3 (as in forward). G in e5m2: one scale per feature now spans every token of the batch, and
  gradients over tokens spread far wider than activations (a few tokens carry most of a feature's gradient);
  e5m2 reaches 2^31.8 below the absmax before flushing to zero, e4m3 only 2^17.8 (448 / 2^-9), for one
  mantissa bit less (relative rounding 2^-3 instead of 2^-4; tests/test_wgrad.py shows a case of each). This is Transformer Engine's "hybrid" recipe (e4m3 forward, e5m2
  gradients); DeepSeek-V3 keeps e4m3 for gradients but with 1x128 tiles, whose scales follow the local range.
- float32 accumulation (cuBLAS with use_fast_accum=False), result cast to the weight's dtype. cuBLAS's row-wise
  scaled GEMM writes bfloat16 only, so on the GPU the float32 sum is rounded to bfloat16 once (2^-9 relative,
  far below the fp8 operands' rounding) before the cast to a float32 weight's dtype. On Hopper the fp8 tensor
  cores' sum is not a full float32 one even so: measured on the H100, up to 2^-11.2 of the sum of |products|
  (4.2e-4 at 4,099 tokens, 1.3e-4 at 50,432), against 2^-3 per product from the fp8 rounding of the operands.
- The bias gradient is not here: the caller keeps the exact column sum of G.

Where: CUDA GPUs with fp8 tensor cores (compute capability 8.9+) run cuBLAS when the shapes fit its alignment
(K a multiple of 16; tokens are zero-padded to a multiple of 16, which adds nothing to the sum); CPU and
unaligned shapes run the reference. The operands come from the layer's kernel set (operators
quantize_over_tokens, requantize_over_tokens): with the Triton backend, two passes each
(kernels/transpose_quantize.py) that write the transposed, padded fp8 operand straight from the 16-bit (or
memory_efficient's row-quantized) input. GPUs without fp8 are refused (`check_device`): the reference there would
be slower than the 16-bit GEMM it replaces.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import cublas
from .library import REFERENCE, KernelSet
from .options import KernelOptions
from .reference import quantize_over_tokens

WGRAD_PRECISIONS = ("16bit", "fp8")
X_DTYPE = torch.float8_e4m3fn
G_DTYPE = torch.float8_e5m2


class RowQuantized(NamedTuple):
    """A layer input saved row-quantized (memory_efficient): q (M, K) 8-bit, scale (M,) float32, and the dtype
    it is dequantized to (the input's)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def reference_weight_grad(grad_out: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """fp8 dW = Gᵀ X in plain torch: grad_out (M, N), x (M, K) float -> (N, K) out_dtype (module docstring)."""
    g_q, g_scale = quantize_over_tokens(grad_out, G_DTYPE)
    x_q, x_scale = quantize_over_tokens(x, X_DTYPE)
    # Products of e5m2 and e4m3 values are exact in float32; the sum is float32 like cuBLAS's.
    acc = g_q.float() @ x_q.float().t()
    return (acc * g_scale[:, None] * x_scale[None, :]).to(out_dtype)


def _dequantized(x: torch.Tensor | RowQuantized, kernels: KernelSet, options: KernelOptions | None):
    if isinstance(x, RowQuantized):
        return kernels.dequantize_rowwise(x.q, x.scale, x.dtype, options=options)
    return x


def cublas_weight_grad(
    grad_out: torch.Tensor,
    x: torch.Tensor | RowQuantized,
    out_dtype: torch.dtype,
    kernels: KernelSet = REFERENCE,
    options: KernelOptions | None = None,
) -> torch.Tensor:
    """reference_weight_grad on torch._scaled_mm (CUDA sm89+, or CPU for the tests). x's K a multiple of 16.

    The operands come from `kernels` (the caller's kernel set: Triton on CUDA); tokens are zero-padded to a
    multiple of 16 inside the quantize, which adds nothing to the sum.
    """
    pad_to = cublas.ALIGN
    # A = Gᵀ (N, M_pad) row-major; B = x_q.t() with x_q (K, M_pad) row-major: column-major, as cuBLAS wants
    g_q, g_scale = kernels.quantize_over_tokens(grad_out, G_DTYPE, pad_to, options=options)
    if isinstance(x, RowQuantized):
        x_q, x_scale = kernels.requantize_over_tokens(x.q, x.scale, x.dtype, X_DTYPE, pad_to, options=options)
    else:
        x_q, x_scale = kernels.quantize_over_tokens(x, X_DTYPE, pad_to, options=options)
    out = torch._scaled_mm(
        g_q,
        x_q.t(),
        scale_a=g_scale.reshape(-1, 1),
        scale_b=x_scale.reshape(1, -1),
        out_dtype=torch.bfloat16,
        use_fast_accum=False,
    )
    return out.to(out_dtype)


def check_device(precision: str, device: torch.device) -> None:
    """Refuse wgrad_precision="fp8" on a CUDA GPU without fp8 tensor cores (compute capability < 8.9)."""
    if precision != "fp8" or device.type != "cuda":
        return
    index = device.index if device.index is not None else 0
    if not cublas.has_fp8_tensor_cores(index):
        props = torch.cuda.get_device_properties(index)
        raise RuntimeError(
            f"SwitchBackConfig.wgrad_precision='fp8' needs a GPU with fp8 tensor cores (compute capability 8.9+: "
            f"Ada, Hopper, Blackwell); {props.name} is {props.major}.{props.minor}. Use wgrad_precision='16bit'."
        )


def weight_grad(
    grad_out: torch.Tensor,
    x: torch.Tensor | RowQuantized,
    out_dtype: torch.dtype,
    precision: str = "16bit",
    kernels: KernelSet = REFERENCE,
    options: KernelOptions | None = None,
) -> torch.Tensor:
    """dW = grad_out.T @ x: grad_out (M, N), x (M, K) float or RowQuantized -> (N, K) out_dtype, in `precision`
    (WGRAD_PRECISIONS). kernels, options: the layer's kernel set (backends.get_kernels) and KernelOptions.

    "16bit": the paper's GEMM in grad_out's dtype. "fp8": see the module docstring. A RowQuantized x is what
    dequantize_rowwise makes of it, in both; fp8 on cuBLAS reads it without writing that 16-bit tensor.
    """
    if precision == "16bit":
        return (grad_out.t() @ _dequantized(x, kernels, options).to(grad_out.dtype)).to(out_dtype)
    if precision != "fp8":
        raise ValueError(f"weight_grad: precision must be one of {WGRAD_PRECISIONS}, got {precision!r}")
    k = (x.q if isinstance(x, RowQuantized) else x).shape[1]
    if grad_out.device.type == "cuda" and k % cublas.ALIGN == 0 and grad_out.shape[0] > 0:
        return cublas_weight_grad(grad_out, x, out_dtype, kernels, options)
    return reference_weight_grad(grad_out, _dequantized(x, kernels, options), out_dtype)


__all__ = [
    "G_DTYPE",
    "WGRAD_PRECISIONS",
    "X_DTYPE",
    "RowQuantized",
    "check_device",
    "cublas_weight_grad",
    "reference_weight_grad",
    "weight_grad",
]
