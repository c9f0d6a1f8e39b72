"""Triton kernels (kernels/ops.py) against their torch twins (kernels/reference.py).

GPU tests skip cleanly without CUDA + triton. Quantization must be bitwise equal to the reference run on the
CPU; int8 accumulation must be exact; layer outputs and gradients must match the torch-backend layer.
`test_interpreter_int8_kernels` runs the int8 kernels under TRITON_INTERPRET=1 on the CPU (in a subprocess, so
the interpreter flag cannot leak into this process), which lets CI check masks, strides and tails without a GPU.
The interpreter cannot emulate fp8 casts or fp8 dots, so fp8 is GPU-only.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import CAN_INTERPRET_KERNELS, HAS_TRITON, INTERPRETER_SKIP_REASON, snr_db

from hf_switchback import KernelOptions
from hf_switchback.kernels import reference as ref

QDTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
FLOATS = [torch.bfloat16, torch.float16, torch.float32]
# (rows, cols): M=1, odd sizes, tails that are not multiples of 16, a zero-size tensor, a two-pass row.
SHAPES = [(1, 1), (1, 768), (5, 77), (33, 130), (300, 1280), (7, 10000), (0, 64), (64, 0)]


def _ops():
    from hf_switchback.kernels import ops

    return ops


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.cpu().view(torch.int8) if q.dtype != torch.int8 else q.cpu()


def _input(shape, dtype, zero_rows=True):
    x = torch.randn(shape, dtype=torch.float32) * 3
    if zero_rows and shape[0] > 2:
        x[1] = 0  # an all-zero row: scale 0, q 0, never NaN
    if shape[0] > 3 and shape[1] > 0:
        x[3, 0] = 1e4  # an outlier row
    return x.to(dtype).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "name",
    [
        "quantize_rowwise",
        "quantize_tensorwise",
        "quantize_rowwise_transposed",
        "quantize_tensorwise_transposed",
    ],
)
def test_quantize_bitwise(name, shape, dtype, qdtype):
    x = _input(shape, dtype)
    q, s = getattr(_ops(), name)(x, qdtype)
    q_ref, s_ref = getattr(ref, name)(x.cpu(), qdtype)
    assert q.dtype == qdtype and q.shape == q_ref.shape and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == s_ref.shape
    assert torch.equal(s.cpu(), s_ref), (s.cpu() - s_ref).abs().max()
    assert torch.equal(_bits(q), _bits(q_ref))


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", QDTYPES)
def test_quantize_rowwise_bitwise_many_magnitudes(qdtype):
    """4096 rows spanning 1e-30..1e30: the fast correctly-rounded division must match IEEE x / scale."""
    x = torch.randn(4096, 1280) * torch.logspace(-30, 30, 4096)[:, None]
    for name in ("quantize_rowwise", "quantize_rowwise_transposed"):
        q, s = getattr(_ops(), name)(x.cuda(), qdtype)
        q_ref, s_ref = getattr(ref, name)(x, qdtype)
        assert torch.equal(s.cpu(), s_ref), name
        assert torch.equal(_bits(q), _bits(q_ref)), (name, (_bits(q) != _bits(q_ref)).sum())


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_quantize_fp8_grid_midpoints_and_negative_zero(qdtype):
    """Values next to every midpoint of the fp8 grid (normal and subnormal), and -0.0, as torch's cast rounds
    them: a row whose absmax is the format's max has scale 1, so x / scale is x itself."""
    qmax = ref.QMAX[qdtype]
    grid = torch.arange(256, dtype=torch.uint8).view(qdtype).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    row = torch.cat(
        [torch.tensor([qmax, -0.0]), mids, torch.nextafter(mids, mids - 1), torch.nextafter(mids, grid[1:])]
    )
    x = row[None, :].repeat(3, 1)
    for name in ("quantize_rowwise", "quantize_rowwise_colsum"):
        q, s = getattr(_ops(), name)(x.cuda(), qdtype)[:2]
        q_ref, s_ref = ref.quantize_rowwise(x, qdtype)
        assert torch.equal(s.cpu(), torch.ones(3)) and torch.equal(s_ref, torch.ones(3))
        assert torch.equal(_bits(q), _bits(q_ref)), (name, (_bits(q) != _bits(q_ref)).sum())


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", QDTYPES)
def test_quantize_non_contiguous_and_3d_strides(qdtype):
    base = _input((96, 130), torch.bfloat16)
    x = base.t()  # (130, 96), stride (1, 130)
    for name in ("quantize_rowwise", "quantize_tensorwise", "quantize_rowwise_transposed"):
        q, s = getattr(_ops(), name)(x, qdtype)
        q_ref, s_ref = getattr(ref, name)(x.cpu(), qdtype)
        assert torch.equal(s.cpu(), s_ref) and torch.equal(_bits(q), _bits(q_ref)), name


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [*SHAPES, (65, 5120), (3000, 1280), (3001, 768), (1001, 3072), (999, 100)])
def test_quantize_rowwise_colsum(shape, dtype, qdtype):
    """Fused grad quantize + bias-gradient column sum: q and scale bitwise, sum up to float32 order."""
    x = _input(shape, dtype)
    ops = _ops()
    q, s, colsum = ops.quantize_rowwise_colsum(x, qdtype)
    q_ref, s_ref, sum_ref = ref.quantize_rowwise_colsum(x.cpu(), qdtype)
    assert q.dtype == qdtype and q.shape == q_ref.shape and s.shape == s_ref.shape
    assert torch.equal(s.cpu(), s_ref) and torch.equal(_bits(q), _bits(q_ref))
    assert colsum.dtype == torch.float32 and colsum.shape == sum_ref.shape
    # float32 sums of the same values in another order: |error| <= M * 2**-24 * sum|x| (+ a denormal floor).
    bound = max(shape[0], 1) * 2**-24 * x.cpu().float().abs().sum(0) + 1e-30
    assert ((colsum.cpu() - sum_ref).abs() <= bound).all()
    x_t = _input((shape[1], shape[0]), dtype).t()  # non-contiguous rows
    q, s, colsum = ops.quantize_rowwise_colsum(x_t, qdtype)
    q_ref, s_ref, sum_ref = ref.quantize_rowwise_colsum(x_t.cpu(), qdtype)
    assert torch.equal(s.cpu(), s_ref) and torch.equal(_bits(q), _bits(q_ref))
    bound = max(shape[1], 1) * 2**-24 * x_t.cpu().float().abs().sum(0) + 1e-30
    assert ((colsum.cpu() - sum_ref).abs() <= bound).all()


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("k", [100, 768, 1280, 3072, 5120, 8192])
def test_quantize_rowwise_colsum_many_tiles_per_program(monkeypatch, k, qdtype):
    """Few programs (as on a 3-SM GPU): each walks many row tiles, the last program's share cut by M, and
    a zero row sits inside a tile. q and scale bitwise, the column sum to float32 summation order."""
    from hf_switchback.kernels import quantize

    monkeypatch.setattr(quantize, "_sm_count", lambda device: 3)
    m = 2003
    launch = quantize._row_tiles_launch(m, k, 3)
    assert launch["rows_per_program"] >= 4 * launch["BLOCK_M"] and m % launch["rows_per_program"] != 0
    x = _input((m, k), torch.bfloat16)
    x[m - 2] = 0
    q, s, colsum = _ops().quantize_rowwise_colsum(x, qdtype)
    q_ref, s_ref, sum_ref = ref.quantize_rowwise_colsum(x.cpu(), qdtype)
    assert torch.equal(s.cpu(), s_ref) and torch.equal(_bits(q), _bits(q_ref))
    bound = m * 2**-24 * x.cpu().float().abs().sum(0) + 1e-30
    assert ((colsum.cpu() - sum_ref).abs() <= bound).all()


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("m", [1, 37, 16448, 50432])
@pytest.mark.parametrize("k", [1, 70, 100, 768, 1024, 1152, 1280, 3072, 4096, 5120, 8192])
def test_row_tiles_launch_tiles_cover_rows_in_one_wave(m, k):
    """The quantize + column-sum launch: pieces cover a row (exactly at the ViT widths), programs cover M
    with whole tiles, and the grid fits one wave of the warps per SM it aims at."""
    from hf_switchback.kernels import quantize

    sms = 132
    launch = quantize._row_tiles_launch(m, k, sms)
    block_m, chunk, chunks = launch["BLOCK_M"], launch["CHUNK"], launch["CHUNKS"]
    rows, (grid,), warps = launch["rows_per_program"], launch["grid"], launch["num_warps"]
    for size in (block_m, chunk, warps):
        assert size & (size - 1) == 0
    assert (chunks - 1) * chunk < k <= chunks * chunk and chunks <= quantize._CS_MAX_CHUNKS
    # never more lanes than one power-of-two block, and none masked off at the usual widths
    assert chunks * chunk <= max(16, 1 << (k - 1).bit_length())
    assert chunks * chunk == k or k not in (768, 1024, 1280, 3072, 4096, 5120, 8192)
    assert rows % block_m == 0 and (grid - 1) * rows < m <= grid * rows
    assert grid * warps <= sms * quantize._CS_WARPS_PER_SM
    per_thread = block_m * chunk * chunks / (32 * warps)  # values of a tile per thread
    assert (
        per_thread <= (quantize._CS_ONE_WARP_PER_THREAD if warps == 1 else quantize._CS_ROW_PER_THREAD)
        or warps == 16
    )
    assert block_m == 1 or per_thread <= quantize._CS_MIN_PER_THREAD or block_m >= m


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_row_tiles_launch_of_the_activation_backward():
    """Two inputs per row (g and h): one input's warps, at least 4 (within 6% of the best warps measured on an
    H200 at each CLIP width), tiles and grid as for one input."""
    from hf_switchback.kernels import quantize

    for k, warps in ((1280, 4), (3072, 4), (4096, 4), (5120, 8), (768, 4)):
        one, two = (
            quantize._row_tiles_launch(49344, k, 132),
            quantize._row_tiles_launch(49344, k, 132, inputs=2),
        )
        assert two["num_warps"] == max(one["num_warps"], 4) == warps, k
        assert (two["CHUNK"], two["CHUNKS"]) == (one["CHUNK"], one["CHUNKS"])
        assert two["grid"][0] * two["num_warps"] <= 132 * quantize._CS_WARPS_PER_SM


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_row_tiles_launch_of_the_activation_forward():
    """The activation forward (act + quantize): at most 4 warps, four times the plain launch's warps in flight
    per SM (more rows to hide the activation's arithmetic), the same row pieces; tiles still cover M."""
    from hf_switchback.kernels import quantize

    for m in (37, 14784, 49344):
        for k, warps in ((768, 1), (1280, 1), (3072, 4), (4096, 4), (5120, 4)):
            plain = quantize._row_tiles_launch(m, k, 132)
            act = quantize._row_tiles_launch(m, k, 132, activation=True)
            assert act["num_warps"] == min(plain["num_warps"], 4) == warps, (m, k)
            assert (act["CHUNK"], act["CHUNKS"]) == (plain["CHUNK"], plain["CHUNKS"])
            (grid,), rows = act["grid"], act["rows_per_program"]
            assert rows % act["BLOCK_M"] == 0 and (grid - 1) * rows < m <= grid * rows
            assert grid * warps <= 132 * quantize._ACT_WARPS_PER_SM
            if m == 49344:  # enough rows: about 64 warps' worth of programs per SM, 16 before
                assert grid * warps > 132 * quantize._CS_WARPS_PER_SM * 2


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_dequantize_rowwise_bitwise(dtype, qdtype):
    x = _input((37, 300), torch.float32)
    q, s = ref.quantize_rowwise(x.cpu(), qdtype)
    out = _ops().dequantize_rowwise(q.cuda(), s.cuda(), dtype)
    assert out.dtype == dtype
    assert torch.equal(out.cpu(), ref.dequantize_rowwise(q, s, dtype))


def _adjacent(q: torch.Tensor, q_ref: torch.Tensor) -> bool:
    """Equal, or neighbouring codes (one rounding flip): consecutive int8 values, or fp8 bit patterns that
    differ by one (same sign)."""
    q, q_ref = q.cpu(), q_ref.cpu()
    close = (_bits(q).int() - _bits(q_ref).int()).abs() <= 1
    return bool((close | (q.float() == q_ref.float())).all())


def _assert_quantizes_own_grad_h(q: torch.Tensor, q_own: torch.Tensor, qdtype: torch.dtype) -> None:
    """q (the kernel's 8-bit grad_h) vs q_own = the reference quantize of the kernel's own grad_h output."""
    if qdtype == torch.int8:
        assert torch.equal(q.cpu(), q_own)
        return
    # The kernel quantizes grad_h in float32, before its rounding to the grad_h output dtype; e4m3's finer steps
    # near its top resolve that double rounding (measured on H100: rare one-code flips).
    assert _adjacent(q, q_own)
    assert (_bits(q) != _bits(q_own)).sum() <= 0.01 * q.numel()  # a count, not a mean: M = 0 has no mean


# Tolerance (relative to |h| or |g|) of an activation value or gradient: the kernels' float32 formulas differ
# from torch's (erf/exp implementations; tanh written through the sigmoid, which does not saturate to exactly
# 0 / 1 where torch's tanh does: up to ~6e-6 x |g| measured in float32), then one rounding to the dtype that
# can flip.
ROUND_TOL = {torch.float32: 1.5e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}
ACTIVATIONS = ["gelu", "gelu_tanh", "quick_gelu"]


# (input dtype, quantized dtype): every input dtype with int8, fp8 from bfloat16 (the training dtype).
ACT_DTYPES = [(d, torch.int8) for d in FLOATS] + [(torch.bfloat16, q) for q in QDTYPES[1:]]


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype,qdtype", ACT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (5, 77), (65, 5120), (7, 10000), (0, 64)])
def test_act_quantize_rowwise(shape, dtype, qdtype, activation):
    """Fused activation + row quantize (fc2's input): vs quantize_rowwise(act(h)) run on the CPU."""
    h = _input(shape, dtype)
    q, s = _ops().act_quantize_rowwise(h, qdtype, activation)
    q_ref, s_ref = ref.act_quantize_rowwise(h.cpu(), qdtype, activation)
    assert q.dtype == qdtype and q.shape == q_ref.shape and s.shape == s_ref.shape
    tol = ROUND_TOL[dtype]
    assert ((s.cpu() - s_ref).abs() <= tol * s_ref).all(), (s.cpu() - s_ref).abs().max()
    # fp8 keeps relative precision down to tiny values, where act(h) = h * Phi(h) is a difference of nearly
    # equal numbers (1 + erf, 1 + tanh) and the kernel's and torch's formulas differ by more than a rounding
    # (measured on H100: >1% one-code flips in that tail, and codes of opposite sign or several codes apart
    # at 1e-7 of the absmax with e5m2). So below 2**-6 of the row's absmax, fp8 codes need only stay below
    # 2**-5 of it; at and above, codes are equal or adjacent and flips are rare (at most 1% of the elements).
    tail = 0 if qdtype == torch.int8 else ref.QMAX[qdtype] * 2**-6
    counted = q_ref.float().abs() >= tail
    assert _adjacent(q.cpu()[counted], q_ref[counted])
    assert (q.cpu().float()[~counted].abs() <= 2 * tail).all()
    flips = (_bits(q) != _bits(q_ref)) & counted
    assert flips.sum() <= 0.01 * max(int(counted.sum()), 1)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype,qdtype", ACT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (5, 77), (65, 5120), (7, 10000), (0, 64)])
def test_act_and_quantize_rowwise(shape, dtype, qdtype, activation):
    """The activation writing fc2's input in 16 and 8 bits: act(h) within a rounding of torch's (formulas as in
    test_act_quantize_rowwise), and its 8-bit form exactly quantize_rowwise of the act(h) it wrote."""
    h = _input(shape, dtype)
    a, q, s = _ops().act_and_quantize_rowwise(h, qdtype, activation)
    a_ref = ref.apply_activation(h.cpu(), activation)
    assert a.dtype == dtype and a.shape == h.shape and q.dtype == qdtype
    tol = ROUND_TOL[dtype]
    near_zero = 2**-6 * a_ref.float().abs().amax() if a_ref.numel() else 0.0  # the formulas' tail, as there
    assert ((a.cpu().float() - a_ref.float()).abs() <= tol * (a_ref.float().abs() + near_zero)).all()
    q_own, s_own = ref.quantize_rowwise(a.cpu(), qdtype)
    assert torch.equal(_bits(q.cpu()), _bits(q_own)) and torch.equal(s.cpu(), s_own)


# Both implementations ("auto" picks one per width) in every dtype pair.
_ACT_BACKWARD_CASES = [(impl, d, q) for impl in ("tiles", "rows") for d, q in ACT_DTYPES[:4]]


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("impl,dtype,qdtype", _ACT_BACKWARD_CASES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (5, 77), (2100, 2560), (0, 64)])
@pytest.mark.parametrize("want_act", [True, False])
def test_act_backward_quantize_colsum(shape, dtype, qdtype, activation, want_act, impl):
    """Fused activation backward + grad quantize + column sum: grad_h and act(h) within one rounding of the
    torch twin; q / scale bitwise equal to quantizing the kernel's own grad_h; the sum up to float32 order.
    Both GPU implementations (KernelOptions.act_backward_impl)."""
    h, g = _input(shape, dtype), _input(shape, dtype, zero_rows=False)
    options = KernelOptions(act_backward_impl=impl)
    gh, act, q, s, colsum = _ops().act_backward_quantize_colsum(
        g, h, qdtype, activation, want_act, options=options
    )
    gh_ref, act_ref, *_ = ref.act_backward_quantize_colsum(g.cpu(), h.cpu(), qdtype, activation, want_act)
    assert gh.dtype == dtype and gh.shape == gh_ref.shape and act.shape == act_ref.shape
    tol = ROUND_TOL[dtype]
    scale_g = g.cpu().float().abs() * 1.2  # |act'| <= 1.13 (gelu), 1.1 (quick_gelu)
    assert ((gh.cpu().float() - gh_ref.float()).abs() <= tol * scale_g + 1e-30).all()
    if want_act:
        assert act.dtype == dtype
        assert ((act.cpu().float() - act_ref.float()).abs() <= tol * h.cpu().float().abs() + 1e-30).all()
    q_own, s_own, sum_own = ref.quantize_rowwise_colsum(gh.cpu(), qdtype)
    assert torch.equal(s.cpu(), s_own)
    _assert_quantizes_own_grad_h(q, q_own, qdtype)
    bound = max(shape[0], 1) * 2**-24 * gh.cpu().float().abs().sum(0) + 1e-30
    assert ((colsum.cpu() - sum_own).abs() <= bound).all()


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_act_backward_impl_picks_rows_up_to_the_one_pass_limit():
    """ "auto" resolves per width (measured, BENCHMARKS.md, Whole training step); a bad setting is refused."""
    from hf_switchback.kernels import quantize

    assert KernelOptions().act_backward_impl == "auto"
    picked = [quantize.act_backward_impl(k) for k in (37, 3072, 4096, 5120, 8192, 8193)]
    assert picked == ["rows"] * 5 + ["tiles"]
    assert quantize.act_backward_impl(3072, "tiles") == "tiles"
    assert quantize.act_backward_impl(5120, "rows") == "rows"
    with pytest.raises(ValueError, match=r"act_backward_impl must be one of .*got 'row'"):
        quantize.act_backward_impl(3072, "row")


def _assert_one_graph_and_compiled_matches_eager(block: torch.nn.Module, x: torch.Tensor) -> None:
    """torch.compile of `block` traces as one graph without breaks; its output and every gradient (parameters
    and input) match eager within 35 dB (output) / 30 dB (gradients)."""
    torch._dynamo.reset()
    explain = torch._dynamo.explain(block)(x)
    assert explain.graph_break_count == 0, [str(r.reason) for r in explain.break_reasons]
    assert explain.graph_count == 1
    compiled = torch.compile(block, fullgraph=True)
    xe, xc = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    eager_out = block(xe)
    eager_out.float().pow(2).sum().backward()
    eager_grads = [p.grad.clone() for p in block.parameters()] + [xe.grad]
    block.zero_grad(set_to_none=True)
    out = compiled(xc)
    out.float().pow(2).sum().backward()
    grads = [p.grad for p in block.parameters()] + [xc.grad]
    assert snr_db(eager_out, out) > 35
    for g, e in zip(grads, eager_grads, strict=True):
        assert snr_db(e, g) > 30


def _random_q(shape, qdtype):
    if qdtype == torch.int8:
        return torch.randint(-127, 128, shape, dtype=torch.int8)
    return (torch.randn(shape) * 4).to(qdtype)


# (M, N, K): M=1, odd tails, K not a multiple of BLOCK_K, and one shape on the autotuned path (M >= 1024).
MM_SHAPES = [(1, 64, 64), (17, 33, 45), (130, 257, 300), (1024, 256, 1280)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", MM_SHAPES)
def test_int8_matmul_accumulation_exact(shape):
    m, n, k = shape
    a, b = _random_q((m, k), torch.int8), _random_q((n, k), torch.int8)
    ones_m, ones_n = torch.ones(m), torch.ones(n)
    out = _ops().scaled_matmul(a.cuda(), b.cuda(), ones_m.cuda(), ones_n.cuda(), None, torch.float32)
    # Unit scales: out is float32(int32 accumulator) on both sides, so any accumulation error shows.
    expect = ref.scaled_matmul(a, b, ones_m, ones_n, None, torch.float32)
    assert torch.equal(out.cpu(), expect)


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("out_dtype", FLOATS)
@pytest.mark.parametrize("shape", MM_SHAPES)
@pytest.mark.parametrize("per_row", [True, False])
def test_scaled_matmul_matches_reference(shape, out_dtype, qdtype, per_row):
    m, n, k = shape
    a, b = _random_q((m, k), qdtype), _random_q((n, k), qdtype)
    a_scale = torch.rand(m) * 0.01
    b_scale = torch.rand(n) * 0.01 if per_row else torch.tensor(0.003)
    bias = torch.randn(n, dtype=out_dtype)
    out = _ops().scaled_matmul(a.cuda(), b.cuda(), a_scale.cuda(), b_scale.cuda(), bias.cuda(), out_dtype)
    expect = ref.scaled_matmul(a, b, a_scale, b_scale, bias, out_dtype)
    assert out.dtype == out_dtype and out.shape == (m, n)
    # int8: exact accumulator; the epilogue may differ by one fp32 rounding (FMA), then one output rounding.
    # fp8: float32 accumulation in another order, |error| <= K * 2**-24 * (|a| @ |b|.T) * scales, and Hopper's
    # fp8 tensor cores keep fewer accumulator bits than fp32 (about 14, per the DeepSeek-V3 report) within
    # each BLOCK_K tile before the kernel promotes to fp32: 2**-13.
    ulp = {torch.float32: 2**-23, torch.bfloat16: 2**-8, torch.float16: 2**-11}[out_dtype]
    magnitude = (a.float().abs() @ b.float().abs().t()) * a_scale[:, None] * b_scale
    accumulation = 0.0 if qdtype == torch.int8 else max(k * 2**-24, 2**-13)
    bound = (accumulation + 2**-22) * magnitude + 2 * ulp * expect.float().abs() + 1e-30
    err = (out.cpu().float() - expect.float()).abs()
    assert (err <= bound).all(), ((err / bound).max(), (err / magnitude.clamp_min(1e-30)).max())


# Autotuned shapes (M >= 1024) with tails on every axis: N not a multiple of any BLOCK_N, K not a multiple of
# BLOCK_K (but of 16, as TMA needs), M not a multiple of BLOCK_M.
TMA_SHAPES = [(2000, 520, 1296), (1100, 264, 400)]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kernel,config", [("tma", 0), ("tma", 2), ("portable", 0), ("portable", 6)], ids=lambda v: str(v)
)
@pytest.mark.parametrize(
    "qdtype,out_dtype",
    [
        (torch.int8, torch.bfloat16),
        (torch.int8, torch.float32),
        (torch.float8_e4m3fn, torch.bfloat16),
        (torch.float8_e5m2, torch.float16),
    ],
    ids=str,
)
@pytest.mark.parametrize("shape", TMA_SHAPES)
@pytest.mark.parametrize("per_row", [True, False])
def test_scaled_matmul_tma_and_portable_kernels(
    shape, per_row, out_dtype, qdtype, kernel, config, monkeypatch
):
    """The persistent TMA kernel (sm90) and the portable kernel against the reference, one tile config at a
    time (autotuning every config for every case would take minutes; the configs chosen cover both epilogue
    layouts of the TMA kernel, BLOCK_K 128 and 64)."""
    from hf_switchback.kernels import matmul

    use_tma = kernel == "tma"
    options = KernelOptions(use_tma=use_tma)
    # config indexes the full list; the launcher may use another autotuner (Hopper's measured subset)
    source = matmul._tma_autotuned_kernel if use_tma else matmul._autotuned_kernel
    tuner = matmul._tma_autotuned_kernel if use_tma else matmul.portable_tuner(0)
    monkeypatch.setattr(tuner, "configs", [source.configs[config]])
    monkeypatch.setattr(tuner, "cache", {})
    m, n, k = shape
    a, b = _random_q((m, k), qdtype), _random_q((n, k), qdtype)
    a_scale = torch.rand(m) * 0.01
    b_scale = torch.rand(n) * 0.01 if per_row else torch.tensor(0.003)
    bias = torch.randn(n, dtype=out_dtype)
    a_c, b_c = a.cuda(), b.cuda()
    out = _ops().scaled_matmul(
        a_c, b_c, a_scale.cuda(), b_scale.cuda(), bias.cuda(), out_dtype, options=options
    )
    if use_tma and torch.cuda.get_device_capability()[0] == 9:
        assert matmul._tma_applies(a_c, b_c, out)  # the test covers the kernel it names
    expect = ref.scaled_matmul(a, b, a_scale, b_scale, bias, out_dtype)
    ulp = {torch.float32: 2**-23, torch.bfloat16: 2**-8, torch.float16: 2**-11}[out_dtype]
    magnitude = (a.float().abs() @ b.float().abs().t()) * a_scale[:, None] * b_scale
    accumulation = 0.0 if qdtype == torch.int8 else max(k * 2**-24, 2**-13)
    bound = (accumulation + 2**-22) * magnitude + 2 * ulp * expect.float().abs() + 1e-30
    err = (out.cpu().float() - expect.float()).abs()
    assert (err <= bound).all(), ((err / bound).max(), (err / magnitude.clamp_min(1e-30)).max())
    if qdtype == torch.int8:
        ones_m, ones_n = torch.ones(m), torch.ones(n)
        exact = _ops().scaled_matmul(
            a_c, b_c, ones_m.cuda(), ones_n.cuda(), None, torch.float32, options=options
        )
        assert torch.equal(exact.cpu(), ref.scaled_matmul(a, b, ones_m, ones_n, None, torch.float32))


@pytest.mark.gpu
def test_a_measured_shape_launches_its_table_config_without_autotuning(monkeypatch):
    """On sm90 a GEMM whose (N, K, M bucket) is in kernels/gemm_configs/sm90.json runs that config directly:
    the autotuner is never asked, eager or compiled, and the result is the reference's."""
    from hf_switchback.kernels import matmul

    if torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip("the shipped table is for sm90 (H100/H200)")
    m, n, k = 4928, 1024, 1024  # ViT-B/16 text tower at batch 64, q/k/v/out_proj; bucket 8192
    tile = matmul._tile_for(0, torch.int8, torch.bfloat16, m, n, k)
    assert tile is not None and tile in matmul._TILE_SHAPES

    def no_autotuning(*args, **kwargs):
        raise AssertionError("the autotuner ran for a shape the table names")

    monkeypatch.setattr(matmul.portable_tuner(0), "run", no_autotuning)
    a, b = _random_q((m, k), torch.int8), _random_q((n, k), torch.int8)
    a_scale, b_scale, bias = torch.rand(m) * 0.01, torch.tensor(0.003), torch.randn(n, dtype=torch.bfloat16)
    args = (a.cuda(), b.cuda(), a_scale.cuda(), b_scale.cuda(), bias.cuda())
    out = matmul.scaled_matmul(*args, torch.bfloat16)
    # int32 accumulation is exact: the only rounding is the epilogue's, then the bf16 cast
    expect = ref.scaled_matmul(a, b, a_scale, b_scale, bias, torch.bfloat16)
    torch.testing.assert_close(out.cpu(), expect, rtol=2**-7, atol=1e-6)
    _ops()  # registers the operators
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda *t: torch.ops.hf_switchback.scaled_matmul(*t, torch.bfloat16, False, "triton"), fullgraph=True
    )
    assert torch.equal(compiled(*args), out)  # the same config in Inductor's launch: bitwise the same


@pytest.mark.gpu
def test_scaled_matmul_empty_and_bad_dtypes():
    ops = _ops()
    a, b = torch.zeros(0, 64, dtype=torch.int8).cuda(), torch.ones(32, 64, dtype=torch.int8).cuda()
    bias = torch.randn(32).cuda()
    out = ops.scaled_matmul(a, b, torch.zeros(0).cuda(), torch.ones(32).cuda(), bias, torch.bfloat16)
    assert out.shape == (0, 32) and out.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="share a dtype"):
        ops.scaled_matmul(
            b, b.to(torch.float8_e4m3fn), torch.ones(32).cuda(), torch.ones(32).cuda(), None, torch.float32
        )


CONFIGS = [
    dict(precision=p, weight_scaling=w, memory_efficient=me)
    for p in ("int8", "fp8")
    for w in ("tensor", "row")
    for me in (False, True)
]


def pin_grad_precision(cfg: dict) -> dict:
    """cfg with grad_precision="auto" resolved for this GPU, so the CPU reference quantizes gradients the same."""
    from hf_switchback import SwitchBackConfig, functional

    return {**cfg, "grad_precision": functional.grad_precision(SwitchBackConfig(**cfg), torch.device("cuda"))}


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("lead", [(2, 77), (1,), (0,)], ids=["3d", "M1", "M0"])
def test_layer_triton_matches_torch_backend(cfg, dtype, lead):
    """SwitchBackLinear with the Triton kernels (GPU) vs the same layer on the torch reference kernels (CPU)."""
    from hf_switchback import SwitchBackConfig
    from hf_switchback.modules import SwitchBackLinear

    torch.manual_seed(0)
    base = torch.nn.Linear(96, 136).to(dtype)
    x = torch.randn(*lead, 96, dtype=dtype)
    grad = torch.randn(*lead, 136, dtype=dtype)
    results = {}
    for backend, device in (("triton", "cuda"), ("torch", "cpu")):
        layer = SwitchBackLinear.from_linear(
            copy.deepcopy(base).to(device), SwitchBackConfig(backend=backend, **pin_grad_precision(cfg))
        )
        xi = x.to(device).requires_grad_(True)
        out = layer(xi)
        out.backward(grad.to(device))
        results[backend] = [t.cpu() for t in (out, xi.grad, layer.weight.grad, layer.bias.grad)]
    assert results["triton"][0].shape == (*lead, 136)
    for got, expect, what in zip(results["triton"], results["torch"], ("out", "dx", "dw", "db"), strict=True):
        assert got.dtype == expect.dtype and got.shape == expect.shape, what
        if expect.numel() == 0 or expect.float().abs().max() == 0:
            assert torch.equal(got, expect), what
            continue
        # Same quantization on both paths; only accumulation order and epilogue rounding differ.
        assert snr_db(expect, got) > 35, (what, snr_db(expect, got))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("where", ["input", "output_gradient"])
def test_a_nan_reaches_its_rows_outputs_and_no_other(cfg, where):
    """A NaN in one token's input (or output gradient) gives that token a non-finite output (input gradient),
    as the torch reference does, and leaves every other row as it was: the Triton reductions must not drop it."""
    from hf_switchback import SwitchBackConfig
    from hf_switchback.modules import SwitchBackLinear

    torch.manual_seed(0)
    layer = SwitchBackLinear.from_linear(
        torch.nn.Linear(1280, 256).cuda().bfloat16(), SwitchBackConfig(backend="triton", **cfg)
    )
    x = torch.randn(300, 1280, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)

    def run(x, grad):
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        out.backward(grad)
        return out.detach(), xi.grad

    out, dx = run(x, grad)
    if where == "input":
        x[7, 1000] = float("nan")
    else:
        grad[7, 100] = float("nan")
    out_nan, dx_nan = run(x, grad)
    hit = (out_nan if where == "input" else dx_nan)[7]
    assert not torch.isfinite(hit).any()
    rows = torch.arange(300, device="cuda") != 7
    assert torch.equal(out_nan[rows], out[rows]) and torch.equal(dx_nan[rows], dx[rows])


@pytest.mark.gpu
def test_auto_backend_falls_back_below_token_floor():
    """backend='auto' on CUDA runs the exact 16-bit matmul below AUTO_MIN_TOKENS_CUDA rows."""
    from hf_switchback import SwitchBackConfig
    from hf_switchback.functional import AUTO_MIN_TOKENS_CUDA, switchback_linear

    lin = torch.nn.Linear(64, 32).to("cuda", torch.bfloat16)
    x = torch.randn(AUTO_MIN_TOKENS_CUDA - 1, 64, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(switchback_linear(x, lin.weight, lin.bias, SwitchBackConfig()), lin(x))
    forced = switchback_linear(x, lin.weight, lin.bias, SwitchBackConfig(backend="triton"))
    assert not torch.equal(forced, lin(x)) and snr_db(lin(x), forced) > 25


@pytest.mark.gpu
def test_torch_compile_no_graph_breaks():
    """A SwitchBack MLP block traces into one graph (custom ops with fake impls) and matches eager."""
    from hf_switchback import SwitchBackConfig
    from hf_switchback.modules import SwitchBackLinear

    torch.manual_seed(0)
    cfg = SwitchBackConfig(backend="triton")
    block = torch.nn.Sequential(
        SwitchBackLinear.from_linear(torch.nn.Linear(128, 512), cfg),
        torch.nn.GELU(),
        SwitchBackLinear.from_linear(torch.nn.Linear(512, 128), cfg),
    ).to("cuda", torch.bfloat16)
    x = torch.randn(4, 64, 128, device="cuda", dtype=torch.bfloat16)

    _assert_one_graph_and_compiled_matches_eager(block, x)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [0, 2], ids=["subtile", "whole"])
@pytest.mark.parametrize("shape", [(1100, 264, 400), (2000, 520, 1296), (300, 136, 96)])
@pytest.mark.parametrize("want_act", [True, False])
@pytest.mark.parametrize(
    "qdtype,dtype,activation",
    [
        (torch.int8, torch.bfloat16, "gelu"),
        (torch.int8, torch.bfloat16, "gelu_tanh"),
        (torch.int8, torch.bfloat16, "quick_gelu"),
        (torch.float8_e4m3fn, torch.bfloat16, "gelu_tanh"),
        (torch.int8, torch.float32, "quick_gelu"),
    ],
    ids=str,
)
def test_scaled_matmul_act_backward(qdtype, dtype, activation, want_act, shape, config, monkeypatch):
    """fc2's grad-input GEMM (the TMA kernel for M >= 1024 on Hopper, the portable one below) followed by the
    activation backward: grad_h within a rounding of the composite twin, q / scale bitwise equal to quantizing
    the kernel's own grad_h, column sums up to float32 order."""
    from hf_switchback.kernels import matmul

    tuner = matmul._tma_autotuned_kernel
    monkeypatch.setattr(tuner, "configs", [tuner.configs[config]])
    monkeypatch.setattr(tuner, "cache", {})
    m, n, k = shape
    a, b = _random_q((m, k), qdtype), _random_q((n, k), qdtype)
    a_scale, b_scale = torch.rand(m) * 0.01, torch.tensor(0.003)
    h = (torch.randn(m, n) * 2).to(dtype)
    args = (a_scale, b_scale, h)
    gh, act, q, s, colsum = _ops().scaled_matmul_act_backward(
        a.cuda(),
        b.cuda(),
        *(t.cuda() for t in args),
        qdtype,
        activation,
        want_act,
        options=KernelOptions(use_tma=True),
    )
    gh_ref, act_ref, *_ = ref.scaled_matmul_act_backward(a, b, *args, qdtype, activation, want_act)
    grad_a = ref.scaled_matmul(a, b, a_scale, b_scale, None, torch.float32)
    assert gh.dtype == dtype and gh.shape == (m, n) and act.shape == act_ref.shape
    ulp = {torch.float32: 2**-23, torch.bfloat16: 2**-8}[dtype]
    accumulation = (
        0.0 if qdtype == torch.int8 else k * 2**-13
    )  # fp8: see test_scaled_matmul_matches_reference
    # float32 accumulation error scales with sum |a||b| (not |sum a b|, which cancels): bound it by that
    abs_grad_a = (a.float().abs() @ b.float().abs().t()) * a_scale[:, None] * b_scale
    bound = (2 * ulp + ROUND_TOL[dtype]) * 1.2 * grad_a.abs() + accumulation * 1.2 * abs_grad_a + 1e-30
    assert ((gh.cpu().float() - gh_ref.float()).abs() <= bound).all()
    if want_act:
        assert (
            (act.cpu().float() - act_ref.float()).abs() <= ROUND_TOL[dtype] * h.float().abs() + 1e-30
        ).all()
    q_own, s_own, sum_own = ref.quantize_rowwise_colsum(gh.cpu(), qdtype)
    assert torch.equal(s.cpu(), s_own)
    _assert_quantizes_own_grad_h(q, q_own, qdtype)
    sum_bound = m * 2**-24 * gh.cpu().float().abs().sum(0) + 1e-30
    assert ((colsum.cpu() - sum_own).abs() <= sum_bound).all()


MLP_CONFIGS = [
    dict(precision="int8", weight_scaling="tensor", memory_efficient=False, fuse_mlp=True),
    dict(precision="int8", weight_scaling="row", memory_efficient=True, fuse_mlp=True),
    dict(precision="fp8", weight_scaling="row", memory_efficient=False, fuse_mlp=True),
    dict(precision="fp8", weight_scaling="tensor", memory_efficient=True, fuse_mlp=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", MLP_CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("hidden_act", ["quick_gelu", "gelu", "gelu_pytorch_tanh"])
# (8, 160): 1280 tokens, on the autotuned GEMM (the portable kernel under the default use_tma=False).
@pytest.mark.parametrize("lead", [(2, 77), (8, 160), (0,)], ids=["3d", "1280", "M0"])
def test_fused_mlp_triton_matches_torch_backend(cfg, dtype, hidden_act, lead, monkeypatch):
    """A fused CLIPMLP on the Triton kernels (GPU) vs the same block on the torch reference kernels (CPU)."""
    from transformers import CLIPVisionConfig
    from transformers.models.clip.modeling_clip import CLIPMLP

    from hf_switchback import SwitchBackConfig, apply_switchback
    from hf_switchback.blocks.mlp import is_fused_mlp
    from hf_switchback.kernels import matmul

    # One tile config (the GEMM tests cover the others): autotuning every key here would take minutes.
    for tuner in (matmul._tma_autotuned_kernel, matmul._autotuned_kernel, matmul._sm90_autotuned_kernel):
        monkeypatch.setattr(tuner, "configs", tuner.configs[:1])
        monkeypatch.setattr(tuner, "cache", {})

    torch.manual_seed(0)
    base = CLIPMLP(
        CLIPVisionConfig(hidden_size=96, intermediate_size=392, hidden_act=hidden_act, num_attention_heads=4)
    ).to(dtype)
    x = torch.randn(*lead, 96, dtype=dtype)
    grad = torch.randn(*lead, 96, dtype=dtype)
    results = {}
    for backend, device in (("triton", "cuda"), ("torch", "cpu")):
        block = apply_switchback(
            copy.deepcopy(base).to(device), SwitchBackConfig(backend=backend, **pin_grad_precision(cfg))
        )
        assert is_fused_mlp(block)
        xi = x.to(device).requires_grad_(True)
        out = block(xi)
        out.backward(grad.to(device))
        params = (block.fc1.weight, block.fc1.bias, block.fc2.weight, block.fc2.bias)
        results[backend] = [t.cpu() for t in (out, xi.grad, *(p.grad for p in params))]
    for got, expect, what in zip(
        results["triton"], results["torch"], ("out", "dx", "dw1", "db1", "dw2", "db2"), strict=True
    ):
        assert got.dtype == expect.dtype and got.shape == expect.shape, what
        if expect.numel() == 0 or expect.float().abs().max() == 0:
            assert torch.equal(got, expect), what
            continue
        # Same quantization on both paths up to rare one-code rounding flips after the activation.
        assert snr_db(expect, got) > 30, (what, snr_db(expect, got))


@pytest.mark.gpu
def test_fused_mlp_torch_compile_no_graph_breaks():
    from transformers import CLIPVisionConfig
    from transformers.models.clip.modeling_clip import CLIPMLP

    from hf_switchback import SwitchBackConfig, apply_switchback

    torch.manual_seed(0)
    block = CLIPMLP(
        CLIPVisionConfig(
            hidden_size=128, intermediate_size=512, hidden_act="quick_gelu", num_attention_heads=4
        )
    )
    block = apply_switchback(block, SwitchBackConfig(backend="triton", fuse_mlp=True)).to(
        "cuda", torch.bfloat16
    )
    x = torch.randn(4, 64, 128, device="cuda", dtype=torch.bfloat16)
    _assert_one_graph_and_compiled_matches_eager(block, x)


# The kernels under TRITON_INTERPRET=1, in a process of their own (the variable is read at triton's import).
INTERPRETER_CHECK = Path(__file__).with_name("_interpreter_check.py")


@pytest.mark.skipif(not CAN_INTERPRET_KERNELS, reason=INTERPRETER_SKIP_REASON)
def test_interpreter_int8_kernels():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, str(INTERPRETER_CHECK)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "interpreter ok" in proc.stdout


@pytest.mark.gpu
def test_portable_gemm_tunes_hoppers_measured_configs_there_and_all_elsewhere(monkeypatch):
    from hf_switchback.kernels import matmul

    full = [str(c) for c in matmul._autotuned_kernel.configs]
    tuner = matmul.portable_tuner(0)
    if torch.cuda.get_device_capability(0) == (9, 0):
        assert tuner is matmul._sm90_autotuned_kernel
        assert len(tuner.configs) == 3 and {str(c) for c in tuner.configs} < set(full)
    else:
        assert tuner is matmul._autotuned_kernel
    monkeypatch.setattr(tuner, "cache", {})
    a, b = _random_q((2048, 256), torch.int8), _random_q((384, 256), torch.int8)
    a_scale, b_scale = torch.rand(2048) * 0.01, torch.tensor(0.003)
    out = matmul.scaled_matmul(a.cuda(), b.cuda(), a_scale.cuda(), b_scale.cuda(), None, torch.float32)
    assert len(tuner.cache) == 1  # the launch went through this autotuner and kept its pick
    # int32 accumulation is exact; the epilogue's two products round once each (up to an FMA contraction)
    expect = ref.scaled_matmul(a, b, a_scale, b_scale, None, torch.float32)
    torch.testing.assert_close(out.cpu(), expect, rtol=2**-21, atol=1e-30)
