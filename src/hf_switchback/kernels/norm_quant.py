"""Triton LayerNorm that also writes its output's row-wise 8-bit form: the GEMM input of the next linear
(q/k/v after LN1, fc1 after LN2) without a separate quantize pass over the 16-bit activations.

Numerics: those of the twin kernels/reference.layernorm_quantize_rowwise (read its docstring); the
statistics' float32 summation order differs, so y may differ from the twin by one rounding of x's dtype, and q
by one step where that moves a value across a rounding boundary. Each program holds ROWS whole rows in
registers (K up to _MAX_K). This module imports triton; import it only on the CUDA path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kernel_access import declare_access, when
from .quantize import _absmax, _qargs, _to_q, launch_directly

# Widest row one program holds in registers (CLIP / SigLIP widths are at most 1664).
_MAX_K = 16384
_TL_FLOAT = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@declare_access(
    reads=("x_ptr", when("ADD", "d_ptr"), when("HAS_W", "w_ptr"), when("HAS_B", "b_ptr")),
    writes=(when("ADD", "h_ptr"), "y_ptr", "q_ptr", "s_ptr", "mean_ptr", "rstd_ptr"),
)
@triton.jit
def _layernorm_quantize_kernel(
    x_ptr,
    d_ptr,
    h_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    q_ptr,
    s_ptr,
    mean_ptr,
    rstd_ptr,
    M,
    K,
    stride_xm,
    stride_xk,
    stride_dm,
    stride_dk,
    eps,
    ADD: tl.constexpr,
    H_DTYPE: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    Y_DTYPE: tl.constexpr,
    QMAX_C: tl.constexpr,
    IS_INT: tl.constexpr,
    Q_DTYPE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    mask = row_ok[:, None] & (offs < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + offs[None, :] * stride_xk, mask=mask, other=0.0)
    x = x.to(tl.float32)
    out = rows[:, None] * K + offs[None, :]
    if ADD:  # the residual add before the LayerNorm: h = x + d, rounded to h's dtype, written, normalized
        d = tl.load(d_ptr + rows[:, None] * stride_dm + offs[None, :] * stride_dk, mask=mask, other=0.0)
        h = (x + d.to(tl.float32)).to(H_DTYPE)
        tl.store(h_ptr + out, h, mask=mask)
        x = h.to(tl.float32)
    mean = tl.sum(x, axis=1) / K
    diff = tl.where(mask, x - mean[:, None], 0.0)
    # (.to: Inductor's launch passes the Python float eps as float64)
    rstd = 1.0 / tl.sqrt_rn((tl.sum(diff * diff, axis=1) / K + eps).to(tl.float32))
    y = diff * rstd[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(b_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)[None, :]
    # Quantize the y an unfused LayerNorm would have written: rounded once to the output dtype.
    y_out = y.to(Y_DTYPE)
    y = tl.where(mask, y_out.to(tl.float32), 0.0)
    tl.store(y_ptr + out, y_out, mask=mask)
    scale = tl.div_rn(_absmax(y, 1), QMAX_C)
    safe = tl.where(scale == 0.0, 1.0, scale)
    inv = tl.div_rn(1.0, safe)
    tl.store(s_ptr + rows, scale, mask=row_ok)
    tl.store(mean_ptr + rows, mean, mask=row_ok)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)
    tl.store(q_ptr + out, _to_q(y, safe[:, None], inv[:, None], QMAX_C, IS_INT, Q_DTYPE), mask=mask)


# block_k -> (rows per program, warps). At 2,048 (width 1,280) two rows per program over 2 warps, the fastest of a
# sweep over 1-8 rows and 1-16 warps on the H200 (BENCHMARKS.md, Whole training step): the next row's loads are in
# flight while one row reduces. At 1,024 (widths 768 and 1,024) one row over one warp: as fast as two rows (1.00x of
# the two rows' time at 50,432 x 768, 0.98-0.995x at 1,024 wide) and 40% less to compile (0.36-0.48 s
# against 0.63-0.72 s for the residual add's specialization), since compile time follows the values each thread
# holds (`benchmarks/launch_shapes.py`; BENCHMARKS.md, compile warm-up). Other widths: one row per program, a
# warp per 256 values.
_LAUNCH: dict[int, tuple[int, int]] = {1024: (1, 1), 2048: (2, 2)}


def _launch_shape(block_k: int) -> tuple[int, int]:
    """(rows per program, warps) for rows of block_k (a power of two) values."""
    return _LAUNCH.get(block_k, (1, max(1, min(16, block_k // 256))))


def _check(name: str, x: torch.Tensor, weight, bias, out_dtype: torch.dtype) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name}: x must be 2-D (M, K), got shape {tuple(x.shape)}")
    if x.dtype not in _TL_FLOAT or out_dtype not in _TL_FLOAT:
        raise TypeError(
            f"{name}: x and out_dtype must be float32, bfloat16 or float16, got {x.dtype} and {out_dtype}"
        )
    k = x.shape[1]
    if k > _MAX_K:
        raise ValueError(
            f"{name}: rows of {k} values exceed the kernel's {_MAX_K}; use the twin in kernels/reference.py"
        )
    for label, p in (("weight", weight), ("bias", bias)):
        if p is not None and p.shape != (k,):
            raise ValueError(f"{name}: {label} must have shape ({k},), got {tuple(p.shape)}")


def _launch(x, delta, weight, bias, eps, qdtype, out_dtype, wrap) -> tuple:
    """(h or None, q, scale, y, mean, rstd); h = x + delta when delta is given, and the LayerNorm is of h."""
    m, k = x.shape
    device = x.device
    h = (
        None
        if delta is None
        else torch.empty((m, k), dtype=torch.promote_types(x.dtype, delta.dtype), device=device)
    )
    q = torch.empty((m, k), dtype=qdtype, device=device)
    y = torch.empty((m, k), dtype=out_dtype, device=device)
    if m == 0 or k == 0:  # statistics of empty rows are 0, as the twin's
        scale, mean, rstd = (torch.zeros((m,), dtype=torch.float32, device=device) for _ in range(3))
        return h, q, scale, y, mean, rstd
    # The kernel writes every row's statistics: no fill kernels before it (eager: launches fewer a call).
    scale, mean, rstd = (torch.empty((m,), dtype=torch.float32, device=device) for _ in range(3))
    block = triton.next_power_of_2(k)
    rows, warps = _launch_shape(block)
    (wrap or launch_directly)(_layernorm_quantize_kernel)[(triton.cdiv(m, rows),)](
        x,
        x if delta is None else delta,  # unused pointers when there is no add
        q if h is None else h,
        weight.contiguous() if weight is not None else x,  # an unused pointer when absent
        bias.contiguous() if bias is not None else x,
        y,
        q,
        scale,
        mean,
        rstd,
        m,
        k,
        x.stride(0),
        x.stride(1),
        0 if delta is None else delta.stride(0),
        0 if delta is None else delta.stride(1),
        float(eps),
        ADD=delta is not None,
        H_DTYPE=_TL_FLOAT[x.dtype if h is None else h.dtype],
        HAS_W=weight is not None,
        HAS_B=bias is not None,
        Y_DTYPE=_TL_FLOAT[out_dtype],
        ROWS=rows,
        BLOCK_K=block,
        num_warps=warps,
        **_qargs(qdtype),
    )
    return h, q, scale, y, mean, rstd


def layernorm_quantize_rowwise(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    qdtype: torch.dtype,
    out_dtype: torch.dtype,
    *,
    wrap=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same arguments and outputs as the twin in kernels/reference.py; x on a CUDA device.
    wrap: as in matmul.scaled_matmul."""
    _check("layernorm_quantize_rowwise", x, weight, bias, out_dtype)
    return _launch(x, None, weight, bias, eps, qdtype, out_dtype, wrap)[1:]


def add_layernorm_quantize_rowwise(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    qdtype: torch.dtype,
    out_dtype: torch.dtype,
    *,
    wrap=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same arguments and outputs as the twin in kernels/reference.py; x and delta on a CUDA device.
    wrap: as in matmul.scaled_matmul."""
    _check("add_layernorm_quantize_rowwise", x, weight, bias, out_dtype)
    if delta.shape != x.shape or delta.dtype not in _TL_FLOAT:
        raise ValueError(
            f"add_layernorm_quantize_rowwise: delta must be a float tensor of x's shape {tuple(x.shape)}, got "
            f"{tuple(delta.shape)} {delta.dtype}"
        )
    return _launch(x, delta, weight, bias, eps, qdtype, out_dtype, wrap)


__all__ = ["add_layernorm_quantize_rowwise", "layernorm_quantize_rowwise"]
