"""Triton kernels for the fp8 weight-gradient operands: one scale per column over all rows, written transposed.

    x (M, C) -> q (C, M_pad) contiguous, scale (C,) float32 = reference.quantize_over_tokens(x, qdtype, pad_to)

dW = Gᵀ X reduces over the M tokens, so each operand is scaled per feature (column) and handed to cuBLAS
token-major: the transpose of the input's layout. Two launches:
1. column absmax: each program walks a run of rows of one column block, keeps a running max in registers and
   folds it into absmax[C] with an atomic max on the float32 bit patterns (for non-negative floats, NaN
   included, integer order is float order: exact, order-free, and a NaN wins as in torch's amax);
2. quantize: a (BLOCK_M tokens x BLOCK_C features) tile per program, read along C and written along M (the
   store's pointers are contiguous along M, so Triton converts the tile's layout in shared memory and both the
   load and the store are coalesced). Tiles past M write the zero tokens of the padding up to M_pad, the
   alignment cuBLAS's fp8 GEMM needs, instead of padding the 16-bit input with a copy beforehand.

`requantize_over_tokens` takes an input saved row-quantized (memory_efficient: 8-bit x and one scale per token)
and dequantizes it inside both passes (x_q * row_scale, rounded to the dtype the reference dequantizes to),
so the 16-bit input is never written.

Numerics: the quantize formulas of kernels/quantize.py (scale = absmax / QMAX, correctly rounded division,
clamp, an all-zero column gets scale 0 and q 0), so q and scale equal the torch twin's bit for bit (a NaN
column: NaN scale in both, q clamped here where the twin keeps NaN; dW is NaN either way); the tests check that. The 8-bit dtype and the dequantize rounding reach the kernels as a pointer type and an int: the
launches are traced into Inductor's code under torch.compile (kernels/compiled.py), which passes only numbers
and booleans as constexprs. This module imports triton; only kernels/ops.py imports it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kernel_access import declare_access, when
from .quantize import _max_keep_nan, _scale_args, _scaled_clamped, launch_directly
from .reference import _check_qdtype

# Tile of the quantize pass: 128 tokens (a 128-byte run of q per feature) by 64 features (a 128-byte run of a
# bf16 input row).
_BLOCK_M, _BLOCK_C = 128, 64
# Column-absmax pass: programs to launch (a few per SM of a large GPU), each over a run of rows; fewer
# programs mean fewer atomics per column, more mean more loads in flight.
_ABSMAX_PROGRAMS = 1024
# The dtype a row-quantized input is dequantized to before the column scales are taken (its rounding is part
# of the reference's numerics): 0 none (not dequantized), 1 float32 (float64 holds the same values), 2
# bfloat16, 3 float16.
_ROUND_CODES = {torch.float32: 1, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}


@triton.jit
def _load_tokens(x_ptr, rs_ptr, rows, cols, M, C, stride_m, stride_c, ROUND_TO: tl.constexpr):
    """A (rows, cols) tile of x as float32, 0 outside (M, C); with ROUND_TO, x is 8-bit and dequantized by
    its row scales, then rounded like reference.dequantize_rowwise."""
    mask = (rows[:, None] < M) & (cols[None, :] < C)
    ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_m + cols[None, :].to(tl.int64) * stride_c
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if ROUND_TO != 0:
        x = x * tl.load(rs_ptr + rows, mask=rows < M, other=0.0)[:, None]
        if ROUND_TO == 2:
            x = x.to(tl.bfloat16).to(tl.float32)
        elif ROUND_TO == 3:
            x = x.to(tl.float16).to(tl.float32)
    return x


@declare_access(reads=("x_ptr", when("ROUND_TO", "rs_ptr")), writes=("absmax_ptr",))
@triton.jit
def _column_absmax_kernel(
    x_ptr,
    rs_ptr,
    absmax_ptr,
    M,
    C,
    stride_m,
    stride_c,
    rows_per_program,
    ROUND_TO: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # absmax[c] = max over rows of |x[:, c]|, as float32 bits in an int32 array that starts at 0.
    # rows_per_program is a multiple of BLOCK_M.
    pid_c = tl.program_id(0)
    start = tl.program_id(1) * rows_per_program
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    running = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    for m0 in range(start, start + rows_per_program, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        x = _load_tokens(x_ptr, rs_ptr, rows, cols, M, C, stride_m, stride_c, ROUND_TO)
        running = _max_keep_nan(running, tl.abs(x))
    absmax = tl.reduce(running, 0, _max_keep_nan)
    tl.atomic_max(absmax_ptr + cols, absmax.to(tl.int32, bitcast=True), mask=cols < C)


@declare_access(reads=("x_ptr", "absmax_ptr", when("ROUND_TO", "rs_ptr")), writes=("q_ptr", "s_ptr"))
@triton.jit
def _quantize_transposed_kernel(
    x_ptr,
    rs_ptr,
    absmax_ptr,
    q_ptr,
    s_ptr,
    M,
    C,
    M_PAD,
    stride_m,
    stride_c,
    QMAX_C: tl.constexpr,
    IS_INT: tl.constexpr,
    ROUND_TO: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # q[c, m] for a tile of tokens m and features c; rows in [M, M_PAD) load as 0 and store q = 0 (the padding).
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    absmax = tl.load(absmax_ptr + cols, mask=cmask, other=0).to(tl.float32, bitcast=True)
    scale = tl.div_rn(absmax, QMAX_C)
    if pid_m == 0:
        tl.store(s_ptr + cols, scale, mask=cmask)
    safe = tl.where(scale == 0.0, 1.0, scale)[None, :]
    inv = tl.div_rn(1.0, safe)
    x = _load_tokens(x_ptr, rs_ptr, rows, cols, M, C, stride_m, stride_c, ROUND_TO)
    q = _scaled_clamped(x, safe, inv, QMAX_C, IS_INT).to(q_ptr.dtype.element_ty)
    q_ptrs = q_ptr + cols[None, :].to(tl.int64) * M_PAD + rows[:, None]
    tl.store(q_ptrs, q, mask=(rows[:, None] < M_PAD) & cmask[None, :])


def _launch(x, row_scale, round_to: int, qdtype: torch.dtype, pad_to: int, wrap):
    _check_qdtype(qdtype)
    if pad_to < 1:
        raise ValueError(f"quantize_over_tokens: pad_to must be a positive number of tokens, got {pad_to}")
    if x.dim() != 2:
        raise ValueError(
            f"quantize_over_tokens: x must be 2-D (tokens, features), got shape {tuple(x.shape)}"
        )
    m, c = x.shape
    m_pad = m + (-m % pad_to)
    q = torch.empty((c, m_pad), dtype=qdtype, device=x.device)
    if c == 0 or m == 0:  # m == 0 leaves m_pad == 0 too: nothing to quantize
        return q, torch.zeros((c,), dtype=torch.float32, device=x.device)
    scale = torch.empty(
        (c,), dtype=torch.float32, device=x.device
    )  # every column written by the quantize pass
    absmax = torch.zeros((c,), dtype=torch.int32, device=x.device)  # float32 bits, see the module docstring
    col_blocks = triton.cdiv(c, _BLOCK_C)
    splits = max(1, min(triton.cdiv(m, _BLOCK_M), _ABSMAX_PROGRAMS // col_blocks))
    rows_per_program = triton.cdiv(triton.cdiv(m, splits), _BLOCK_M) * _BLOCK_M
    rs = x if row_scale is None else row_scale  # any pointer when there are no row scales (never read)
    wrap = wrap or launch_directly
    wrap(_column_absmax_kernel)[(col_blocks, triton.cdiv(m, rows_per_program))](
        x,
        rs,
        absmax,
        m,
        c,
        x.stride(0),
        x.stride(1),
        rows_per_program,
        ROUND_TO=round_to,
        BLOCK_M=_BLOCK_M,
        BLOCK_C=_BLOCK_C,
        num_warps=4,
    )
    wrap(_quantize_transposed_kernel)[(triton.cdiv(m_pad, _BLOCK_M), col_blocks)](
        x,
        rs,
        absmax,
        q,
        scale,
        m,
        c,
        m_pad,
        x.stride(0),
        x.stride(1),
        ROUND_TO=round_to,
        BLOCK_M=_BLOCK_M,
        BLOCK_C=_BLOCK_C,
        num_warps=4,
        **_scale_args(qdtype),
    )
    return q, scale


def quantize_over_tokens(
    x: torch.Tensor, qdtype: torch.dtype = torch.int8, pad_to: int = 1, *, wrap=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, C) float, any strides -> (q (C, M_pad) qdtype contiguous, scale (C,) float32): one scale per column
    over all M rows, q = quantize_rowwise(x.T) with zero columns up to M_pad, the next multiple of pad_to.
    wrap: as in matmul.scaled_matmul."""
    return _launch(x, None, 0, qdtype, pad_to, wrap)


def requantize_over_tokens(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    dtype: torch.dtype,
    qdtype: torch.dtype,
    pad_to: int = 1,
    *,
    wrap=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_over_tokens(dequantize_rowwise(x_q, x_scale, dtype), qdtype, pad_to) without writing the
    dequantized tensor: x_q (M, C) int8 or fp8 with one float32 scale per row, x_scale (M,)."""
    if dtype not in _ROUND_CODES:
        raise ValueError(f"requantize_over_tokens: dtype must be one of {list(_ROUND_CODES)}, got {dtype}")
    if x_scale.shape != x_q.shape[:1]:
        raise ValueError(
            f"requantize_over_tokens: x_scale must hold one scale per row of x_q {tuple(x_q.shape)}, got shape "
            f"{tuple(x_scale.shape)}"
        )
    return _launch(x_q, x_scale.float().contiguous(), _ROUND_CODES[dtype], qdtype, pad_to, wrap)


__all__ = ["quantize_over_tokens", "requantize_over_tokens"]
