"""The kernel set used while torch.compile traces a SwitchBack model on CUDA.

The quantize functions are the torch reference ones (kernels/reference.py): plain tensor ops that Inductor
fuses into the op that produced their input (LayerNorm, GELU, the residual add, and in backward GELU's
gradient), so a compiled model pays no separate quantize pass and no Python launch overhead for them. The
8-bit GEMM stays our Triton kernel behind its custom op (kernels/ops.py): Inductor's own int8 matmul lowers
to cuBLAS `_int_mm`, which is no faster than bf16 on Hopper.

Numerics: the same formulas as the Triton quantize kernels (absmax / QMAX, round half to even, clamp), so
compiled and eager SwitchBack agree up to the float32 rounding of Inductor's generated code.
"""

from __future__ import annotations

from .ops import dequantize_rowwise, scaled_matmul
from .reference import (
    QMAX,
    quantize_rowwise,
    quantize_rowwise_colsum,
    quantize_rowwise_transposed,
    quantize_tensorwise,
    quantize_tensorwise_transposed,
)

__all__ = [
    "QMAX",
    "dequantize_rowwise",
    "quantize_rowwise",
    "quantize_rowwise_colsum",
    "quantize_rowwise_transposed",
    "quantize_tensorwise",
    "quantize_tensorwise_transposed",
    "scaled_matmul",
]
