"""The kernel set used while torch.compile traces a SwitchBack model on CUDA.

The quantize functions are the torch reference ones (kernels/reference.py): plain tensor ops that Inductor
fuses into the op that produced their input (LayerNorm, GELU, the residual add), so a compiled model pays no
separate quantize pass and no Python launch overhead for them. The 8-bit GEMM stays our Triton kernel
(Inductor's own int8 matmul lowers to cuBLAS `_int_mm`, which is no faster than bf16 on Hopper), as a
`triton_op` (kernels/ops.py) whose launch Inductor records and makes from its generated code, with no Python
call per GEMM. With KernelOptions.use_tma it is the opaque custom op instead: the TMA kernel's host-side setup
is not traceable.

Three passes stay ours too, as traced triton_ops, where Inductor's code was measured slower:
- the output gradient's quantize (with the bias gradient's column sum). That tensor is written in 16 bits
  anyway (the grad-weight GEMM reads it), so fusing its quantize into the op that produced it saves nothing;
  Inductor's version re-read the producer's inputs instead (GELU backward: grad and h) in a slow persistent
  reduction: on the H100, a ViT-H/14 step spent 18.4 ms in it for the 32 fc1 gradients alone, vs 11.4 ms for
  all 192 gradient quantizes with our kernel (BENCHMARKS.md, Whole training step). KernelOptions.
  triton_grad_quantize.
- the fused MLP's (fuse_mlp, memory_efficient) activation + quantize of fc1's output in forward and its
  activation backward + quantize + column sum in backward: their input is a GEMM's output, with nothing for
  Inductor to fuse them into, and its code for them was slower than ours (BENCHMARKS.md, Memory).
  KernelOptions.triton_act_quantize.

Known limit: Inductor tunes our GEMM's configs without its autotune key, so when Dynamo makes the token count
dynamic (a second shape, e.g. a short last batch), one tuned config serves every M. The layer-wise compile
in benchmarks/bench_train.py uses dynamic=False.

Numerics: the same formulas as the Triton quantize kernels (absmax / QMAX, round half to even, clamp), so
compiled and eager SwitchBack agree up to the float32 rounding of Inductor's generated code
(tests/test_compiled_kernels.py states the bound).
"""

from __future__ import annotations

import torch

from . import cublas, reference
from .ops import dequantize_rowwise
from .options import KernelOptions, resolve
from .quantize import colsum_in_one_pass
from .reference import (
    QMAX,
    act_backward_quantize_colsum,
    quantize_rowwise,
    quantize_rowwise_transposed,
    quantize_tensorwise,
    quantize_tensorwise_transposed,
)


def quantize_rowwise_colsum(
    x: torch.Tensor, qdtype: torch.dtype = torch.int8, *, options: KernelOptions | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our one-pass Triton kernel, launched from Inductor's code (see the module docstring), unless
    options.triton_grad_quantize is off (then Inductor's, like the other quantizes)."""
    if resolve(options).triton_grad_quantize and colsum_in_one_pass(x):
        return torch.ops.hf_switchback.quantize_rowwise_colsum_traced(x, qdtype)
    return reference.quantize_rowwise_colsum(x, qdtype)


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
    """The 8-bit GEMM of kernels/ops.py, launched from Inductor's generated code (see the module docstring);
    the opaque custom op when options.trace_gemm is off or options.use_tma is on. fp8 GEMMs that
    options.fp8_gemm sends to cuBLAS stay `aten._scaled_mm` in the graph (kernels/cublas.py)."""
    options = resolve(options)
    if cublas.use_cublas(a_q, b_q, out_dtype, options.fp8_gemm):
        return cublas.scaled_matmul(a_q, b_q, a_scale, b_scale, bias, out_dtype)
    if options.trace_gemm and not options.use_tma:
        return torch.ops.hf_switchback.scaled_matmul_traced(a_q, b_q, a_scale, b_scale, bias, out_dtype)
    return torch.ops.hf_switchback.scaled_matmul(
        a_q, b_q, a_scale, b_scale, bias, out_dtype, options.use_tma, options.fp8_gemm
    )


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
    """scaled_matmul for backward's recompute of a forward GEMM (the fused MLP's h under memory_efficient), as
    the opaque custom op: a different op from forward's, so the joint graph's common-subexpression pass cannot
    merge the two into one node whose output would then be saved for backward after all."""
    options = resolve(options)
    return torch.ops.hf_switchback.scaled_matmul(
        a_q, b_q, a_scale, b_scale, bias, out_dtype, options.use_tma, options.fp8_gemm
    )


def act_quantize_rowwise(
    h: torch.Tensor, qdtype: torch.dtype, activation: str, *, options: KernelOptions | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Our Triton pass launched from Inductor's code when options.triton_act_quantize (the default), else
    torch ops for Inductor to fuse (see the module docstring)."""
    if resolve(options).triton_act_quantize:
        return torch.ops.hf_switchback.act_quantize_rowwise_traced(h, qdtype, activation)
    return reference.act_quantize_rowwise(h, qdtype, activation)


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
    """Our GEMM, then the activation backward + quantize + column sum: our Triton pass traced into Inductor's
    code when options.triton_act_quantize (the default), else torch ops for Inductor to fuse."""
    options = resolve(options)
    grad_a = scaled_matmul(a_q, b_q, a_scale, b_scale, None, h.dtype, options=options)
    if options.triton_act_quantize:
        return torch.ops.hf_switchback.act_backward_quantize_colsum_traced(
            grad_a, h, qdtype, activation, want_act, options.act_backward_impl
        )
    return act_backward_quantize_colsum(grad_a, h, qdtype, activation, want_act)


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
