"""The Triton kernel set for CUDA tensors, as torch.library custom ops (`torch.ops.hf_switchback.*`).

Same functions, signatures and numerics as `kernels/reference.py` (see there for the conventions);
`kernels.backends.get_kernels` returns this module for CUDA inputs. The caller's KernelOptions pick between
implementations; the custom ops take the fields they need as plain arguments (bools, strs), the only kinds
a custom op's schema holds. Wrapping each kernel in a custom op with a
fake (meta) implementation lets `torch.compile` trace a SwitchBack model end to end without graph breaks:
Dynamo and AOTAutograd see opaque ops with known output shapes and never look inside Triton launches.
Autograd stays in `functional.py`; these ops are never differentiated themselves.

Importing this module imports triton; only the CUDA path does so.
"""

from __future__ import annotations

import torch

from . import cublas as _cublas
from . import matmul as _matmul
from . import quantize as _quantize
from .options import KernelOptions, resolve
from .reference import QMAX

_LIB = "hf_switchback"


@torch.library.custom_op(f"{_LIB}::quantize_rowwise", mutates_args=())
def _quantize_rowwise(x: torch.Tensor, qdtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize.quantize_rowwise(x, qdtype)


@_quantize_rowwise.register_fake
def _(x, qdtype):
    return x.new_empty(x.shape, dtype=qdtype), x.new_empty((x.shape[0],), dtype=torch.float32)


@torch.library.custom_op(f"{_LIB}::quantize_rowwise_colsum", mutates_args=())
def _quantize_rowwise_colsum(
    x: torch.Tensor, qdtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _quantize.quantize_rowwise_colsum(x, qdtype)


@_quantize_rowwise_colsum.register_fake
def _(x, qdtype):
    m, k = x.shape
    return (
        x.new_empty((m, k), dtype=qdtype),
        x.new_empty((m,), dtype=torch.float32),
        x.new_empty((k,), dtype=torch.float32),
    )


@torch.library.custom_op(f"{_LIB}::act_quantize_rowwise", mutates_args=())
def _act_quantize_rowwise(
    h: torch.Tensor, qdtype: torch.dtype, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize.act_quantize_rowwise(h, qdtype, activation)


@_act_quantize_rowwise.register_fake
def _(h, qdtype, activation):
    return h.new_empty(h.shape, dtype=qdtype), h.new_empty((h.shape[0],), dtype=torch.float32)


@torch.library.custom_op(f"{_LIB}::act_backward_quantize_colsum", mutates_args=())
def _act_backward_quantize_colsum(
    grad: torch.Tensor, h: torch.Tensor, qdtype: torch.dtype, activation: str, want_act: bool, impl: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _quantize.act_backward_quantize_colsum(grad, h, qdtype, activation, want_act, impl=impl)


@_act_backward_quantize_colsum.register_fake
def _(grad, h, qdtype, activation, want_act, impl):
    m, k = grad.shape
    return (
        grad.new_empty((m, k)),
        h.new_empty((m, k) if want_act else (0,)),
        grad.new_empty((m, k), dtype=qdtype),
        grad.new_empty((m,), dtype=torch.float32),
        grad.new_empty((k,), dtype=torch.float32),
    )


@torch.library.custom_op(f"{_LIB}::quantize_tensorwise", mutates_args=())
def _quantize_tensorwise(x: torch.Tensor, qdtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize.quantize_tensorwise(x, qdtype)


@_quantize_tensorwise.register_fake
def _(x, qdtype):
    return x.new_empty(x.shape, dtype=qdtype), x.new_empty((), dtype=torch.float32)


@torch.library.custom_op(f"{_LIB}::quantize_rowwise_transposed", mutates_args=())
def _quantize_rowwise_transposed(w: torch.Tensor, qdtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize.quantize_rowwise_transposed(w, qdtype)


@_quantize_rowwise_transposed.register_fake
def _(w, qdtype):
    n, k = w.shape
    return w.new_empty((k, n), dtype=qdtype), w.new_empty((k,), dtype=torch.float32)


@torch.library.custom_op(f"{_LIB}::quantize_tensorwise_transposed", mutates_args=())
def _quantize_tensorwise_transposed(
    w: torch.Tensor, qdtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize.quantize_tensorwise_transposed(w, qdtype)


@_quantize_tensorwise_transposed.register_fake
def _(w, qdtype):
    n, k = w.shape
    return w.new_empty((k, n), dtype=qdtype), w.new_empty((), dtype=torch.float32)


@torch.library.custom_op(f"{_LIB}::dequantize_rowwise", mutates_args=())
def _dequantize_rowwise(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _quantize.dequantize_rowwise(q, scale, dtype)


@_dequantize_rowwise.register_fake
def _(q, scale, dtype):
    return q.new_empty(q.shape, dtype=dtype)


@torch.library.custom_op(f"{_LIB}::scaled_matmul", mutates_args=())
def _scaled_matmul(
    a_q: torch.Tensor,
    b_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    use_tma: bool,
    fp8_gemm: str = "auto",
) -> torch.Tensor:
    if _cublas.use_cublas(a_q, b_q, out_dtype, fp8_gemm):
        return _cublas.scaled_matmul(a_q, b_q, a_scale, b_scale, bias, out_dtype)
    return _matmul.scaled_matmul(a_q, b_q, a_scale, b_scale, bias, out_dtype, use_tma=use_tma)


@_scaled_matmul.register_fake
def _(a_q, b_q, a_scale, b_scale, bias, out_dtype, use_tma, fp8_gemm="auto"):
    # mixed fp8 formats (e4m3 x e5m2 grads) only where the real op sends them to cuBLAS
    if a_q.dtype != b_q.dtype and (a_q.dtype, b_q.dtype) not in _cublas.MIXED_FP8_PAIRS:
        raise TypeError(f"scaled_matmul: operands must share a dtype, got {a_q.dtype} and {b_q.dtype}")
    return a_q.new_empty((a_q.shape[0], b_q.shape[0]), dtype=out_dtype)


# The same GEMM for torch.compile (kernels/compiled.py): a triton_op lets Inductor trace into the function and
# record the Triton launch (wrap_triton), so the compiled code launches the kernel itself. The opaque custom op
# above costs a Python dispatch + wrapper + autotuner lookup on every call: on ViT-B/16 (288 GEMMs per step)
# that left the GPU idle for ~26 of 139 ms per compiled step (BENCHMARKS.md, Whole training step).
@torch.library.triton_op(f"{_LIB}::scaled_matmul_traced", mutates_args=())
def _scaled_matmul_traced(
    a_q: torch.Tensor,
    b_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return _matmul.scaled_matmul(a_q, b_q, a_scale, b_scale, bias, out_dtype, wrap=torch.library.wrap_triton)


# The output-gradient quantize + bias column sum for torch.compile, launched from Inductor's code like the
# GEMM above (see kernels/compiled.py for why this pass, and only this one, stays ours under compile).
@torch.library.triton_op(f"{_LIB}::quantize_rowwise_colsum_traced", mutates_args=())
def _quantize_rowwise_colsum_traced(
    x: torch.Tensor, qdtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _quantize.quantize_rowwise_colsum(x, qdtype, wrap=torch.library.wrap_triton)


# The fused MLP's two activation passes for torch.compile, launched from Inductor's code like the ones above
# (kernels/compiled.py, KernelOptions.triton_act_quantize says why they stay ours).
@torch.library.triton_op(f"{_LIB}::act_quantize_rowwise_traced", mutates_args=())
def _act_quantize_rowwise_traced(
    h: torch.Tensor, qdtype: torch.dtype, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize.act_quantize_rowwise(h, qdtype, activation, wrap=torch.library.wrap_triton)


@torch.library.triton_op(f"{_LIB}::act_backward_quantize_colsum_traced", mutates_args=())
def _act_backward_quantize_colsum_traced(
    grad: torch.Tensor, h: torch.Tensor, qdtype: torch.dtype, activation: str, want_act: bool, impl: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _quantize.act_backward_quantize_colsum(
        grad, h, qdtype, activation, want_act, impl=impl, wrap=torch.library.wrap_triton
    )


@torch.library.custom_op(f"{_LIB}::scaled_matmul_act_backward", mutates_args=())
def _scaled_matmul_act_backward(
    a_q: torch.Tensor,
    b_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    h: torch.Tensor,
    qdtype: torch.dtype,
    activation: str,
    want_act: bool,
    use_tma: bool,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _matmul.scaled_matmul_act_backward(
        a_q, b_q, a_scale, b_scale, h, qdtype, activation, want_act, use_tma=use_tma, impl=impl
    )


@_scaled_matmul_act_backward.register_fake
def _(a_q, b_q, a_scale, b_scale, h, qdtype, activation, want_act, use_tma, impl):
    m, n = a_q.shape[0], b_q.shape[0]
    return (
        h.new_empty((m, n)),
        h.new_empty((m, n) if want_act else (0,)),
        h.new_empty((m, n), dtype=qdtype),
        h.new_empty((m,), dtype=torch.float32),
        h.new_empty((n,), dtype=torch.float32),
    )


# The public functions: the reference signatures (with their defaults), dispatching to the ops above while
# torch.compile traces, and straight to the Triton launchers in eager mode (options.direct_eager), where the
# custom-op dispatcher only adds CPU time to every call (a SwitchBack layer makes ~10 of them per step).
def _direct(options: KernelOptions) -> bool:
    return options.direct_eager and not torch.compiler.is_compiling()


def quantize_rowwise(
    x: torch.Tensor, qdtype: torch.dtype = torch.int8, *, options: KernelOptions | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) float -> (q (M, K) qdtype, scale (M,) float32)."""
    if _direct(resolve(options)):
        return _quantize.quantize_rowwise(x, qdtype)
    return torch.ops.hf_switchback.quantize_rowwise(x, qdtype)


def quantize_rowwise_colsum(
    x: torch.Tensor, qdtype: torch.dtype = torch.int8, *, options: KernelOptions | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(M, K) float -> (q (M, K) qdtype, scale (M,) float32, column sum (K,) float32), x read once."""
    if _direct(resolve(options)):
        return _quantize.quantize_rowwise_colsum(x, qdtype)
    return torch.ops.hf_switchback.quantize_rowwise_colsum(x, qdtype)


def act_quantize_rowwise(
    h: torch.Tensor, qdtype: torch.dtype, activation: str, *, options: KernelOptions | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) float -> quantize_rowwise(act(h)) without writing act(h)."""
    if _direct(resolve(options)):
        return _quantize.act_quantize_rowwise(h, qdtype, activation)
    return torch.ops.hf_switchback.act_quantize_rowwise(h, qdtype, activation)


def act_backward_quantize_colsum(
    grad: torch.Tensor,
    h: torch.Tensor,
    qdtype: torch.dtype,
    activation: str,
    want_act: bool,
    *,
    options: KernelOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """grad, h (M, K) -> (grad_h, act(h) or (0,), q, scale (M,), grad_h column sum (K,)); see the twin."""
    options = resolve(options)
    impl = options.act_backward_impl
    if _direct(options):
        return _quantize.act_backward_quantize_colsum(grad, h, qdtype, activation, want_act, impl=impl)
    return torch.ops.hf_switchback.act_backward_quantize_colsum(grad, h, qdtype, activation, want_act, impl)


def quantize_tensorwise(
    x: torch.Tensor, qdtype: torch.dtype = torch.int8, *, options: KernelOptions | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) float -> (q (M, K) qdtype, scale () float32)."""
    if _direct(resolve(options)):
        return _quantize.quantize_tensorwise(x, qdtype)
    return torch.ops.hf_switchback.quantize_tensorwise(x, qdtype)


def quantize_rowwise_transposed(
    w: torch.Tensor, qdtype: torch.dtype = torch.int8, *, options: KernelOptions | None = None
):
    """(N, K) -> (q (K, N) qdtype, scale (K,) float32) = quantize_rowwise(w.T)."""
    if _direct(resolve(options)):
        return _quantize.quantize_rowwise_transposed(w, qdtype)
    return torch.ops.hf_switchback.quantize_rowwise_transposed(w, qdtype)


def quantize_tensorwise_transposed(
    w: torch.Tensor, qdtype: torch.dtype = torch.int8, *, options: KernelOptions | None = None
):
    """(N, K) -> (q (K, N) qdtype, scale () float32) = quantize_tensorwise(w) transposed."""
    if _direct(resolve(options)):
        return _quantize.quantize_tensorwise_transposed(w, qdtype)
    return torch.ops.hf_switchback.quantize_tensorwise_transposed(w, qdtype)


def dequantize_rowwise(
    q: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    *,
    options: KernelOptions | None = None,
) -> torch.Tensor:
    """(M, K) q, (M,) float32 scale -> (M, K) dtype."""
    if _direct(resolve(options)):
        return _quantize.dequantize_rowwise(q, scale, dtype)
    return torch.ops.hf_switchback.dequantize_rowwise(q, scale, dtype)


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
    """(M, K) @ (N, K).T 8-bit GEMM, dequantized by a_scale (M,) x b_scale (N,) or (), + bias -> (M, N) out_dtype.

    fp8 GEMMs that options.fp8_gemm sends to cuBLAS run torch._scaled_mm (kernels/cublas.py)."""
    options = resolve(options)
    if _cublas.use_cublas(a_q, b_q, out_dtype, options.fp8_gemm):
        return _cublas.scaled_matmul(a_q, b_q, a_scale, b_scale, bias, out_dtype)
    if _direct(options):
        return _matmul.scaled_matmul(a_q, b_q, a_scale, b_scale, bias, out_dtype, use_tma=options.use_tma)
    return torch.ops.hf_switchback.scaled_matmul(
        a_q, b_q, a_scale, b_scale, bias, out_dtype, options.use_tma, options.fp8_gemm
    )


# Backward's recompute of a forward GEMM (the fused MLP's h under memory_efficient): in eager the same GEMM.
scaled_matmul_recompute = scaled_matmul


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
    """fc2's 8-bit grad-input GEMM + the activation backward of a fused MLP; see the twin."""
    options = resolve(options)
    use_tma, impl = options.use_tma, options.act_backward_impl
    if _direct(options):
        return _matmul.scaled_matmul_act_backward(
            a_q, b_q, a_scale, b_scale, h, qdtype, activation, want_act, use_tma=use_tma, impl=impl
        )
    return torch.ops.hf_switchback.scaled_matmul_act_backward(
        a_q, b_q, a_scale, b_scale, h, qdtype, activation, want_act, use_tma, impl
    )


__all__ = [
    "QMAX",
    "act_backward_quantize_colsum",
    "act_quantize_rowwise",
    "dequantize_rowwise",
    "quantize_rowwise",
    "quantize_rowwise_colsum",
    "quantize_rowwise_transposed",
    "quantize_tensorwise",
    "quantize_tensorwise_transposed",
    "scaled_matmul",
    "scaled_matmul_act_backward",
    "scaled_matmul_recompute",
]
