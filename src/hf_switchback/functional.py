"""SwitchBack autograd: 8-bit forward and grad-input, 16-bit grad-weight.

    forward     Y  = X Wᵀ + b   X row-wise, W tensor- or row-wise quantized; 8-bit GEMM, fused dequantize
    grad-input  dX = G W        G row-wise, Wᵀ quantized like W in forward; 8-bit GEMM
    grad-weight dW = Gᵀ X       16-bit: its inner dimension is batch x tokens, where 8-bit noise would grow
                                with the sum (the paper's reason to "switch back")

The kernels come from `kernels.backends.get_kernels`, so this file holds no arithmetic of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import SwitchBackConfig
from .kernels.backends import get_kernels

FP8_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# min_tokens=None (automatic) with backend="auto" on CUDA: below this many rows (tokens) the 16-bit matmul is
# used. At small M the 8-bit GEMMs cannot amortize the quantize passes and launches (measured on H100,
# BENCHMARKS.md "Layer kernels"). An explicit config.min_tokens replaces it on any backend.
AUTO_MIN_TOKENS_CUDA = 16384
# Backward computes the bias gradient inside the output-gradient quantize pass (kernels'
# quantize_rowwise_colsum) instead of a separate column sum. False restores the two passes (benchmarks only).
FUSED_BIAS_GRAD = True


def quantized_dtypes(config: SwitchBackConfig) -> tuple[torch.dtype, torch.dtype]:
    """(forward operand dtype, output-gradient operand dtype) for a config."""
    if config.precision == "int8":
        return torch.int8, torch.int8
    return torch.float8_e4m3fn, FP8_FORMATS[config.fp8_grad_format]


def quantize_weight(kernels, weight: torch.Tensor, weight_scaling: str, qdtype: torch.dtype):
    """The forward weight operand: (N, K) -> (q (N, K), scale () for "tensor" or (N,) for "row")."""
    if weight_scaling == "tensor":
        return kernels.quantize_tensorwise(weight, qdtype)
    return kernels.quantize_rowwise(weight, qdtype)


class _SwitchBackLinearFn(torch.autograd.Function):
    """2-D core. x (M, K) and out (M, N) share a float dtype; weight (N, K) and bias (N,) any float dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, weight_scaling, memory_efficient, fwd_qdtype, grad_qdtype, backend):
        kernels = get_kernels(backend, x.device)
        x_q, x_scale = kernels.quantize_rowwise(x, fwd_qdtype)
        w_q, w_scale = quantize_weight(kernels, weight, weight_scaling, fwd_qdtype)
        out = kernels.scaled_matmul(x_q, w_q, x_scale, w_scale, bias, x.dtype)

        # Backward re-quantizes W transposed rather than keeping a second weight copy alive per layer.
        if memory_efficient:
            ctx.save_for_backward(x_q, x_scale, weight)
        else:
            ctx.save_for_backward(x, weight)
        ctx.config = (
            weight_scaling,
            memory_efficient,
            grad_qdtype,
            backend,
            x.dtype,
            None if bias is None else bias.dtype,
        )
        return out

    @staticmethod
    def backward(ctx, grad_out):
        weight_scaling, memory_efficient, grad_qdtype, backend, x_dtype, bias_dtype = ctx.config
        if memory_efficient:
            x_q, x_scale, weight = ctx.saved_tensors
        else:
            x, weight = ctx.saved_tensors
        kernels = get_kernels(backend, grad_out.device)
        grad_out = grad_out.contiguous()
        grad_x = grad_w = grad_b = g_colsum = None
        needs_grad_b = bias_dtype is not None and ctx.needs_input_grad[2]

        if ctx.needs_input_grad[0]:
            if needs_grad_b and FUSED_BIAS_GRAD:
                # One pass over grad_out yields its 8-bit form and the bias gradient (column sum).
                g_q, g_scale, g_colsum = kernels.quantize_rowwise_colsum(grad_out, grad_qdtype)
            else:
                g_q, g_scale = kernels.quantize_rowwise(grad_out, grad_qdtype)
            if weight_scaling == "tensor":
                wt_q, wt_scale = kernels.quantize_tensorwise_transposed(weight, grad_qdtype)
            else:
                wt_q, wt_scale = kernels.quantize_rowwise_transposed(weight, grad_qdtype)
            grad_x = kernels.scaled_matmul(g_q, wt_q, g_scale, wt_scale, None, x_dtype)

        if ctx.needs_input_grad[1]:
            if memory_efficient:
                x = kernels.dequantize_rowwise(x_q, x_scale, x_dtype)
            grad_w = (grad_out.t() @ x.to(grad_out.dtype)).to(weight.dtype)

        if needs_grad_b:
            if g_colsum is None:
                g_colsum = grad_out.sum(dim=0, dtype=torch.float32)
            grad_b = g_colsum.to(bias_dtype)

        return grad_x, grad_w, grad_b, None, None, None, None, None


def check_input(x: torch.Tensor, weight: torch.Tensor) -> None:
    if not x.is_floating_point() or x.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"SwitchBack linear expects a floating-point input (float32, bfloat16, float16 or float64), got "
            f"{x.dtype}. "
            "Cast the input, e.g. x.float()."
        )
    if x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        # The same message nn.Linear gives, so user code that handles one handles the other.
        rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 1
        cols = x.shape[-1] if x.dim() else 1
        raise RuntimeError(
            f"mat1 and mat2 shapes cannot be multiplied ({rows}x{cols} and {weight.shape[1]}x{weight.shape[0]})"
        )


def token_floor(config: SwitchBackConfig, device_type: str) -> int:
    """Rows below which the exact 16-bit matmul runs instead of SwitchBack (see config.min_tokens)."""
    if config.min_tokens is not None:
        return config.min_tokens
    return AUTO_MIN_TOKENS_CUDA if config.backend == "auto" and device_type == "cuda" else 0


def switchback_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SwitchBackConfig | None = None,
) -> torch.Tensor:
    """SwitchBack version of F.linear.

    x (*, K) float32/bfloat16/float16; weight (N, K); bias (N,) or None -> (*, N) in x's dtype, or in the
    autocast dtype when called under torch.autocast (as F.linear would).
    """
    config = config or SwitchBackConfig()
    if not isinstance(config, SwitchBackConfig):
        raise TypeError(f"switchback_linear: config must be a SwitchBackConfig, got {type(config).__name__}")
    check_input(x, weight)
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        x = x.to(torch.get_autocast_dtype(device_type))
    leading = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    tokens = x2d.shape[0]

    if tokens == 0 or tokens < token_floor(config, device_type):
        # Small batches: quantization overhead exceeds the 8-bit speed-up; the 16-bit matmul is exact.
        with torch.autocast(device_type, enabled=False):
            w = weight.to(x.dtype)
            out = F.linear(x2d, w, None if bias is None else bias.to(x.dtype))
        return out.reshape(*leading, weight.shape[0])

    fwd_qdtype, grad_qdtype = quantized_dtypes(config)
    with torch.autocast(device_type, enabled=False):
        out = _SwitchBackLinearFn.apply(
            x2d.contiguous(),
            weight,
            bias,
            config.weight_scaling,
            config.memory_efficient,
            fwd_qdtype,
            grad_qdtype,
            config.backend,
        )
    return out.reshape(*leading, weight.shape[0])


__all__ = [
    "AUTO_MIN_TOKENS_CUDA",
    "check_input",
    "quantize_weight",
    "quantized_dtypes",
    "switchback_linear",
    "token_floor",
]
