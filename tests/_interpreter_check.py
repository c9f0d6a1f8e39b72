"""The int8 Triton kernels under TRITON_INTERPRET=1 on the CPU, against the torch reference.

Run by tests/test_kernels_triton.py::test_interpreter_int8_kernels in a process of its own (triton reads
TRITON_INTERPRET at import); prints "interpreter ok" when every check passed.
"""

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from hf_switchback import KernelOptions
from hf_switchback.kernels import matmul, ops, quantize
from hf_switchback.kernels import reference as ref

torch.manual_seed(0)

# Tails on both axes (not multiples of the 64-wide tiles or 16-wide rows), a zero row, non-contiguous input.
x = torch.randn(37, 70) * 3
x[3] = 0
for inp in (x, x.t(), x.bfloat16()):
    for name in (
        "quantize_rowwise",
        "quantize_tensorwise",
        "quantize_rowwise_transposed",
        "quantize_tensorwise_transposed",
    ):
        q, s = getattr(ops, name)(inp, torch.int8)
        q_ref, s_ref = getattr(ref, name)(inp, torch.int8)
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref), name
# the last two: several rows per program, the last program with a tail past M
for inp in (x, x.t(), torch.randn(200, 37).bfloat16(), torch.randn(3001, 37)):
    q, s, cs = ops.quantize_rowwise_colsum(inp, torch.int8)
    q_ref, s_ref, cs_ref = ref.quantize_rowwise_colsum(inp, torch.int8)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    torch.testing.assert_close(cs, cs_ref, rtol=1e-5, atol=1e-4)
# The same with rows held in 3 or 5 pieces (768, 1280, 3072, 5120), pieces with masked lanes (70, 100), the
# one-pass limit and past it (8192, 8200); few programs (as on a 1-SM GPU), so each walks several row tiles
# and the last one stops inside its rows (133 x 100: 12 rows a program in tiles of 4, the last program 1 row);
# a zero row; fp32, bf16 and non-contiguous rows.
sm_count = quantize._sm_count
quantize._sm_count = lambda device: 1
for shape in ((37, 70), (133, 100), (21, 768), (19, 1280), (13, 3072), (11, 5120), (5, 8192), (3, 8200)):
    base = torch.randn(shape) * 3
    base[shape[0] // 2] = 0
    for inp in (base, base.bfloat16(), base.t().contiguous().t()):
        q, s, cs = ops.quantize_rowwise_colsum(inp, torch.int8)
        q_ref, s_ref, cs_ref = ref.quantize_rowwise_colsum(inp, torch.int8)
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref), shape
        torch.testing.assert_close(cs, cs_ref, rtol=1e-5, atol=1e-4 * shape[0] ** 0.5)
        # the same row tiles without the column sum: quantize_rowwise, and of act(x) (fc2's input)
        q, s = ops.quantize_rowwise(inp, torch.int8)
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref), shape
        if shape[1] <= 1280:
            q, s = ops.act_quantize_rowwise(inp, torch.int8, "quick_gelu")
            q_ref, s_ref = ref.act_quantize_rowwise(inp, torch.int8, "quick_gelu")
            tol = 1.5e-5 if inp.dtype == torch.float32 else 2**-7
            assert ((s - s_ref).abs() <= tol * s_ref).all() and (q.int() - q_ref.int()).abs().max() <= 1, (
                shape
            )
        if shape in ((37, 70), (19, 1280), (11, 5120)):
            # the activation backward by whole rows (g and h read once): gh, act(h), q, scale, column sum
            h = torch.randn(shape).to(inp.dtype)
            for activation, want_act in (("gelu", True), ("quick_gelu", False)):
                got = ops.act_backward_quantize_colsum(
                    inp, h, torch.int8, activation, want_act, options=KernelOptions(act_backward_impl="rows")
                )
                want = ref.act_backward_quantize_colsum(inp, h, torch.int8, activation, want_act)
                tol = 1e-5 if inp.dtype == torch.float32 else 2**-7
                torch.testing.assert_close(got[0], want[0], rtol=tol, atol=1e-5)  # gh
                torch.testing.assert_close(got[1], want[1], rtol=tol, atol=1e-5)  # act(h) or empty
                assert ((got[3] - want[3]).abs() <= tol * want[3]).all(), (shape, activation)
                assert (got[2].int() - want[2].int()).abs().max() <= 1, (shape, activation)
                torch.testing.assert_close(got[4], want[4], rtol=1e-4, atol=tol * shape[0] ** 0.5 * 10)
quantize._sm_count = sm_count
q, s = ops.quantize_rowwise(x, torch.int8)
assert torch.equal(ops.dequantize_rowwise(q, s, torch.float32), ref.dequantize_rowwise(q, s, torch.float32))
a = torch.randint(-127, 128, (37, 200), dtype=torch.int8)
b = torch.randint(-127, 128, (50, 200), dtype=torch.int8)
one_a, one_b = torch.ones(37), torch.ones(50)
assert torch.equal(
    ops.scaled_matmul(a, b, one_a, one_b, None, torch.float32),
    ref.scaled_matmul(a, b, one_a, one_b, None, torch.float32),
)
sa, sb, bias = torch.rand(37), torch.rand(50), torch.randn(50)
torch.testing.assert_close(
    ops.scaled_matmul(a, b, sa, sb[0], bias, torch.float32),
    ref.scaled_matmul(a, b, sa, sb[0], bias, torch.float32),
    rtol=1e-6,
    atol=1e-3,
)
# A large-M GEMM that the GPU's measured table names: the portable kernel launched with that tile, no
# autotuner (the lookup reads the GPU's capability, so a table hit is stood in; BLOCK_K 128 over K = 200: a tail).
table_tile = matmul._table_tile
matmul._table_tile = lambda a_q, b_q, c: (64, 128, 128, 4, 4)
a = torch.randint(-127, 128, (1030, 200), dtype=torch.int8)
b = torch.randint(-127, 128, (70, 200), dtype=torch.int8)
sa, bias = torch.rand(1030), torch.randn(70)
assert torch.equal(
    ops.scaled_matmul(a, b, torch.ones(1030), torch.ones(70), None, torch.float32),
    ref.scaled_matmul(a, b, torch.ones(1030), torch.ones(70), None, torch.float32),
)
torch.testing.assert_close(
    ops.scaled_matmul(a, b, sa, torch.tensor(0.3), bias, torch.float32),
    ref.scaled_matmul(a, b, sa, torch.tensor(0.3), bias, torch.float32),
    rtol=1e-6,
    atol=1e-3,
)
matmul._table_tile = table_tile
# The persistent TMA GEMM (sm90 only on a GPU; the interpreter runs it anywhere): 3 programs walking the
# tiles, tails on M, N and K, both epilogue layouts, both weight-scale kinds, with and without bias.
for m, n, k, sub, per_row, has_bias in ((37, 40, 48, True, True, True), (70, 24, 80, False, False, False)):
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    b = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    sa, sb = torch.rand(m), torch.rand(n) if per_row else torch.tensor(0.3)
    bias = torch.randn(n) if has_bias else None
    c = torch.empty(m, n)
    descs = [
        TensorDescriptor.from_tensor(t, shape)
        for t, shape in ((a, [32, 16]), (b, [16, 16]), (c, [32, 8 if sub else 16]))
    ]
    matmul._scaled_mm_tma_kernel[(3,)](
        *descs,
        sa,
        sb,
        sa if bias is None else bias,
        a,
        c,
        m,
        n,
        k,
        128,
        B_SCALE_PER_ROW=per_row,
        HAS_BIAS=has_bias,
        IS_INT=True,
        NUM_SMS=3,
        BLOCK_M=32,
        BLOCK_N=16,
        BLOCK_K=16,
        GROUP_M=2,
        EPILOGUE_SUBTILE=sub,
    )
    torch.testing.assert_close(c, ref.scaled_matmul(a, b, sa, sb, bias, torch.float32), rtol=1e-6, atol=1e-3)
# Fused MLP kernels: activation + quantize (one and two passes), activation backward + quantize + sum.
for act in ref.ACTIVATIONS:
    for h, g in ((x, torch.randn(37, 70)), (x.t(), torch.randn(37, 70).t()), (x.bfloat16(), x.bfloat16())):
        q, s = ops.act_quantize_rowwise(h, torch.int8, act)
        q_ref, s_ref = ref.act_quantize_rowwise(h, torch.int8, act)
        tol = 1.5e-5 if h.dtype == torch.float32 else 2**-7
        assert ((s - s_ref).abs() <= tol * s_ref).all() and (q.int() - q_ref.int()).abs().max() <= 1, act
        a, q, s = ops.act_and_quantize_rowwise(h, torch.int8, act)
        torch.testing.assert_close(a, ref.apply_activation(h, act), rtol=tol, atol=tol)
        assert all(
            torch.equal(u, v) for u, v in zip((q, s), ref.quantize_rowwise(a, torch.int8), strict=True)
        ), act
        gh, a, q, s, cs = ops.act_backward_quantize_colsum(g, h, torch.int8, act, True)
        gh_ref, a_ref, *_ = ref.act_backward_quantize_colsum(g, h, torch.int8, act, True)
        torch.testing.assert_close(gh, gh_ref, rtol=tol, atol=tol)
        torch.testing.assert_close(a, a_ref, rtol=tol, atol=tol)
        q2, s2, cs2 = ref.quantize_rowwise_colsum(gh, torch.int8)
        assert torch.equal(q, q2) and torch.equal(s, s2), act
        torch.testing.assert_close(cs, cs2, rtol=1e-5, atol=1e-4)
for impl in ("rows", "tiles"):  # the loop above ran "auto", which picks "rows" at these widths
    options = KernelOptions(act_backward_impl=impl)
    for act in ref.ACTIVATIONS:
        g, h = torch.randn(70, 37).t(), x
        gh, a, q, s, cs = ops.act_backward_quantize_colsum(g, h, torch.int8, act, True, options=options)
        gh_ref, a_ref, *_ = ref.act_backward_quantize_colsum(g, h, torch.int8, act, True)
        torch.testing.assert_close(gh, gh_ref, rtol=1.5e-5, atol=1.5e-5)
        q2, s2, cs2 = ref.quantize_rowwise_colsum(gh, torch.int8)
        assert torch.equal(q, q2) and torch.equal(s, s2), (impl, act)
        torch.testing.assert_close(cs, cs2, rtol=1e-5, atol=1e-4)
h = torch.randn(2, 8200)  # longer than one pass
q, s = ops.act_quantize_rowwise(h, torch.int8, "gelu")
q_ref, s_ref = ref.act_quantize_rowwise(h, torch.int8, "gelu")
assert ((s - s_ref).abs() <= 2e-6 * s_ref).all() and (q.int() - q_ref.int()).abs().max() <= 1
assert ops.act_backward_quantize_colsum(g, x, torch.int8, "gelu", False)[1].numel() == 0


# A NaN keeps its row's scale NaN (so the GEMM output of that row is not finite, as in the reference); the
# other rows are the reference's, bitwise. Triton's tl.max would drop the NaN and give a finite, wrong row.
def _with_nans(rows, cols, at):
    x = torch.randn(rows, cols)
    clean = torch.ones(rows, dtype=torch.bool)
    for r, c in at:
        x[r, c], clean[r] = float("nan"), False
    return x, clean


def _nan_rows_kept(clean, q, s, q_ref, s_ref, what):
    assert s[~clean].isnan().all() and s_ref[~clean].isnan().all(), what
    assert torch.equal(q[clean], q_ref[clean]) and torch.equal(s[clean], s_ref[clean]), what


# one pass with tails; two passes (longer than one pass can hold)
for nan_x, clean in (_with_nans(40, 70, [(5, 50), (25, 0)]), _with_nans(3, 8200, [(1, 8199)])):
    _nan_rows_kept(
        clean, *ops.quantize_rowwise(nan_x, torch.int8), *ref.quantize_rowwise(nan_x, torch.int8), "row"
    )
    q, s, _ = ops.quantize_rowwise_colsum(nan_x, torch.int8)
    _nan_rows_kept(clean, q, s, *ref.quantize_rowwise(nan_x, torch.int8), "colsum")
# the tensor-wise scale: a NaN in the first 64 x 64 tile, and one only in the last (tail) column tile of four
# (each tile's column maxima are combined by torch; 3 x 8200 would take the interpreter ~23 s for the same paths)
for nan_x, _ in (_with_nans(40, 70, [(5, 50), (25, 0)]), _with_nans(40, 200, [(30, 199)])):
    for name in ("quantize_tensorwise", "quantize_tensorwise_transposed"):
        assert getattr(ops, name)(nan_x, torch.int8)[1].isnan(), name
nan_x, clean = _with_nans(40, 70, [(5, 50), (25, 0)])
for impl in ("rows", "tiles"):
    options = KernelOptions(act_backward_impl=impl)
    gh, _, q, s, _ = ops.act_backward_quantize_colsum(
        nan_x, torch.randn(40, 70), torch.int8, "gelu", False, options=options
    )
    _nan_rows_kept(clean, q, s, *ref.quantize_rowwise(gh, torch.int8), impl)
print("interpreter ok")
