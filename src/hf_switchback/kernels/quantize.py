"""Triton quantize kernels: row-wise, tensor-wise and column-wise (fused transpose), int8 and fp8.

Each public function has the signature and the exact numerics of its twin in `kernels/reference.py`:
scale = absmax / QMAX and q = x / scale are IEEE-rounded divisions (`tl.div_rn`; Triton's plain `/` on fp32
is approximate), int8 rounding is round-half-to-even, values are clamped to [-QMAX, QMAX] before the cast
(float8_e4m3fn has no inf), an all-zero row, column or tensor gets scale 0 and q 0, and a NaN gives its row,
column or tensor a NaN scale (as torch's amax does; Triton's own max reductions would drop it). The tests check
the results bitwise against the reference run on the CPU.

Row-wise quantizes of rows up to _MAX_SINGLE_PASS values (the output gradient's with its column sum, the plain
one, the activation + quantize of fc2's input, the activation backward + quantize + column sum of fc1's output
gradient) share one kernel body, _quantize_row_tiles: whole rows in registers, read once, the next tile's loads
in flight while the current one is quantized.

Shapes: any (M, K) with any strides (the kernels take strides; the hot path gets contiguous rows), any dtype
that converts to float32. Empty tensors never reach a kernel. This module imports triton; only
`kernels/ops.py` imports it, and only on the CUDA path.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import reference
from .kernel_access import declare_access, when
from .options import ACT_BACKWARD_IMPLS
from .reference import QMAX, _check_qdtype

# Rows up to this length are quantized from registers in one pass; longer rows take two passes over memory.
_MAX_SINGLE_PASS = 8192
# Tile of the 2-D (weight-sized) kernels.
_TILE_M, _TILE_K = 64, 64
_TL_QDTYPE = {
    torch.int8: tl.int8,
    torch.float8_e4m3fn: tl.float8e4nv,
    torch.float8_e5m2: tl.float8e5,
}
# Activations fused into the row quantizes of a SwitchBack MLP (kernels/reference.ACTIVATIONS lists them).
ACT_CODES = {None: 0, "gelu": 1, "gelu_tanh": 2, "quick_gelu": 3}
# Launch of the row-tile quantize kernels (_row_tiles_launch says why): the most pieces a row is held in,
# the most values of a row per thread in one warp and in several, the fewest values of a tile per thread, and
# warps per SM.
_CS_MAX_CHUNKS = 5
_CS_ONE_WARP_PER_THREAD = 40
_CS_ROW_PER_THREAD = 32
_CS_MIN_PER_THREAD = 16
_CS_WARPS_PER_SM = 16
_CS_TWO_INPUT_MIN_WARPS = 4
# The activation forward (act + quantize of fc1's output, fc2's input) spends tens of arithmetic operations per
# value on the activation (erf, or a sigmoid's exp and division) where the plain quantize spends a few, so more
# rows in flight hide more of that latency than the one-input rule's warps do. At most 4 warps a program and 64
# warps' worth of programs per SM: on an H100, bitwise the same q and scale, ms against the one-input rule's
# launch: 0.484 vs 0.551 (GELU, 49,344 x 5,120), 0.347 vs 0.408 (tanh GELU), 0.291 vs 0.312 (GELU, 50,432 x
# 3,072), 0.117 vs 0.123 (GELU, 14,784 x 4,096) (BENCHMARKS.md, GEMM kernels: row kernels alone).
_ACT_MAX_WARPS = 4
_ACT_WARPS_PER_SM = 64
# KernelOptions.act_backward_impl "auto": whole rows per program ("rows": g and h read once, on the row-tile
# kernel body) up to the one-pass limit, 2-D tiles ("tiles", which re-read the gradient) above. On an H200
# "rows" took 0.50-0.59x the time of "tiles" at every CLIP width from 1,280 to 5,120 (BENCHMARKS.md, Whole
# training step).
_ROWS_IMPL_MAX_K = _MAX_SINGLE_PASS
# Tile of the "tiles" activation backward.
_BWD_TILE_M, _BWD_TILE_K = 32, 256


# Kernels (launchers below).


@triton.jit
def _div_rn(x, divisor, inv):
    """Correctly rounded x / divisor, given inv = RN(1 / divisor).

    IEEE division (`div.rn.f32`) costs tens of instructions and made the row kernel compute-bound. One
    multiply plus one Newton correction with exact FMA residuals gives the same result (Markstein's theorem:
    inv correctly rounded, q0 within an ulp of x / divisor, r = x - q0 * divisor exact) at memory speed.
    """
    q0 = x * inv
    r = tl.fma(-q0, divisor, x)
    return tl.fma(r, inv, q0)


# Under TRITON_INTERPRET=1 (the CPU runs of the tests) Triton's float32 -> fp8 cast is not correctly rounded,
# so there the kernels round to the fp8 grid themselves first (_round_to_fp8_grid); on the GPU the cast is
# exact (measured: H200, triton 3.6, values next to every midpoint of both grids, subnormals) and the extra
# arithmetic cost the fp8 quantize up to 20% (BENCHMARKS.md, Whole training step).
_INTERPRETED: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def _round_to_fp8_grid(v, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """float32 v (|v| within the format's range) -> the nearest value of the fp8 format, ties to even, still
    float32, so the cast that follows is exact. The grid step at v is 2**(max(exponent(v), MIN_EXP) -
    MANT_BITS); adding and subtracting 1.5 * 2**23 times that step rounds to a multiple of it, ties to even,
    in plain float32 arithmetic. The sign of v is kept (-0.0 included)."""
    a = tl.abs(v)
    exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step_exp = tl.maximum(exponent, MIN_EXP) - MANT_BITS
    magic = ((step_exp + 23 + 127) << 23 | 0x400000).to(tl.float32, bitcast=True)  # 1.5 * 2**(23 + step_exp)
    rounded = (a + magic) - magic
    sign = (v.to(tl.int32, bitcast=True) >> 31) << 31
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _scaled_clamped(x, safe_scale, inv_scale, QMAX_C: tl.constexpr, IS_INT: tl.constexpr):
    """float32 x -> the value q will hold, still float32: divide (correctly rounded), clamp; int8: round half
    to even; fp8: the cast rounds (see _INTERPRETED)."""
    scaled = _div_rn(x, safe_scale, inv_scale)
    if IS_INT:
        # Adding then subtracting 1.5 * 2**23 rounds |v| < 2**22 to an integer, ties to even, in plain fp32
        # arithmetic; unlike libdevice.rint it also runs under TRITON_INTERPRET=1.
        return tl.minimum(tl.maximum((scaled + 12582912.0) - 12582912.0, -QMAX_C), QMAX_C)
    # The division's correction step turns x = -0.0 into +0.0; torch's x / scale keeps -0.0 (an fp8 q of -0.0).
    scaled = tl.minimum(tl.maximum(tl.where(x == 0.0, x, scaled), -QMAX_C), QMAX_C)
    if _INTERPRETED:
        if QMAX_C == 448.0:  # float8_e4m3fn: 3 mantissa bits, normal exponents from -6
            return _round_to_fp8_grid(scaled, 3, -6)
        return _round_to_fp8_grid(scaled, 2, -14)  # float8_e5m2: 2 mantissa bits, normal exponents from -14
    return scaled


@triton.jit
def _to_q(x, safe_scale, inv_scale, QMAX_C: tl.constexpr, IS_INT: tl.constexpr, Q_DTYPE: tl.constexpr):
    """float32 x -> q: _scaled_clamped, then the cast to the 8-bit dtype."""
    return _scaled_clamped(x, safe_scale, inv_scale, QMAX_C, IS_INT).to(Q_DTYPE)


@triton.jit
def _act_fwd_bwd(h, ACT: tl.constexpr):
    """(act(h), act'(h)) in float32. tanh is written through the sigmoid: 1 + tanh(u) = 2 sigmoid(2u) and
    1 - tanh(u)^2 = 4 s (1 - s), which avoids the cancellation of tanh near 0 and needs only exp."""
    if ACT == 1:
        cdf = 0.5 * (1.0 + tl.erf(h * 0.7071067811865476))
        return h * cdf, cdf + h * tl.exp(-0.5 * h * h) * 0.3989422804014327
    elif ACT == 2:
        s = tl.sigmoid(2.0 * (0.7978845608028654 * (h + 0.044715 * h * h * h)))
        du = 0.7978845608028654 * (1.0 + 0.134145 * h * h)
        return h * s, s + 2.0 * h * s * (1.0 - s) * du
    else:
        s = tl.sigmoid(1.702 * h)
        return h * s, s + 1.702 * h * s * (1.0 - s)


@triton.jit
def _act_fwd(x, x_ptr, ACT: tl.constexpr):
    # act(x) rounded to the input's dtype, as the unfused activation module would store it; ACT=0: x itself.
    if ACT != 0:
        x = _act_fwd_bwd(x, ACT)[0].to(x_ptr.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def _max_keep_nan(a, b):
    # tl.max / tl.maximum return the other operand for a NaN, which would give a NaN row a finite scale and a
    # finite, wrong q (a silent NaN). Keeping the NaN gives a NaN scale, so the GEMM output is not finite
    # either, as with torch's amax in the reference path.
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _absmax(x, axis: tl.constexpr, KEEP_DIMS: tl.constexpr = False):
    """max |x| along axis, float32, NaN if any element is NaN."""
    return tl.reduce(tl.abs(x), axis, _max_keep_nan, keep_dims=KEEP_DIMS)


@declare_access(reads=("x_ptr",), writes=("q_ptr", "s_ptr"))
@triton.jit
def _rowwise_long_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    stride_xm,
    stride_xk,
    stride_qm,
    QMAX_C: tl.constexpr,
    IS_INT: tl.constexpr,
    Q_DTYPE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ACT: tl.constexpr = 0,
):
    # Rows longer than the one-pass limit, one program per row: a pass for the absmax, a second for q.
    # ACT != 0 quantizes act(x) instead of x (the input of fc2 in a fused MLP), never writing act(x).
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    offs = tl.arange(0, BLOCK_K)
    running = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + offs < K
        x = tl.load(x_row + (k0 + offs) * stride_xk, mask=mask, other=0.0).to(tl.float32)
        running = _max_keep_nan(running, tl.abs(_act_fwd(x, x_ptr, ACT)))
    scale = tl.div_rn(tl.reduce(running, 0, _max_keep_nan), QMAX_C)
    safe = tl.where(scale == 0.0, 1.0, scale)
    inv = tl.div_rn(1.0, safe)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + offs < K
        x = tl.load(x_row + (k0 + offs) * stride_xk, mask=mask, other=0.0).to(tl.float32)
        x = _act_fwd(x, x_ptr, ACT)
        tl.store(q_row + k0 + offs, _to_q(x, safe, inv, QMAX_C, IS_INT, Q_DTYPE), mask=mask)


@triton.jit
def _row_chunks(x_ptr, rows, rmask, K, stride_xm, stride_xk, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    """A tile of whole rows as CHUNKS [BLOCK_M, CHUNK] pieces in x's dtype (a tuple), zero past K and in the
    rows that rmask leaves out (those load nothing from memory)."""
    offs = tl.arange(0, CHUNK)
    base = x_ptr + rows[:, None] * stride_xm
    chunks = ()
    for c in tl.static_range(CHUNKS):
        cols = c * CHUNK + offs
        mask = rmask[:, None] & (cols < K)[None, :]
        # tuple concatenation: Triton's frontend has no starred expressions
        chunks = chunks + (tl.load(base + cols[None, :].to(tl.int64) * stride_xk, mask=mask, other=0.0),)  # noqa: RUF005
    return chunks


@triton.jit
def _quantize_row_tiles(
    x_ptr,
    q_ptr,
    s_ptr,
    part_ptr,
    M,
    K,
    stride_xm,
    stride_xk,
    stride_qm,
    rows_per_program,
    QMAX_C: tl.constexpr,
    IS_INT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    CHUNKS: tl.constexpr,
    ACT: tl.constexpr,
    COLSUM: tl.constexpr,
    a_ptr,
    WRITE_ACT: tl.constexpr,
    h_ptr,
    stride_hm,
    stride_hk,
    BWD: tl.constexpr,
    act_ptr,
    WRITE_H_ACT: tl.constexpr,
):
    # Row-wise quantize of the rows [pid * rows_per_program, ...) (of act(x) when ACT != 0; act(x) written to
    # a_ptr, with q's strides, only when WRITE_ACT). COLSUM also sums them: part[pid, :] = their float32 column
    # sum, so the bias gradient needs no second pass over x. rows_per_program is a multiple of BLOCK_M; the program walks its rows one tile of
    # BLOCK_M whole rows at a time.
    # BWD (with ACT != 0): x is the activation's output gradient g and h_ptr its input; the rows quantized
    # (and summed) are gh = g * act'(h), rounded to g's dtype as the unfused backward stores it, and written
    # to a_ptr when WRITE_ACT (the 16-bit operand of fc1's grad-weight GEMM); WRITE_H_ACT also writes act(h)
    # to act_ptr (fc2's grad-weight operand, recomputed rather than saved). g and h are read once.
    #
    # Whole rows stay in registers, so x is read from memory once and never re-read from L2 (a row's absmax
    # is needed before any of its values can be quantized). A row is held as CHUNKS pieces of CHUNK columns
    # (a power of two, as Triton's blocks must be), which fits the usual widths with no masked-off lanes:
    # 1280 = 5 x 256, 5120 = 5 x 1024, 768 and 3072 = 3 x 256 and 3 x 1024; one next_power_of_2(K)-wide
    # block wastes 37% of its lanes at 1280 and 5120. The pieces share one shape, hence one register
    # layout: pieces of different widths get different layouts, and Triton then moves a whole piece through
    # shared memory to combine their row maxima.
    #
    # Memory-level parallelism: each iteration issues the next tile's loads before working on the current
    # tile, so a tile is in flight while the previous one is reduced, quantized and stored. The column sum
    # is accumulated per tile element (no cross-thread work in the loop) and reduced over rows once, at the
    # end.
    #
    # The 8-bit dtype comes from q_ptr, not from a dtype constexpr: torch.compile launches this kernel from
    # its generated code (kernels/compiled.py), which takes numbers and booleans as constexprs.
    pid = tl.program_id(0)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    rows = row_start + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    offs = tl.arange(0, CHUNK)
    x_next = _row_chunks(x_ptr, rows, rmask, K, stride_xm, stride_xk, CHUNK, CHUNKS)
    h_next = x_next
    if BWD:
        h_next = _row_chunks(h_ptr, rows, rmask, K, stride_hm, stride_hk, CHUNK, CHUNKS)
    acc = ()
    if COLSUM:
        for _c in tl.static_range(CHUNKS):
            acc = acc + (tl.zeros([BLOCK_M, CHUNK], dtype=tl.float32),)  # noqa: RUF005
    for _ in range(0, rows_per_program, BLOCK_M):
        x = x_next
        h = h_next
        next_rows = rows + BLOCK_M
        next_rmask = next_rows < row_end
        x_next = _row_chunks(x_ptr, next_rows, next_rmask, K, stride_xm, stride_xk, CHUNK, CHUNKS)
        if BWD:
            h_next = _row_chunks(h_ptr, next_rows, next_rmask, K, stride_hm, stride_hk, CHUNK, CHUNKS)
        if BWD:  # gh = g * act'(h) per value, held as float32 pieces of g's dtype (zero in padded lanes)
            grads = ()
            for c in tl.static_range(CHUNKS):
                cols = c * CHUNK + offs
                out_mask = rmask[:, None] & (cols < K)[None, :]
                act, dact = _act_fwd_bwd(h[c].to(tl.float32), ACT)
                gh = (x[c].to(tl.float32) * dact).to(x_ptr.dtype.element_ty)
                if WRITE_ACT:
                    tl.store(a_ptr + rows[:, None] * stride_qm + cols[None, :], gh, mask=out_mask)
                if WRITE_H_ACT:
                    a_out = act_ptr + rows[:, None] * stride_qm + cols[None, :]
                    tl.store(a_out, act.to(act_ptr.dtype.element_ty), mask=out_mask)
                grads = grads + (gh.to(tl.float32),)  # noqa: RUF005
            x = grads
        elif ACT != 0:  # act(x) once per value, held as float32 pieces (zero stays zero in padded lanes)
            activated = ()
            for c in tl.static_range(CHUNKS):
                a = _act_fwd(x[c].to(tl.float32), x_ptr, ACT)
                if WRITE_ACT:  # a is rounded to x's dtype already (_act_fwd), so the store is exact
                    cols = c * CHUNK + offs
                    a_out = a_ptr + rows[:, None] * stride_qm + cols[None, :]
                    tl.store(a_out, a.to(a_ptr.dtype.element_ty), mask=rmask[:, None] & (cols < K)[None, :])
                activated = activated + (a,)  # noqa: RUF005
            x = activated
        absx = tl.abs(x[0].to(tl.float32))
        for c in tl.static_range(1, CHUNKS):
            absx = _max_keep_nan(absx, tl.abs(x[c].to(tl.float32)))
        scale = tl.div_rn(tl.reduce(absx, 1, _max_keep_nan, keep_dims=True), QMAX_C)
        safe = tl.where(scale == 0.0, 1.0, scale)
        inv = tl.div_rn(1.0, safe)
        tl.store(s_ptr + rows[:, None], scale, mask=rmask[:, None])
        q_row = q_ptr + rows[:, None] * stride_qm
        summed = ()
        for c in tl.static_range(CHUNKS):
            xc = x[c].to(tl.float32)
            if COLSUM:
                summed = summed + (acc[c] + xc,)  # noqa: RUF005
            cols = c * CHUNK + offs
            q = _scaled_clamped(xc, safe, inv, QMAX_C, IS_INT).to(q_ptr.dtype.element_ty)
            tl.store(q_row + cols[None, :], q, mask=rmask[:, None] & (cols < K)[None, :])
        acc = summed
        rows = next_rows
        rmask = next_rmask
    if COLSUM:
        for c in tl.static_range(CHUNKS):
            cols = c * CHUNK + offs
            tl.store(part_ptr + pid.to(tl.int64) * K + cols, tl.sum(acc[c], axis=0), mask=cols < K)


@declare_access(reads=("x_ptr",), writes=("q_ptr", "s_ptr", "part_ptr"))
@triton.jit
def _rowwise_colsum_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    part_ptr,
    M,
    K,
    stride_xm,
    stride_xk,
    stride_qm,
    rows_per_program,
    QMAX_C: tl.constexpr,
    IS_INT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    # quantize_rowwise_colsum (the output gradient's quantize and the bias gradient)
    _quantize_row_tiles(
        x_ptr, q_ptr, s_ptr, part_ptr, M, K, stride_xm, stride_xk, stride_qm,
        rows_per_program, QMAX_C, IS_INT, BLOCK_M, CHUNK, CHUNKS, 0, True, x_ptr, False,
        x_ptr, 0, 0, False, x_ptr, False,
    )  # fmt: skip


@declare_access(reads=("x_ptr",), writes=("q_ptr", "s_ptr"))
@triton.jit
def _rowwise_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    stride_xm,
    stride_xk,
    stride_qm,
    rows_per_program,
    QMAX_C: tl.constexpr,
    IS_INT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    CHUNKS: tl.constexpr,
    ACT: tl.constexpr,
):
    # quantize_rowwise and act_quantize_rowwise (rows up to the one-pass limit); s_ptr stands in for the
    # column sums it does not write
    _quantize_row_tiles(
        x_ptr, q_ptr, s_ptr, s_ptr, M, K, stride_xm, stride_xk, stride_qm,
        rows_per_program, QMAX_C, IS_INT, BLOCK_M, CHUNK, CHUNKS, ACT, False, x_ptr, False,
        x_ptr, 0, 0, False, x_ptr, False,
    )  # fmt: skip


@declare_access(reads=("x_ptr",), writes=("a_ptr", "q_ptr", "s_ptr"))
@triton.jit
def _act_and_rowwise_kernel(
    x_ptr,
    a_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    stride_xm,
    stride_xk,
    stride_qm,
    rows_per_program,
    QMAX_C: tl.constexpr,
    IS_INT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    CHUNKS: tl.constexpr,
    ACT: tl.constexpr,
):
    # act_and_quantize_rowwise: act(x) written (the 16-bit input fc2's grad-weight GEMM reads) and quantized
    _quantize_row_tiles(
        x_ptr, q_ptr, s_ptr, s_ptr, M, K, stride_xm, stride_xk, stride_qm,
        rows_per_program, QMAX_C, IS_INT, BLOCK_M, CHUNK, CHUNKS, ACT, False, a_ptr, True,
        x_ptr, 0, 0, False, x_ptr, False,
    )  # fmt: skip


@declare_access(
    reads=("g_ptr", "h_ptr"), writes=("gh_ptr", "q_ptr", "s_ptr", "part_ptr", when("WRITE_A", "act_ptr"))
)
@triton.jit
def _act_backward_rows_kernel(
    g_ptr,
    h_ptr,
    gh_ptr,
    act_ptr,
    q_ptr,
    s_ptr,
    part_ptr,
    M,
    K,
    stride_gm,
    stride_gk,
    stride_hm,
    stride_hk,
    stride_qm,
    rows_per_program,
    QMAX_C: tl.constexpr,
    IS_INT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    CHUNKS: tl.constexpr,
    ACT: tl.constexpr,
    WRITE_A: tl.constexpr,
):
    # act_backward_quantize_colsum by whole rows: gh = g * act'(h) written 16-bit (fc1's grad-weight operand),
    # row-quantized (its grad-input operand) and column-summed (its bias gradient), g and h read once;
    # WRITE_A also writes act(h). Outputs contiguous, with q's row stride.
    _quantize_row_tiles(
        g_ptr, q_ptr, s_ptr, part_ptr, M, K, stride_gm, stride_gk, stride_qm,
        rows_per_program, QMAX_C, IS_INT, BLOCK_M, CHUNK, CHUNKS, ACT, True, gh_ptr, True,
        h_ptr, stride_hm, stride_hk, True, act_ptr, WRITE_A,
    )  # fmt: skip


@declare_access(
    reads=("g_ptr", "h_ptr"), writes=("gh_ptr", "absmax_ptr", "part_ptr", when("WRITE_A", "a_ptr"))
)
@triton.jit
def _act_backward_tiles_kernel(
    g_ptr,
    h_ptr,
    gh_ptr,
    a_ptr,
    absmax_ptr,
    part_ptr,
    M,
    K,
    stride_gm,
    stride_gk,
    stride_hm,
    stride_hk,
    ACT: tl.constexpr,
    WRITE_A: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Phase 1 of the tiled activation backward: a (BLOCK_M, BLOCK_K) tile per program, no row needs to fit in
    # one program (full occupancy, every load independent). Writes gh = g * act'(h) (and act(h)), folds the
    # tile's row absmax into absmax[row] (atomic max of float32 bits: order-free, exact, NaN kept) and writes
    # the tile's column sum to part[pid_m, :]. Phase 2 (_quantize_2d_kernel, per-row scales) quantizes gh.
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    kmask = offs_k < K
    mask = mask_m[:, None] & kmask[None, :]
    rows = offs_m[:, None].to(tl.int64)
    g = tl.load(g_ptr + rows * stride_gm + offs_k[None, :] * stride_gk, mask=mask, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + rows * stride_hm + offs_k[None, :] * stride_hk, mask=mask, other=0.0).to(tl.float32)
    act, dact = _act_fwd_bwd(h, ACT)
    gh = (g * dact).to(gh_ptr.dtype.element_ty)
    out_offs = rows * K + offs_k[None, :]
    tl.store(gh_ptr + out_offs, gh, mask=mask)
    if WRITE_A:
        tl.store(a_ptr + out_offs, act.to(a_ptr.dtype.element_ty), mask=mask)
    x = tl.where(mask, gh.to(tl.float32), 0.0)
    # as float32 bits in an int32 array that starts at 0: for non-negative floats (NaN included, above inf)
    # the integer order is the float order, where Triton's float atomic max would skip a NaN
    tl.atomic_max(absmax_ptr + offs_m, _absmax(x, 1).to(tl.int32, bitcast=True), mask=mask_m)
    tl.store(part_ptr + pid_m.to(tl.int64) * K + offs_k, tl.sum(x, axis=0), mask=kmask)


@triton.jit
def _col_absmax_kernel(
    x_ptr, part_ptr, M, K, stride_xm, stride_xk, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr
):
    # Per-tile column absmax -> part[pid_m, k]; the caller reduces over pid_m (or over everything).
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(part_ptr + pid_m * K + offs_k, _absmax(x, 0), mask=offs_k < K)


@declare_access(reads=("x_ptr", "absmax_ptr"), writes=("q_ptr", "s_ptr"))
@triton.jit
def _quantize_2d_kernel(
    x_ptr,
    q_ptr,
    absmax_ptr,
    s_ptr,
    M,
    K,
    stride_xm,
    stride_xk,
    stride_qm,
    stride_qk,
    PER_COLUMN: tl.constexpr,
    QMAX_C: tl.constexpr,
    IS_INT: tl.constexpr,
    Q_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PER_ROW: tl.constexpr = False,
):
    # Quantize a tile with a known absmax (one per row, one per column, or one for the tensor); q may be written
    # transposed by passing swapped output strides (stride 1 is specialized, so the store stays coalesced).
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = offs_k < K
    mask = (offs_m[:, None] < M) & kmask[None, :]
    if PER_ROW:
        mmask = offs_m < M
        absmax = tl.load(absmax_ptr + offs_m, mask=mmask, other=0.0)
        scale = tl.div_rn(absmax, QMAX_C)
        if pid_k == 0:
            tl.store(s_ptr + offs_m, scale, mask=mmask)
        safe = tl.where(scale == 0.0, 1.0, scale)[:, None]
        inv = tl.div_rn(1.0, safe)
    elif PER_COLUMN:
        absmax = tl.load(absmax_ptr + offs_k, mask=kmask, other=0.0)
        scale = tl.div_rn(absmax, QMAX_C)
        if pid_m == 0:
            tl.store(s_ptr + offs_k, scale, mask=kmask)
        safe = tl.where(scale == 0.0, 1.0, scale)[None, :]
        inv = tl.div_rn(1.0, safe)
    else:
        scale = tl.div_rn(tl.load(absmax_ptr), QMAX_C)
        if (pid_m == 0) & (pid_k == 0):
            tl.store(s_ptr, scale)
        safe = tl.where(scale == 0.0, 1.0, scale)
        inv = tl.div_rn(1.0, safe)
    ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    q = _to_q(x, safe, inv, QMAX_C, IS_INT, Q_DTYPE)
    q_ptrs = q_ptr + offs_m[:, None].to(tl.int64) * stride_qm + offs_k[None, :] * stride_qk
    tl.store(q_ptrs, q, mask=mask)


@triton.jit
def _dequantize_rowwise_kernel(q_ptr, s_ptr, out_ptr, M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    offs = offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
    q = tl.load(q_ptr + offs, mask=mask).to(tl.float32)
    s = tl.load(s_ptr + offs_m, mask=offs_m < M, other=0.0)
    tl.store(out_ptr + offs, (q * s[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


# Launchers: the public functions and their helpers.


def _scale_args(qdtype: torch.dtype) -> dict:
    """The number/bool constexprs of an 8-bit target (all a kernel launched from Inductor's code may take)."""
    return dict(QMAX_C=_check_qdtype(qdtype), IS_INT=qdtype == torch.int8)


def _qargs(qdtype: torch.dtype) -> dict:
    return dict(_scale_args(qdtype), Q_DTYPE=_TL_QDTYPE[qdtype])


def launch_directly(kernel):
    """The `wrap` of an eager launch: the kernel itself (a traced launch passes torch.library.wrap_triton)."""
    return kernel


def _quantize_rowwise(x: torch.Tensor, qdtype: torch.dtype, activation: str | None, wrap=None):
    m, k = x.shape
    q = torch.empty((m, k), dtype=qdtype, device=x.device)
    if m == 0 or k == 0:  # an empty row's scale is 0, as the twin's
        return q, torch.zeros((m,), dtype=torch.float32, device=x.device)
    # Every kernel below writes every row's scale: no fill kernel before it (eager: one launch fewer a call).
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    launch_with = wrap or launch_directly
    if k > _MAX_SINGLE_PASS:
        launch_with(_rowwise_long_kernel)[(m,)](
            x,
            q,
            scale,
            k,
            x.stride(0),
            x.stride(1),
            q.stride(0),
            BLOCK_K=_MAX_SINGLE_PASS,
            ACT=ACT_CODES[activation],
            num_warps=16,
            **_qargs(qdtype),
        )
        return q, scale
    launch = _row_tiles_launch(m, k, _sm_count(x.device), activation=activation is not None)
    grid = launch.pop("grid")
    launch_with(_rowwise_kernel)[grid](
        x,
        q,
        scale,
        m,
        k,
        x.stride(0),
        x.stride(1),
        q.stride(0),
        ACT=ACT_CODES[activation],
        **launch,
        **_scale_args(qdtype),
    )
    return q, scale


def quantize_rowwise(
    x: torch.Tensor, qdtype: torch.dtype = torch.int8, *, wrap=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) float -> (q (M, K) qdtype contiguous, scale (M,) float32), one scale per row.
    wrap: as in matmul.scaled_matmul."""
    return _quantize_rowwise(x, qdtype, None, wrap)


def act_quantize_rowwise(
    h: torch.Tensor, qdtype: torch.dtype, activation: str, *, wrap=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rowwise(act(h) rounded to h's dtype), h read once and act(h) never written.
    wrap: as in matmul.scaled_matmul."""
    if activation not in ACT_CODES or activation is None:
        raise ValueError(f"unsupported activation {activation!r}; expected one of {list(ACT_CODES)[1:]}")
    return _quantize_rowwise(h, qdtype, activation, wrap)


def act_and_quantize_rowwise(
    h: torch.Tensor, qdtype: torch.dtype, activation: str, *, wrap=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(act(h) rounded to h's dtype, *quantize_rowwise of it): h read once, act(h) written once. Rows longer
    than the one-pass limit take the activation's torch twin, then quantize_rowwise. wrap: as in
    matmul.scaled_matmul."""
    if activation not in ACT_CODES or activation is None:
        raise ValueError(f"unsupported activation {activation!r}; expected one of {list(ACT_CODES)[1:]}")
    m, k = h.shape
    if k > _MAX_SINGLE_PASS:
        a = reference.apply_activation(h, activation)
        return (a, *_quantize_rowwise(a, qdtype, None, wrap))
    a = torch.empty((m, k), dtype=h.dtype, device=h.device)
    q = torch.empty((m, k), dtype=qdtype, device=h.device)
    if m == 0 or k == 0:
        return a, q, torch.zeros((m,), dtype=torch.float32, device=h.device)
    scale = torch.empty((m,), dtype=torch.float32, device=h.device)  # every row written by the kernel
    launch = _row_tiles_launch(m, k, _sm_count(h.device), activation=True)
    grid = launch.pop("grid")
    (wrap or launch_directly)(_act_and_rowwise_kernel)[grid](
        h,
        a,
        q,
        scale,
        m,
        k,
        h.stride(0),
        h.stride(1),
        q.stride(0),
        ACT=ACT_CODES[activation],
        **launch,
        **_scale_args(qdtype),
    )
    return a, q, scale


def colsum_in_one_pass(x: torch.Tensor) -> bool:
    """Whether quantize_rowwise_colsum(x) runs its one-pass kernel (else two passes, see there)."""
    return x.shape[0] > 0 and 0 < x.shape[1] <= _MAX_SINGLE_PASS


def _row_tiles_launch(m: int, k: int, sms: int, inputs: int = 1, activation: bool = False) -> dict:
    """Tile, rows per program, grid and warps of _quantize_row_tiles (the one-pass row-wise quantizes, with or
    without column sums) for an (m, k) input on `sms` SMs.

    - CHUNK: the smallest power of two (at least 16) that covers a row in at most _CS_MAX_CHUNKS pieces:
      exact for the usual widths (kernel comment), and as many independent loads per thread.
    - Warps: one up to 1,280 columns (40 values per thread: the row maximum is then a warp shuffle, with no
      trip through shared memory), else the fewest (a power of two, up to 16) with at most
      _CS_ROW_PER_THREAD values per thread: 2 at 2,048, 4 at 3,072, 8 at 5,120. Each thread holds about
      three times that (x, its prefetched successor and the column-sum accumulator).
    - inputs=2 (the activation backward, which holds g and h): the same warps as one input, at least 4;
      measured on an H200 (BENCHMARKS.md, Whole training step), 16 warps at 5,120 and 8 at 3,072 were
      1.1-1.3x slower.
    - BLOCK_M: one row per tile, more only for narrow rows (at least _CS_MIN_PER_THREAD values per thread).
    - Programs: _CS_WARPS_PER_SM warps per SM, one wave, each program walking an equal share of rows.
    - activation=True (the activation forward, one input): at most _ACT_MAX_WARPS warps and
      _ACT_WARPS_PER_SM warps' worth of programs per SM (see there).
    Measured on an H200 against tiles of several rows over 4 warps (BENCHMARKS.md, Whole training step):
    small programs of one row per warp were 1.1-1.8x faster from 4,928 to 50,432 rows at widths 512 to
    2,048, and as fast at 3,072 and 5,120 (the float32 partial sums they write, programs x k, stay far
    below the bytes of x and q).
    """
    chunk = 16
    while triton.cdiv(k, chunk) > _CS_MAX_CHUNKS:
        chunk *= 2
    chunks = triton.cdiv(k, chunk)
    row = chunk * chunks
    num_warps = 1
    if row * inputs > 32 * _CS_ONE_WARP_PER_THREAD:
        while num_warps < 16 and row > 32 * num_warps * _CS_ROW_PER_THREAD:
            num_warps *= 2
    if inputs > 1:  # two rows per thread (the activation backward's g and h): 4 warps at least
        num_warps = max(num_warps, _CS_TWO_INPUT_MIN_WARPS)
    if activation:
        num_warps = min(num_warps, _ACT_MAX_WARPS)
    block_m = 1
    while block_m < m and 2 * block_m * row * inputs <= 32 * num_warps * _CS_MIN_PER_THREAD:
        block_m *= 2
    programs = max(1, sms * (_ACT_WARPS_PER_SM if activation else _CS_WARPS_PER_SM) // num_warps)
    rows_per_program = block_m * triton.cdiv(triton.cdiv(m, block_m), programs)
    return dict(
        grid=(triton.cdiv(m, rows_per_program),),
        rows_per_program=rows_per_program,
        BLOCK_M=block_m,
        CHUNK=chunk,
        CHUNKS=chunks,
        num_warps=num_warps,
    )


def _sm_count(device: torch.device) -> int:
    # The interpreter runs on the CPU: any count gives the same results up to float32 summation order.
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def quantize_rowwise_colsum(
    x: torch.Tensor, qdtype: torch.dtype = torch.int8, *, wrap=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_rowwise(x) plus x.sum(dim=0) in float32, reading x once (the bias gradient of a layer).

    The column sum is accumulated in float32 per program then over programs, so it equals the twin's
    `x.sum(dim=0, dtype=torch.float32)` up to float32 summation order. Rows longer than the single-pass limit
    take the two separate passes. wrap: as in matmul.scaled_matmul (only for one-pass shapes).
    """
    m, k = x.shape
    if not colsum_in_one_pass(x):
        if wrap is not None:
            raise ValueError(f"quantize_rowwise_colsum: a traced launch needs a one-pass shape, got {(m, k)}")
        q, scale = quantize_rowwise(x, qdtype)
        return q, scale, x.sum(dim=0, dtype=torch.float32)
    q = torch.empty((m, k), dtype=qdtype, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    launch = _row_tiles_launch(m, k, _sm_count(x.device))
    grid = launch.pop("grid")
    part = torch.empty((grid[0], k), dtype=torch.float32, device=x.device)
    (wrap or launch_directly)(_rowwise_colsum_kernel)[grid](
        x,
        q,
        scale,
        part,
        m,
        k,
        x.stride(0),
        x.stride(1),
        q.stride(0),
        **launch,
        **_scale_args(qdtype),
    )
    return q, scale, part.sum(dim=0)


def act_backward_impl(k: int, impl: str = "auto") -> str:
    """The implementation ("rows" or "tiles") act_backward_quantize_colsum runs for rows of k values."""
    if impl not in ACT_BACKWARD_IMPLS:
        raise ValueError(f"act_backward_impl must be one of {ACT_BACKWARD_IMPLS}, got {impl!r}")
    if impl == "auto":
        return "rows" if k <= _ROWS_IMPL_MAX_K else "tiles"
    return impl


def _absmax_partials(x: torch.Tensor) -> torch.Tensor:
    """(M, K) -> (cdiv(M, TILE_M), K) float32 column absmax per row tile."""
    m, k = x.shape
    grid = (triton.cdiv(m, _TILE_M), triton.cdiv(k, _TILE_K))
    part = torch.empty((grid[0], k), dtype=torch.float32, device=x.device)
    _col_absmax_kernel[grid](x, part, m, k, x.stride(0), x.stride(1), BLOCK_M=_TILE_M, BLOCK_K=_TILE_K)
    return part


def _quantize_2d(x, absmax, per: str, transpose: bool, qdtype: torch.dtype, wrap=None):
    """Quantize x (M, K) with a known absmax per "row" (M,), per "column" (K,) or for the "tensor" ();
    transpose writes q as (K, M)."""
    m, k = x.shape
    q = torch.empty((k, m) if transpose else (m, k), dtype=qdtype, device=x.device)
    scale = torch.empty(
        {"row": (m,), "column": (k,), "tensor": ()}[per], dtype=torch.float32, device=x.device
    )
    q_strides = (q.stride(1), q.stride(0)) if transpose else (q.stride(0), q.stride(1))
    grid = (triton.cdiv(m, _TILE_M), triton.cdiv(k, _TILE_K))
    (wrap or launch_directly)(_quantize_2d_kernel)[grid](
        x,
        q,
        absmax,
        scale,
        m,
        k,
        x.stride(0),
        x.stride(1),
        *q_strides,
        PER_COLUMN=per == "column",
        PER_ROW=per == "row",
        BLOCK_M=_TILE_M,
        BLOCK_K=_TILE_K,
        **_qargs(qdtype),
    )
    return q, scale


def quantize_rowwise_known_absmax(x: torch.Tensor, absmax: torch.Tensor, qdtype: torch.dtype, wrap=None):
    """quantize_rowwise(x) given its exact row absmax (M,) float32: a fully parallel 2-D tiled pass."""
    return _quantize_2d(x, absmax, "row", transpose=False, qdtype=qdtype, wrap=wrap)


def _act_backward_tiles(grad, h, qdtype, activation, want_act, wrap=None):
    m, k = grad.shape
    gh = torch.empty((m, k), dtype=grad.dtype, device=grad.device)
    act = torch.empty((m, k) if want_act else (0,), dtype=h.dtype, device=h.device)
    absmax_bits = torch.zeros((m,), dtype=torch.int32, device=grad.device)
    grid = (triton.cdiv(m, _BWD_TILE_M), triton.cdiv(k, _BWD_TILE_K))
    part = torch.empty((grid[0], k), dtype=torch.float32, device=grad.device)
    (wrap or launch_directly)(_act_backward_tiles_kernel)[grid](
        grad,
        h,
        gh,
        act if want_act else gh,
        absmax_bits,
        part,
        m,
        k,
        grad.stride(0),
        grad.stride(1),
        h.stride(0),
        h.stride(1),
        ACT=ACT_CODES[activation],
        WRITE_A=want_act,
        BLOCK_M=_BWD_TILE_M,
        BLOCK_K=_BWD_TILE_K,
        num_warps=8,
    )
    q, scale = quantize_rowwise_known_absmax(gh, absmax_bits.view(torch.float32), qdtype, wrap)
    return gh, act, q, scale, part.sum(dim=0)


def act_backward_quantize_colsum(
    grad: torch.Tensor,
    h: torch.Tensor,
    qdtype: torch.dtype,
    activation: str,
    want_act: bool,
    *,
    impl: str = "auto",
    wrap=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of act at h with output gradient `grad`, fused with what fc1's backward needs of it.

    grad, h (M, K) float -> (grad_h (M, K) grad.dtype, act(h) (M, K) h.dtype or (0,) when not want_act,
    q (M, K) qdtype, scale (M,) float32, grad_h.sum(0) float32): q, scale = quantize_rowwise(grad_h).
    impl (KernelOptions.act_backward_impl) picks the kernels, see act_backward_impl. The "rows" kernel takes
    rows up to the single-pass limit (longer ones use the torch twin). wrap: as in matmul.scaled_matmul.
    """
    m, k = grad.shape
    if activation not in ACT_CODES or activation is None:
        raise ValueError(f"unsupported activation {activation!r}; expected one of {list(ACT_CODES)[1:]}")
    if m == 0 or k == 0:
        return reference.act_backward_quantize_colsum(grad, h, qdtype, activation, want_act)
    if act_backward_impl(k, impl) == "tiles":
        return _act_backward_tiles(grad, h, qdtype, activation, want_act, wrap)
    if k > _MAX_SINGLE_PASS:
        return reference.act_backward_quantize_colsum(grad, h, qdtype, activation, want_act)
    gh = torch.empty((m, k), dtype=grad.dtype, device=grad.device)
    act = torch.empty((m, k) if want_act else (0,), dtype=h.dtype, device=h.device)
    q = torch.empty((m, k), dtype=qdtype, device=grad.device)
    scale = torch.empty((m,), dtype=torch.float32, device=grad.device)
    launch = _row_tiles_launch(m, k, _sm_count(grad.device), inputs=2)
    grid = launch.pop("grid")
    part = torch.empty((grid[0], k), dtype=torch.float32, device=grad.device)
    (wrap or launch_directly)(_act_backward_rows_kernel)[grid](
        grad,
        h,
        gh,
        act if want_act else gh,  # any valid pointer of the right dtype when not written
        q,
        scale,
        part,
        m,
        k,
        grad.stride(0),
        grad.stride(1),
        h.stride(0),
        h.stride(1),
        q.stride(0),
        ACT=ACT_CODES[activation],
        WRITE_A=want_act,
        **launch,
        **_scale_args(qdtype),
    )
    return gh, act, q, scale, part.sum(dim=0)


def _tensorwise(x: torch.Tensor, qdtype: torch.dtype, transpose: bool):
    _check_qdtype(qdtype)
    m, k = x.shape
    if x.numel() == 0:
        shape = (k, m) if transpose else (m, k)
        return torch.zeros(shape, dtype=qdtype, device=x.device), torch.zeros((), device=x.device)
    absmax = _absmax_partials(x).amax()
    return _quantize_2d(x, absmax, "tensor", transpose=transpose, qdtype=qdtype)


def quantize_tensorwise(
    x: torch.Tensor, qdtype: torch.dtype = torch.int8
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) float -> (q (M, K) qdtype, scale () float32), one scale for the whole tensor."""
    return _tensorwise(x, qdtype, transpose=False)


def quantize_tensorwise_transposed(w: torch.Tensor, qdtype: torch.dtype = torch.int8):
    """(N, K) -> (q (K, N) contiguous = quantize_tensorwise(w).T, scale ()); transpose fused in the store."""
    return _tensorwise(w, qdtype, transpose=True)


def quantize_rowwise_transposed(w: torch.Tensor, qdtype: torch.dtype = torch.int8):
    """(N, K) -> (q (K, N) contiguous, scale (K,)) = quantize_rowwise(w.T): one scale per column of w."""
    _check_qdtype(qdtype)
    n, k = w.shape
    if w.numel() == 0:
        return torch.zeros((k, n), dtype=qdtype, device=w.device), torch.zeros((k,), device=w.device)
    absmax = _absmax_partials(w).amax(dim=0)
    return _quantize_2d(w, absmax, "column", transpose=True, qdtype=qdtype)


def dequantize_rowwise(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of quantize_rowwise: (M, K) q, (M,) float32 scale -> (M, K) dtype (same rounding as the twin)."""
    q = q.contiguous()
    m, k = q.shape
    out = torch.empty((m, k), dtype=dtype, device=q.device)
    if q.numel() == 0:
        return out
    grid = (triton.cdiv(m, 16), triton.cdiv(k, 256))
    _dequantize_rowwise_kernel[grid](q, scale.float().contiguous(), out, m, k, BLOCK_M=16, BLOCK_K=256)
    return out


__all__ = [
    "ACT_CODES",
    "QMAX",
    "act_backward_quantize_colsum",
    "act_quantize_rowwise",
    "dequantize_rowwise",
    "quantize_rowwise",
    "quantize_rowwise_colsum",
    "quantize_rowwise_transposed",
    "quantize_tensorwise",
    "quantize_tensorwise_transposed",
]
