"""The kernel set used while torch.compile traces a SwitchBack model on CUDA.

The quantize functions (and the fused MLP's activation + quantize passes) are the torch reference ones
(kernels/reference.py): plain tensor ops that Inductor fuses into the op that produced their input (LayerNorm,
GELU, the residual add, and in backward GELU's gradient), so a compiled model pays no separate quantize pass
and no Python launch overhead for them. The 8-bit GEMM stays our Triton kernel (Inductor's own int8 matmul
lowers to cuBLAS `_int_mm`, which is no faster than bf16 on Hopper), as a `triton_op` (kernels/ops.py) whose
launch Inductor records and makes from its generated code, with no Python call per GEMM. With
`matmul.USE_TMA` it is the opaque custom op instead: the TMA kernel's host-side setup is not traceable.

One quantize stays ours too: the output gradient's (with the bias gradient's column sum). That tensor is
written in 16 bits anyway (the grad-weight GEMM reads it), so fusing its quantize into the op that produced it
saves nothing; Inductor's version re-read the producer's inputs instead (GELU backward: grad and h) in a
slow persistent reduction: on the H100, a ViT-H/14 step spent 18.4 ms in it for the 32 fc1 gradients alone,
vs 11.4 ms for all 192 gradient quantizes with our kernel (BENCHMARKS.md, Whole training step). This covers the
separate-linear path (the default); the fused MLP's (fuse_mlp=True) activation backward + quantize below is
still Inductor's.

Known limit: Inductor tunes our GEMM's configs without its autotune key, so when Dynamo makes the token count
dynamic (a second shape, e.g. a short last batch), one tuned config serves every M. The layer-wise compile
in benchmarks/bench_train.py uses dynamic=False.

Numerics: the same formulas as the Triton quantize kernels (absmax / QMAX, round half to even, clamp), so
compiled and eager SwitchBack agree up to the float32 rounding of Inductor's generated code
(tests/test_compiled_kernels.py states the bound).
"""

from __future__ import annotations

import torch

from . import matmul, reference
from .ops import dequantize_rowwise
from .quantize import colsum_in_one_pass
from .reference import (
    QMAX,
    act_backward_quantize_colsum,
    act_quantize_rowwise,
    quantize_rowwise,
    quantize_rowwise_transposed,
    quantize_tensorwise,
    quantize_tensorwise_transposed,
)

# False keeps the GEMM an opaque custom op under torch.compile (benchmarks only, the A/B of the triton_op).
TRACE_GEMM = True
# False leaves the output-gradient quantize + column sum to Inductor too (benchmarks only, the A/B).
TRITON_GRAD_QUANTIZE = True


def quantize_rowwise_colsum(
    x: torch.Tensor, qdtype: torch.dtype = torch.int8
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our one-pass Triton kernel, launched from Inductor's code (see the module docstring)."""
    if TRITON_GRAD_QUANTIZE and colsum_in_one_pass(x):
        return torch.ops.hf_switchback.quantize_rowwise_colsum_traced(x, qdtype)
    return reference.quantize_rowwise_colsum(x, qdtype)


def scaled_matmul(
    a_q: torch.Tensor,
    b_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The 8-bit GEMM of kernels/ops.py, launched from Inductor's generated code (see the module docstring)."""
    if TRACE_GEMM and not matmul.USE_TMA:
        return torch.ops.hf_switchback.scaled_matmul_traced(a_q, b_q, a_scale, b_scale, bias, out_dtype)
    return torch.ops.hf_switchback.scaled_matmul(a_q, b_q, a_scale, b_scale, bias, out_dtype)


def scaled_matmul_act_backward(
    a_q: torch.Tensor,
    b_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    h: torch.Tensor,
    qdtype: torch.dtype,
    activation: str,
    want_act: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our GEMM, then the activation backward + quantize as torch ops for Inductor to fuse (see reference)."""
    grad_a = scaled_matmul(a_q, b_q, a_scale, b_scale, None, h.dtype)
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
]
