"""LayerNorm + row-wise quantize (kernels/norm_quant.py) against its torch twin, and the twin against float64.

Tolerances: the twin's float32 statistics against float64 to 1e-5 relative; its y against float64 LayerNorm to
one rounding of y's dtype plus 1e-5 (float32 arithmetic); its q against quantizing that float64 result to within one 8-bit step (a value that
lands next to a rounding boundary may round either way). The Triton kernel against the twin: the same bounds,
its float32 sums running in another order.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from helpers import HAS_TRITON, REPO

from hf_switchback.kernels import reference as ref
from hf_switchback.kernels.reference import layernorm_quantize_rowwise

EPS = 1e-5
# Float32 statistics and affine: a few float32 ulps of the normalized values (|y| of order one).
FLOAT32_ERR = 1e-5


def ulp(t: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each value of t in t's dtype (float32 result)."""
    return (t.float().abs().clamp_min(1e-30) * torch.finfo(t.dtype).eps).float()


def check_close_to(exact_y: torch.Tensor, y: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, qdtype):
    """y within one rounding of exact_y (float64) plus float32 arithmetic error (FLOAT32_ERR absolute, for
    values of order one); q and scale within one step of quantizing y's rounding."""
    rounded = exact_y.to(y.dtype)
    assert ((y.float() - rounded.float()).abs() <= ulp(rounded) + FLOAT32_ERR).all()
    q_exact, s_exact = ref.quantize_rowwise(rounded, qdtype)
    torch.testing.assert_close(scale, s_exact, rtol=max(2 * torch.finfo(y.dtype).eps, 1e-5), atol=0)
    step = 1.0 if qdtype == torch.int8 else q_exact.float().abs() * 2.0**-3 + 2.0**-9
    assert ((q.float() - q_exact.float()).abs() <= step).all()


def layernorm64(x, weight, bias):
    return F.layer_norm(
        x.double(),
        x.shape[-1:],
        None if weight is None else weight.double(),
        None if bias is None else bias.double(),
        EPS,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("affine", [True, False])
def test_twin_matches_float64_layernorm_then_quantize(dtype, qdtype, affine):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(33, 70, generator=gen) * 3 + 1).to(dtype)
    weight = torch.randn(70, generator=gen) if affine else None
    bias = torch.randn(70, generator=gen) if affine else None
    q, scale, y, mean, rstd = layernorm_quantize_rowwise(x, weight, bias, EPS, qdtype, dtype)
    xd = x.double()
    torch.testing.assert_close(mean.double(), xd.mean(1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rstd.double(), (xd.var(1, unbiased=False) + EPS).rsqrt(), rtol=1e-5, atol=0)
    assert y.dtype == dtype and q.dtype == qdtype and scale.dtype == torch.float32
    check_close_to(layernorm64(x, weight, bias), y, q, scale, qdtype)


def test_twin_zero_output_rows_and_output_dtype():
    x = torch.randn(4, 16)
    q, scale, y, _, _ = layernorm_quantize_rowwise(x, torch.zeros(16), None, EPS, torch.int8, x.dtype)
    assert torch.equal(q, torch.zeros_like(q)) and torch.equal(scale, torch.zeros(4)) and not y.isnan().any()
    # y rounded once to the requested dtype (the autocast dtype the next linear casts to), q from that rounding
    q2, s2, y2, _, _ = layernorm_quantize_rowwise(x, None, None, EPS, torch.int8, torch.bfloat16)
    y32 = layernorm_quantize_rowwise(x, None, None, EPS, torch.int8, torch.float32)[2]
    assert y2.dtype == torch.bfloat16 and torch.equal(y2, y32.bfloat16())
    assert all(torch.equal(a, b) for a, b in zip((q2, s2), ref.quantize_rowwise(y2), strict=True))
    with pytest.raises(ValueError, match="2-D"):
        layernorm_quantize_rowwise(torch.randn(2, 3, 4), None, None, EPS, torch.int8, torch.float32)


# The kernel under TRITON_INTERPRET=1 (read at triton's import, so in a process of its own); int8 only: the
# interpreter does not emulate fp8 casts.
_INTERPRETED = textwrap.dedent(
    """
    import torch
    from hf_switchback.kernels import norm_quant, reference as twin
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 70, generator=gen) * 3 + 1
    x[5] = 0
    w, b = torch.randn(70, generator=gen), torch.randn(70, generator=gen)
    for inp in (x, x.bfloat16(), x.t().contiguous().t()):
        for args in ((w, b), (None, None), (torch.zeros(70), None)):
            got = norm_quant.layernorm_quantize_rowwise(inp, *args, 1e-5, torch.int8, inp.dtype)
            ref = twin.layernorm_quantize_rowwise(inp, *args, 1e-5, torch.int8, inp.dtype)
            assert (got[0].int() - ref[0].int()).abs().max() <= 1
            assert ((got[2].float() - ref[2].float()).abs() <= ref[2].float().abs() * torch.finfo(inp.dtype).eps + 1e-5).all()
            torch.testing.assert_close(got[1], ref[1], rtol=2 * torch.finfo(inp.dtype).eps, atol=0)
            torch.testing.assert_close(got[3], ref[3], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(got[4], ref[4], rtol=1e-6, atol=0)
    # the residual add in the same kernel: h exactly torch's sum, the rest as the LayerNorm of h
    d = (torch.randn(37, 70, generator=gen) * 2).bfloat16()
    h, *got = norm_quant.add_layernorm_quantize_rowwise(x, d, w, b, 1e-5, torch.int8, torch.bfloat16)
    assert torch.equal(h, x + d)
    want = norm_quant.layernorm_quantize_rowwise(x + d, w, b, 1e-5, torch.int8, torch.bfloat16)
    assert all(torch.equal(u, v) for u, v in zip(got, want, strict=True))
    y16 = norm_quant.layernorm_quantize_rowwise(x, w, b, 1e-5, torch.int8, torch.bfloat16)[2]
    y32 = twin.layernorm_quantize_rowwise(x, w, b, 1e-5, torch.int8, torch.float32)[2]
    # within one bfloat16 step (2**-7 relative): the interpreter's float32 -> bfloat16 cast may truncate
    assert y16.dtype == torch.bfloat16 and ((y16.float() - y32).abs() <= y32.abs() * 2.0**-7 + 1e-5).all()
    print("interpreter ok")
    """
)


@pytest.mark.skipif(
    not HAS_TRITON, reason="needs triton installed (TRITON_INTERPRET=1 runs kernels on the CPU)"
)
def test_kernel_under_interpreter_matches_twin():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO / "src"))
    run = subprocess.run(
        [sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=600
    )
    assert "interpreter ok" in run.stdout, run.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("k", [768, 1000, 1280])
def test_kernel_matches_twin_on_gpu(dtype, qdtype, k):
    from hf_switchback.kernels import norm_quant

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(4099, k, device="cuda", generator=gen) * 3 + 1).to(dtype)
    x[7] = 0
    weight = torch.randn(k, device="cuda", generator=gen)
    bias = torch.randn(k, device="cuda", generator=gen).to(dtype)
    q, scale, y, mean, rstd = norm_quant.layernorm_quantize_rowwise(x, weight, bias, EPS, qdtype, dtype)
    q_t, s_t, y_t, mean_t, rstd_t = layernorm_quantize_rowwise(x, weight, bias, EPS, qdtype, dtype)
    torch.testing.assert_close(mean, mean_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rstd, rstd_t, rtol=1e-5, atol=0)
    torch.testing.assert_close(scale, s_t, rtol=max(2 * torch.finfo(dtype).eps, 1e-5), atol=0)
    assert ((y.float() - y_t.float()).abs() <= ulp(y_t) + FLOAT32_ERR).all()
    check_close_to(layernorm64(x, weight, bias), y, q, scale, qdtype)
    assert (q.float() != q_t.float()).float().mean() < 1e-2  # differences stay rare


@pytest.mark.gpu
@pytest.mark.parametrize(
    "x_dtype,d_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)]
)
def test_add_kernel_is_the_add_then_the_layernorm_kernel(x_dtype, d_dtype):
    """The residual add in LayerNorm 2's kernel: h bit for bit torch's x + delta (one rounding of the float32
    sum to the promoted dtype), and every other output bit for bit the LayerNorm kernel's on that h."""
    from hf_switchback.kernels import norm_quant

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(4099, 1280, device="cuda", generator=gen) * 3).to(x_dtype)
    d = torch.randn(4099, 1280, device="cuda", generator=gen).to(d_dtype)
    w, b = torch.randn(1280, device="cuda", generator=gen), torch.randn(1280, device="cuda", generator=gen)
    h, *got = norm_quant.add_layernorm_quantize_rowwise(x, d, w, b, EPS, torch.int8, torch.bfloat16)
    assert h.dtype == torch.promote_types(x_dtype, d_dtype) and torch.equal(h, x + d)
    want = norm_quant.layernorm_quantize_rowwise(x + d, w, b, EPS, torch.int8, torch.bfloat16)
    assert all(torch.equal(u, v) for u, v in zip(got, want, strict=True))
