"""kernels/transpose_quantize.py under TRITON_INTERPRET=1 on the CPU, bitwise against the torch twins.

Run by tests/test_transpose_quantize.py in a process of its own (triton reads TRITON_INTERPRET at import);
prints "interpreter ok" when every check passed. The interpreter of triton 3.9 casts float32 -> fp8 without
correct rounding (the kernels round to the fp8 grid themselves there: quantize._INTERPRETED) and float32 ->
bfloat16 by truncation (the dequantize of `requantize`), so rounding is checked here with int8 targets, and fp8
targets with values that need no rounding (the GPU tests cover fp8 and bfloat16 rounding): what this checks is the kernels' logic (tiles, tails, masks, strides, padding, transposed store,
the column absmax across programs, scales, zeros).
"""

import torch

from hf_switchback.kernels import reference as ref
from hf_switchback.kernels import transpose_quantize as tq

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# (M, C, input dtypes, pad_to values): M under one 128-token tile or with a tail past one (two token splits of
# the column absmax), not a multiple of 16; C with a tail past a 64-feature tile (100) or whole tiles only (256,
# 320: what the model widths 768 / 1280 take, at a third of the interpreter's time). Every combination at the
# smallest shape only: the interpreter takes seconds per launch at the larger ones.
CASES = [
    (37, 100, FLOATS, (1, 16)),
    (130, 256, (torch.bfloat16,), (16,)),
    (145, 320, (torch.float32,), (16,)),
]


def bits(q):
    return q.view(torch.int8)


def check(got, want, what):
    (q, s), (q_ref, s_ref) = got, want
    assert q.shape == q_ref.shape and q.dtype == q_ref.dtype and q.is_contiguous(), what
    assert s.dtype == torch.float32 and torch.equal(s, s_ref), what
    assert torch.equal(bits(q), bits(q_ref)), (what, (bits(q) != bits(q_ref)).sum().item())


def with_zeros(x):
    x[:, 3] = 0  # an all-zero feature: scale 0 and q 0, never NaN
    x[5] = 0
    return x


def exact_fp8_data(m, c, qdtype):
    """x (M, C) float32 whose every x / scale is a normal value of qdtype: no rounding in the cast."""
    values = torch.randint(-128, 128, (m, c), dtype=torch.int8).view(qdtype).float()
    tiny = torch.finfo(qdtype).tiny
    values = torch.where(values.isfinite() & (values.abs() >= tiny), values, tiny)
    values = values.clamp(-ref.QMAX[qdtype], ref.QMAX[qdtype])
    values[7] = ref.QMAX[qdtype]  # each feature's absmax is QMAX, so its scale is a power of two
    return with_zeros(values * torch.exp2(torch.randint(-8, 8, (1, c)).float()))


torch.manual_seed(0)
for m, c, dtypes, pads in CASES:
    x = with_zeros(torch.randn(m, c) * torch.rand(1, c) * 5)
    for dtype in dtypes:
        for pad_to in pads:
            inp = x.to(dtype)
            what = (m, c, dtype, pad_to)
            want = ref.quantize_over_tokens(inp, torch.int8, pad_to)
            check(tq.quantize_over_tokens(inp, torch.int8, pad_to), want, what)
            for qdtype in FP8 if dtype != torch.float16 else ():  # e5m2 x 2^7 is past float16's range
                exact = exact_fp8_data(m, c, qdtype).to(dtype)
                got = tq.quantize_over_tokens(exact, qdtype, pad_to)
                check(got, ref.quantize_over_tokens(exact, qdtype, pad_to), (*what, qdtype))
    # a row-quantized saved input (memory_efficient), dequantized inside the kernels
    saved = torch.int8 if m == 37 else torch.float8_e4m3fn
    x_q, x_scale = ref.quantize_rowwise(x, saved)
    for dtype in (torch.float32, torch.float16) if m == 37 else (torch.float16,):
        got = tq.requantize_over_tokens(x_q, x_scale, dtype, torch.int8, 16)
        check(got, ref.requantize_over_tokens(x_q, x_scale, dtype, torch.int8, 16), (m, c, saved, dtype))

# A strided input (a transposed view), with one program walking every row of its features (the row loop).
xt = torch.randn(100, 301).t()
tq._ABSMAX_PROGRAMS, programs = 1, tq._ABSMAX_PROGRAMS
check(tq.quantize_over_tokens(xt, torch.int8, 16), ref.quantize_over_tokens(xt, torch.int8, 16), "strided")
tq._ABSMAX_PROGRAMS = programs
# A NaN gradient keeps its feature's scale NaN (dW not finite, as in the reference); the other features are
# untouched.
x = torch.randn(300, 70)  # three programs per column block: NaNs and finite maxima meet in the atomic max
x[200, 2] = float("nan")
x[0, 9] = float("nan")
q, s = tq.quantize_over_tokens(x, torch.float8_e5m2, 16)
s_ref = ref.quantize_over_tokens(x, torch.float8_e5m2, 16)[1]
finite = torch.ones(70, dtype=torch.bool)
finite[[2, 9]] = False
assert s[~finite].isnan().all() and s_ref[~finite].isnan().all() and torch.equal(s[finite], s_ref[finite])
# No tokens: the padding is all there is.
q, s = tq.quantize_over_tokens(torch.empty(0, 8), torch.float8_e4m3fn, 16)
assert q.shape == (8, 0) and s.shape == (8,)
print("interpreter ok")
