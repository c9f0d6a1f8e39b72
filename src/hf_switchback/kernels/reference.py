"""Torch reference kernels: the CPU path, and the oracle every Triton kernel is tested against.

The kernel-set functions here are the kernel operators' torch twins: each one's signature is its operator's
(kernels/library.py declares them from it), it is the operator's implementation on the CPU and on any device
without Triton, and the CUDA implementation (Triton, kernels/ops.py) computes the same. The functional layer
only ever calls them through `kernels.backends.get_kernels`, so the two are interchangeable. They take the
caller's KernelOptions as `options` and ignore it: the reference has one implementation of each step.

Conventions (shared with the Triton twins, tests rely on them):
- Symmetric absmax quantization: scale = absmax / QMAX (float32), q = round_half_even(x / scale) clipped to
  [-QMAX, QMAX]; an all-zero row (or tensor) gets scale 0 and q 0, never NaN.
- 2-D operands only; the caller flattens leading dimensions. Matmul operands are "K-major": a is (M, K),
  b is (N, K), out = a @ b.T, exactly the layout of x and nn.Linear's weight.
- Dequantize epilogue: out = float32(acc) * a_scale[:, None] * b_scale[None, :] (+ float32 bias), then cast.
"""

from __future__ import annotations

import torch

from .options import KernelOptions

# Largest representable magnitude of each 8-bit format: the "127" of absmax scaling.
QMAX = {
    torch.int8: 127.0,
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
}


def _check_qdtype(qdtype: torch.dtype) -> float:
    if qdtype not in QMAX:
        raise ValueError(f"unsupported quantized dtype {qdtype}; expected one of {list(QMAX)}")
    return QMAX[qdtype]


def _to_qdtype(scaled: torch.Tensor, qdtype: torch.dtype, qmax: float) -> torch.Tensor:
    # clamp before the cast: float8_e4m3fn has no inf, an out-of-range value would become NaN.
    if qdtype == torch.int8:
        return torch.round(scaled).clamp_(-qmax, qmax).to(torch.int8)
    return scaled.clamp(-qmax, qmax).to(qdtype)


def quantize_rowwise(
    x: torch.Tensor, qdtype: torch.dtype = torch.int8, *, options: KernelOptions | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) float -> (q (M, K) qdtype, scale (M,) float32), one scale per row (per token)."""
    qmax = _check_qdtype(qdtype)
    xf = x.float()
    scale = xf.abs().amax(dim=1) / qmax if xf.shape[1] > 0 else xf.new_zeros(xf.shape[0])
    safe = torch.where(scale == 0, 1.0, scale)
    return _to_qdtype(xf / safe[:, None], qdtype, qmax), scale


def quantize_rowwise_colsum(
    x: torch.Tensor, qdtype: torch.dtype = torch.int8, *, options: KernelOptions | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_rowwise(x) and x.sum(dim=0) in float32: an output gradient's 8-bit form and its bias gradient.

    The Triton twin reads x once for both; its column sum differs only by float32 summation order.
    """
    q, scale = quantize_rowwise(x, qdtype)
    return q, scale, x.sum(dim=0, dtype=torch.float32)


def quantize_tensorwise(
    x: torch.Tensor, qdtype: torch.dtype = torch.int8, *, options: KernelOptions | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) float -> (q (M, K) qdtype, scale () float32), one scale for the whole tensor."""
    qmax = _check_qdtype(qdtype)
    xf = x.float()
    scale = xf.abs().amax() / qmax if xf.numel() > 0 else xf.new_zeros(())
    safe = torch.where(scale == 0, 1.0, scale)
    return _to_qdtype(xf / safe, qdtype, qmax), scale


def quantize_rowwise_transposed(
    w: torch.Tensor, qdtype: torch.dtype = torch.int8, *, options: KernelOptions | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) -> quantize_rowwise(w.T): (K, N) q with one scale per column of w (per input channel).

    This is the weight operand of grad-input for weight_scaling="row" (dX = G @ W, inner dim N). q is
    contiguous, like the Triton twin's (the operator's fake says so).
    """
    q, scale = quantize_rowwise(w.t(), qdtype)
    return q.contiguous(), scale


def quantize_tensorwise_transposed(
    w: torch.Tensor, qdtype: torch.dtype = torch.int8, *, options: KernelOptions | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) -> quantize_tensorwise(w.T): the grad-input weight operand for weight_scaling="tensor"."""
    q, scale = quantize_tensorwise(w, qdtype)
    return q.t().contiguous(), scale


def dequantize_rowwise(
    q: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    *,
    options: KernelOptions | None = None,
) -> torch.Tensor:
    """Inverse of quantize_rowwise: (M, K) q, (M,) scale -> (M, K) dtype."""
    return (q.float() * scale[:, None]).to(dtype)


def quantize_over_tokens(
    x: torch.Tensor,
    qdtype: torch.dtype = torch.int8,
    pad_to: int = 1,
    *,
    options: KernelOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, C) -> (q (C, M_pad) contiguous, scale (C,) float32) = quantize_rowwise(x.T), q's M tokens then
    zero tokens up to M_pad, the next multiple of pad_to: an operand of the fp8 grad-weight GEMM dW = Gᵀ X
    (kernels/wgrad.py), whose scales run along its features and whose sum runs over the tokens. Zero tokens
    change no scale and add nothing to the sum; cuBLAS's fp8 GEMM needs the token count aligned."""
    q, scale = quantize_rowwise(x.t(), qdtype)
    m = x.shape[0]
    if m % pad_to == 0:
        return q.contiguous(), scale
    padded = q.new_zeros((q.shape[0], m + (-m % pad_to)))
    padded[:, :m] = q
    return padded, scale


def requantize_over_tokens(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    dtype: torch.dtype,
    qdtype: torch.dtype,
    pad_to: int = 1,
    *,
    options: KernelOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_over_tokens of an input saved row-quantized (memory_efficient: x_q (M, C), x_scale (M,)),
    dequantized to `dtype` first. The Triton twin never writes the dequantized tensor."""
    return quantize_over_tokens(dequantize_rowwise(x_q, x_scale, dtype), qdtype, pad_to)


def dequantize_tensorwise(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of quantize_tensorwise."""
    return (q.float() * scale).to(dtype)


# Activations a fused SwitchBack MLP runs inside its quantize passes (fc1 -> act -> fc2):
# "gelu" erf GELU (OpenCLIP-style configs), "gelu_tanh" its tanh approximation, "quick_gelu" x * sigmoid(1.702 x)
# (OpenAI CLIP configs).
ACTIVATIONS = ("gelu", "gelu_tanh", "quick_gelu")


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {activation!r}; expected one of {ACTIVATIONS}")


def apply_activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    """act(h) computed in float32 and rounded once to h's dtype (what torch's GELU kernels do)."""
    _check_activation(activation)
    hf = h.float()
    if activation == "quick_gelu":
        out = hf * torch.sigmoid(1.702 * hf)
    else:
        out = torch.nn.functional.gelu(hf, approximate="tanh" if activation == "gelu_tanh" else "none")
    return out.to(h.dtype)


def activation_backward(grad: torch.Tensor, h: torch.Tensor, activation: str) -> torch.Tensor:
    """grad * act'(h) in float32, rounded to grad's dtype."""
    _check_activation(activation)
    g, hf = grad.float(), h.float()
    if activation == "quick_gelu":
        s = torch.sigmoid(1.702 * hf)
        out = g * (s + 1.702 * hf * s * (1 - s))
    else:
        approximate = "tanh" if activation == "gelu_tanh" else "none"
        out = torch.ops.aten.gelu_backward(g, hf, approximate=approximate)
    return out.to(grad.dtype)


def act_quantize_rowwise(
    h: torch.Tensor, qdtype: torch.dtype, activation: str, *, options: KernelOptions | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rowwise(act(h)): fc2's input operand in a fused MLP. The Triton twin never writes act(h)."""
    return quantize_rowwise(apply_activation(h, activation), qdtype)


def act_and_quantize_rowwise(
    h: torch.Tensor, qdtype: torch.dtype, activation: str, *, options: KernelOptions | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(act(h), *quantize_rowwise(act(h))): the MLP's activation writing fc2's input in 16 bits (its grad-weight
    GEMM reads it) and in 8 bits. The Triton twin reads h once."""
    act = apply_activation(h, activation)
    return (act, *quantize_rowwise(act, qdtype))


def act_backward_quantize_colsum(
    grad: torch.Tensor,
    h: torch.Tensor,
    qdtype: torch.dtype,
    activation: str,
    want_act: bool,
    *,
    options: KernelOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_h, act(h) or an empty (0,) tensor, *quantize_rowwise_colsum(grad_h)) for grad_h = grad * act'(h).

    The backward of the activation plus everything fc1's backward reads from grad_h (its 8-bit form, its
    column sum = fc1's bias gradient), and act(h) for fc2's grad-weight when want_act (recomputed, not saved).
    """
    grad_h = activation_backward(grad, h, activation)
    act = apply_activation(h, activation) if want_act else h.new_empty((0,))
    return (grad_h, act, *quantize_rowwise_colsum(grad_h, qdtype))


def layernorm_quantize_rowwise(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    qdtype: torch.dtype,
    out_dtype: torch.dtype,
    *,
    options: KernelOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm over the last axis of x (M, K) float, and its output quantized row-wise for the next GEMM.

    weight, bias: (K,) any float dtype, or None. Returns (q (M, K) qdtype, scale (M,) float32, y (M, K)
    out_dtype, mean (M,) float32, rstd (M,) float32); mean and rstd are what a LayerNorm backward needs.
    Statistics in float32 (mean, then the biased variance of x - mean, rstd = 1 / sqrt(var + eps)); y = (x - mean)
    * rstd * weight + bias in float32, rounded once to out_dtype (the tensor an unfused LayerNorm would hand the
    next linear: x's dtype, or the autocast dtype the linear casts to); that rounded y is quantized exactly as
    quantize_rowwise quantizes it. So q equals the unfused LayerNorm -> quantize_rowwise pipeline's whenever the
    two LayerNorms round y alike. The Triton twin (kernels/norm_quant.py) reads x once for all five outputs.
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
    y = y.to(out_dtype)
    q, scale = quantize_rowwise(y, qdtype)
    return q, scale, y, mean, rstd


def add_layernorm_quantize_rowwise(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    qdtype: torch.dtype,
    out_dtype: torch.dtype,
    *,
    options: KernelOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The residual add before a LayerNorm, then layernorm_quantize_rowwise of its sum: (h = x + delta (M, K)
    in torch's promoted dtype, as the unfused add writes it), then q, scale, y, mean, rstd of h. The Triton twin
    reads x and delta once for all six outputs."""
    if delta.shape != x.shape:
        raise ValueError(
            f"add_layernorm_quantize_rowwise: delta must have x's shape {tuple(x.shape)}, got {tuple(delta.shape)}"
        )
    h = x + delta
    return (h, *layernorm_quantize_rowwise(h, weight, bias, eps, qdtype, out_dtype))


def scaled_matmul_recompute(
    a_q: torch.Tensor,
    b_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    options: KernelOptions | None = None,
) -> torch.Tensor:
    """scaled_matmul, called by backward to recompute a forward GEMM's output (the kernel set used under
    torch.compile makes it a separate op; see kernels/compiled.py)."""
    return scaled_matmul(a_q, b_q, a_scale, b_scale, bias, out_dtype, options=options)


def scaled_matmul_act_backward(
    a_q: torch.Tensor,
    b_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    h: torch.Tensor,
    qdtype: torch.dtype,
    activation: str,
    want_act: bool,
    *,
    options: KernelOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fc2's grad-input GEMM followed by the activation backward of a fused MLP:
    act_backward_quantize_colsum(scaled_matmul(a_q, b_q, a_scale, b_scale, None, h.dtype), h, ...)."""
    grad_a = scaled_matmul(a_q, b_q, a_scale, b_scale, None, h.dtype)
    return act_backward_quantize_colsum(grad_a, h, qdtype, activation, want_act)


def int8_matmul_int32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact int32 accumulation of (M, K) int8 @ (N, K).T int8 -> (M, N) int32."""
    m, n = a.shape[0], b.shape[0]
    if m == 0 or n == 0 or a.shape[1] == 0:
        return a.new_zeros((m, n), dtype=torch.int32)
    # torch._int_mm is exact on CPU for any shape; on CUDA it needs M > 16 and K, N multiples of 8.
    if a.device.type == "cpu" or (m > 16 and a.shape[1] % 8 == 0 and n % 8 == 0):
        return torch._int_mm(a.contiguous(), b.t().contiguous())
    # float64 holds every partial sum of int8 products exactly (|sum| <= 127^2 * K << 2^53).
    return (a.double() @ b.double().t()).to(torch.int32)


def scaled_matmul(
    a_q: torch.Tensor,
    b_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    options: KernelOptions | None = None,
) -> torch.Tensor:
    """8-bit GEMM with the fused dequantize(+bias) epilogue.

    a_q (M, K) and b_q (N, K), both int8 or both float8; a_scale (M,) float32; b_scale (N,) or () float32;
    bias (N,) any float dtype or None. Returns (M, N) out_dtype = a_q @ b_q.T * a_scale x b_scale + bias.
    """
    if a_q.dtype != b_q.dtype:
        raise TypeError(f"scaled_matmul: operands must share a dtype, got {a_q.dtype} and {b_q.dtype}")
    # fp8 is emulated in float32: fp8 values are exact in float32 and so are their pairwise products.
    is_int8 = a_q.dtype == torch.int8
    acc = int8_matmul_int32(a_q, b_q).float() if is_int8 else a_q.float() @ b_q.float().t()
    b_scale = b_scale.float()
    out = acc * a_scale.float()[:, None] * (b_scale[None, :] if b_scale.dim() == 1 else b_scale)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


__all__ = [
    "ACTIVATIONS",
    "QMAX",
    "act_and_quantize_rowwise",
    "act_backward_quantize_colsum",
    "act_quantize_rowwise",
    "activation_backward",
    "add_layernorm_quantize_rowwise",
    "apply_activation",
    "dequantize_rowwise",
    "dequantize_tensorwise",
    "int8_matmul_int32",
    "layernorm_quantize_rowwise",
    "quantize_over_tokens",
    "quantize_rowwise",
    "quantize_rowwise_colsum",
    "quantize_rowwise_transposed",
    "quantize_tensorwise",
    "quantize_tensorwise_transposed",
    "requantize_over_tokens",
    "scaled_matmul",
    "scaled_matmul_act_backward",
    "scaled_matmul_recompute",
]
