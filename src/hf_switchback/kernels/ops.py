"""The CUDA implementations of the kernel operators (kernels/library.py), and the kernel set of eager CUDA.

Each implementation takes its operator's arguments (the torch twin's, then the option fields the operator
declares) and, where the operator is traceable, a keyword `wrap`: None launches the Triton kernels here;
`torch.library.wrap_triton` (passed by the operator's triton_op body) lets torch.compile record the launches,
which Inductor then makes from its generated code. Importing this module registers them with the operators.

`KERNELS` is what `backends.get_kernels` gives CUDA tensors in eager mode: each call goes straight to the
implementation (KernelOptions.direct_eager: the dispatcher only adds CPU time to ~10 calls per layer and
step), or through `torch.ops.hf_switchback.*` otherwise. The module's attributes are KERNELS' functions
(`ops.quantize_rowwise(x, torch.int8)`), for tests and benchmarks.

Importing this module imports triton; only the CUDA path does so.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from . import cublas as _cublas
from . import graph_leaf, library, reference
from . import matmul as _matmul
from . import norm_quant as _norm_quant
from . import quantize as _quantize
from . import transpose_quantize as _transpose_quantize
from .library import KernelOp, KernelSet, Route, call_operator
from .options import KernelOptions


def _scaled_matmul(a_q, b_q, a_scale, b_scale, bias, out_dtype, use_tma, fp8_gemm, *, wrap=None):
    # fp8 GEMMs that fp8_gemm sends to cuBLAS run torch._scaled_mm (kernels/cublas.py), an op Inductor knows.
    if _cublas.use_cublas(a_q, b_q, out_dtype, fp8_gemm):
        return _cublas.scaled_matmul(a_q, b_q, a_scale, b_scale, bias, out_dtype)
    # With `wrap` the TMA kernel is skipped: its host-side setup is not traceable (kernel sets send use_tma to
    # the opaque scaled_matmul_recompute operator instead).
    return _matmul.scaled_matmul(a_q, b_q, a_scale, b_scale, bias, out_dtype, use_tma=use_tma, wrap=wrap)


def _quantize_rowwise_colsum(x, qdtype, *, wrap=None):
    if wrap is not None and not _quantize.colsum_in_one_pass(x):
        # the two-pass shapes launch outside `wrap`; traced, the torch twin does the same work
        return reference.quantize_rowwise_colsum(x, qdtype)
    return _quantize.quantize_rowwise_colsum(x, qdtype, wrap=wrap)


def _act_backward(grad, h, qdtype, activation, want_act, impl, *, wrap=None):
    return _quantize.act_backward_quantize_colsum(grad, h, qdtype, activation, want_act, impl=impl, wrap=wrap)


def _gemm_act_backward(
    a_q, b_q, a_scale, b_scale, h, qdtype, activation, want_act, use_tma, fp8_gemm, impl, *, wrap=None
):
    grad_a = _scaled_matmul(a_q, b_q, a_scale, b_scale, None, h.dtype, use_tma, fp8_gemm, wrap=wrap)
    return _act_backward(grad_a, h, qdtype, activation, want_act, impl, wrap=wrap)


CUDA: dict[str, Callable] = {
    "layernorm_quantize_rowwise": _norm_quant.layernorm_quantize_rowwise,
    "add_layernorm_quantize_rowwise": _norm_quant.add_layernorm_quantize_rowwise,
    "quantize_rowwise": _quantize.quantize_rowwise,
    "quantize_rowwise_colsum": _quantize_rowwise_colsum,
    "quantize_tensorwise": _quantize.quantize_tensorwise,
    "quantize_rowwise_transposed": _quantize.quantize_rowwise_transposed,
    "quantize_tensorwise_transposed": _quantize.quantize_tensorwise_transposed,
    "dequantize_rowwise": _quantize.dequantize_rowwise,
    "quantize_over_tokens": _transpose_quantize.quantize_over_tokens,
    "requantize_over_tokens": _transpose_quantize.requantize_over_tokens,
    "scaled_matmul": _scaled_matmul,
    "scaled_matmul_recompute": _scaled_matmul,
    "act_quantize_rowwise": _quantize.act_quantize_rowwise,
    "act_and_quantize_rowwise": _quantize.act_and_quantize_rowwise,
    "act_backward_quantize_colsum": _act_backward,
    "scaled_matmul_act_backward": _gemm_act_backward,
}

library.declare(CUDA)


@functools.cache
def call_direct(op: KernelOp) -> Callable:
    impl = CUDA[op.name]
    return lambda *args, options: impl(*args, *op.option_values(options))


def gemm_then_act_backward(gemm: Callable, act_backward: Callable) -> Callable:
    """scaled_matmul_act_backward as its two steps, for when the one-operator form cannot be traced (TMA)."""

    def run(a_q, b_q, a_scale, b_scale, h, *act_args, options):
        grad_a = gemm(a_q, b_q, a_scale, b_scale, None, h.dtype, options=options)
        return act_backward(grad_a, h, *act_args, options=options)

    return run


_GEMM = library.BY_NAME["scaled_matmul"]
_OPAQUE_GEMM = library.BY_NAME["scaled_matmul_recompute"]
_ACT_BACKWARD = library.BY_NAME["act_backward_quantize_colsum"]


def _opaque_gemm(op: KernelOp) -> Callable | None:
    """What runs instead of `op` where its traceable operator would skip the TMA kernel (with options.use_tma):
    the opaque GEMM operator; None where this op needs no such detour."""
    if op is _GEMM:
        return call_operator(_OPAQUE_GEMM)
    if op.name == "scaled_matmul_act_backward":
        return gemm_then_act_backward(call_operator(_OPAQUE_GEMM), call_operator(_ACT_BACKWARD))
    return None


def _eager_policy(op: KernelOp) -> Route:
    direct, operator, tma_detour = call_direct(op), call_operator(op), _opaque_gemm(op)
    opaque = call_operator(_OPAQUE_GEMM)

    def route(options: KernelOptions, args: tuple) -> Callable:
        compiling = graph_leaf.compiling()
        if options.direct_eager and not compiling:
            return direct
        if op is _GEMM and compiling and not options.trace_gemm:
            return opaque
        if options.use_tma and tma_detour is not None:
            return tma_detour
        return operator

    return route


KERNELS = KernelSet("triton", _eager_policy)


def __getattr__(name: str):
    if name in library.BY_NAME:
        return getattr(KERNELS, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CUDA", "KERNELS", "call_direct", "gemm_then_act_backward"]
