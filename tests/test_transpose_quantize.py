"""The fp8 grad-weight operands: kernels/transpose_quantize.py against its torch twins, and how wgrad reaches it.

q and scale must be bitwise the twins' (reference.quantize_over_tokens = quantize_rowwise(x.T) with zero
tokens padded on; requantize_over_tokens = the same of dequantize_rowwise). The CPU tests run the kernels
under TRITON_INTERPRET=1 (tests/_interpreter_transpose_quantize_check.py says what that can check); the GPU
tests (skipped without CUDA + triton) compare the compiled kernels bitwise, the CUDA weight_grad with the
reference weight_grad, and the traced operators under torch.compile with the eager kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import CAN_INTERPRET_KERNELS, INTERPRETER_SKIP_REASON, REPO, snr_db

from hf_switchback.kernels import reference as ref
from hf_switchback.kernels import wgrad

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FLOATS = [torch.bfloat16, torch.float16, torch.float32]
HAS_FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
# (tokens, features): tails on both axes, M not a multiple of 16, features not powers of two, a ViT-B shape.
SHAPES = [(1, 16), (37, 100), (1001, 768), (4099, 1280), (2000, 3072)]


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.cpu().view(torch.int8)


def test_twin_is_the_transposed_row_quantize_with_zero_tokens_padded():
    x = torch.randn(37, 24)
    x[:, 5] = 0
    q, s = ref.quantize_over_tokens(x, torch.float8_e5m2, 16)
    q_t, s_t = ref.quantize_rowwise(x.t(), torch.float8_e5m2)
    assert q.shape == (24, 48) and q.is_contiguous() and torch.equal(s, s_t)
    assert torch.equal(_bits(q[:, :37]), _bits(q_t)) and not _bits(q[:, 37:]).any()
    assert s[5] == 0 and not _bits(q[5]).any()
    q1, _ = ref.quantize_over_tokens(x, torch.float8_e5m2)  # pad_to=1: no padding
    assert torch.equal(_bits(q1), _bits(q_t))
    x_q, x_s = ref.quantize_rowwise(x, torch.float8_e4m3fn)
    got = ref.requantize_over_tokens(x_q, x_s, torch.bfloat16, torch.int8, 16)
    want = ref.quantize_over_tokens(ref.dequantize_rowwise(x_q, x_s, torch.bfloat16), torch.int8, 16)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("memory_efficient", [False, True])
def test_weight_grad_of_a_row_quantized_input_is_that_of_its_dequantized_form(memory_efficient):
    g, x = torch.randn(50, 32), torch.randn(50, 48)
    x_q, x_s = ref.quantize_rowwise(x, torch.float8_e4m3fn)
    saved = wgrad.RowQuantized(x_q, x_s, torch.bfloat16)
    plain = ref.dequantize_rowwise(x_q, x_s, torch.bfloat16)
    for precision in wgrad.WGRAD_PRECISIONS:
        got = wgrad.weight_grad(g, saved, torch.float32, precision)
        assert torch.equal(got, wgrad.weight_grad(g, plain, torch.float32, precision)), precision


@pytest.mark.skipif(not CAN_INTERPRET_KERNELS, reason=INTERPRETER_SKIP_REASON)
def test_kernels_under_interpreter_match_twins():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO / "src"))
    script = Path(__file__).with_name("_interpreter_transpose_quantize_check.py")
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    assert "interpreter ok" in run.stdout, run.stderr[-3000:]


def _gpu_input(shape, dtype):
    x = torch.randn(shape) * torch.rand(1, shape[1]) * 5
    if shape[0] > 5 and shape[1] > 3:
        x[:, 3] = 0  # an all-zero feature: scale 0, q 0
        x[5] = 0
        x[2, 0] = 1e4  # an outlier: the rest of its feature goes subnormal in fp8
    return x.to(dtype).cuda()


def _check_bitwise(got, want):
    (q, s), (q_ref, s_ref) = got, want
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape and q.is_contiguous()
    assert torch.equal(s.cpu(), s_ref), (s.cpu() - s_ref).abs().max()
    assert torch.equal(_bits(q), _bits(q_ref)), (_bits(q) != _bits(q_ref)).sum()


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", [*FP8, torch.int8])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_gpu_quantize_over_tokens_bitwise(shape, dtype, qdtype):
    from hf_switchback.kernels import transpose_quantize as tq

    x = _gpu_input(shape, dtype)
    for pad_to in (1, 16):
        _check_bitwise(
            tq.quantize_over_tokens(x, qdtype, pad_to), ref.quantize_over_tokens(x.cpu(), qdtype, pad_to)
        )
    x_t = _gpu_input(shape[::-1], dtype).t()  # strided rows
    _check_bitwise(tq.quantize_over_tokens(x_t, qdtype, 16), ref.quantize_over_tokens(x_t.cpu(), qdtype, 16))


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", FP8)
def test_gpu_quantize_over_tokens_bitwise_many_magnitudes(qdtype):
    """Features spanning 1e-30..1e30 and tokens spanning 1e-6..1e6: the correctly rounded division and the fp8
    subnormals must match IEEE x / scale and torch's cast."""
    from hf_switchback.kernels import transpose_quantize as tq

    x = torch.randn(3001, 1280) * torch.logspace(-30, 30, 1280) * torch.logspace(-6, 6, 3001)[:, None]
    _check_bitwise(tq.quantize_over_tokens(x.cuda(), qdtype, 16), ref.quantize_over_tokens(x, qdtype, 16))


@pytest.mark.gpu
@pytest.mark.parametrize("saved", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(37, 100), (4099, 768)])
def test_gpu_requantize_over_tokens_bitwise(shape, dtype, saved):
    from hf_switchback.kernels import transpose_quantize as tq

    x_q, x_s = ref.quantize_rowwise(_gpu_input(shape, torch.float32).cpu(), saved)
    for qdtype in FP8:
        got = tq.requantize_over_tokens(x_q.cuda(), x_s.cuda(), dtype, qdtype, 16)
        _check_bitwise(got, ref.requantize_over_tokens(x_q, x_s, dtype, qdtype, 16))


@pytest.mark.gpu
def test_gpu_nan_gradient_gives_a_non_finite_weight_gradient():
    from hf_switchback.kernels import ops

    g, x = torch.randn(300, 64, device="cuda"), torch.randn(300, 32, device="cuda")
    g[17, 5] = float("nan")
    dw = wgrad.weight_grad(g, x, torch.float32, "fp8", ops.KERNELS)
    assert dw[5].isnan().all() and torch.isfinite(dw[torch.arange(64, device="cuda") != 5]).all()


def _spy_scaled_mm(monkeypatch) -> list:
    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    return calls


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs a CUDA GPU with fp8 tensor cores (sm89+)")
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_gpu_weight_grad_on_triton_operands_matches_reference(monkeypatch, memory_efficient):
    """The CUDA weight_grad with the Triton kernel set: the same fp8 operands as the reference (bitwise), then
    cuBLAS; the bound on the difference is tests/test_wgrad.py's (bf16 output, Hopper's fp8 accumulation)."""
    from hf_switchback.kernels import ops

    gen = torch.Generator("cuda").manual_seed(0)
    grad_out = torch.randn(4099, 1280, device="cuda", generator=gen).bfloat16()
    x = (torch.randn(4099, 768, device="cuda", generator=gen) * 3).bfloat16()
    if memory_efficient:
        x_q, x_s = ops.quantize_rowwise(x, torch.float8_e4m3fn)
        x_in = wgrad.RowQuantized(x_q, x_s, torch.bfloat16)
        x = ref.dequantize_rowwise(x_q, x_s, torch.bfloat16)
    else:
        x_in = x
    want = wgrad.reference_weight_grad(grad_out.cpu(), x.cpu(), torch.float32).cuda()  # CPU: see g_ref below
    calls = _spy_scaled_mm(monkeypatch)
    got = wgrad.weight_grad(grad_out, x_in, torch.float32, "fp8", ops.KERNELS)
    [(g_q, x_qt)] = [a[:2] for a in calls]
    # The reference on the CPU: torch's CUDA division by a Python number multiplies by its reciprocal, so the
    # GPU twin's scales (and with them some q) can differ by an ulp from the correctly rounded ones.
    g_ref, g_scale = (t.cuda() for t in ref.quantize_over_tokens(grad_out.cpu(), wgrad.G_DTYPE, 16))
    x_ref, x_scale = (t.cuda() for t in ref.quantize_over_tokens(x.cpu(), wgrad.X_DTYPE, 16))
    assert torch.equal(_bits(g_q), _bits(g_ref)) and torch.equal(_bits(x_qt.t()), _bits(x_ref))
    products = (g_ref.double().abs() @ x_ref.double().abs().t()) * g_scale[:, None] * x_scale[None, :]
    err = (got.double() - want.double()).abs()
    excess = err - (2**-9 * want.double().abs() + 2**-10 * products)
    assert excess.max() <= 0, f"worst error {err.max():.3g}, {excess.gt(0).sum()} entries over the bound"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["quantize_over_tokens", "requantize_over_tokens"])
def test_gpu_traced_operator_under_compile_is_the_eager_kernel(name):
    """Under torch.compile the operator is a triton_op: Inductor's code launches our kernels (not the twin,
    not an opaque op call) and computes bitwise what the eager launch does."""
    from torch._inductor.utils import run_and_get_code

    from hf_switchback.kernels import ops

    x = _gpu_input((4099, 768), torch.bfloat16)
    args = (x, wgrad.G_DTYPE, 16)
    if name == "requantize_over_tokens":
        args = (*ops.quantize_rowwise(x, torch.float8_e4m3fn), torch.bfloat16, wgrad.X_DTYPE, 16)
    eager = getattr(ops, name)(*args)
    torch._dynamo.reset()
    traced = torch.compile(lambda *a: getattr(torch.ops.hf_switchback, name)(*a), fullgraph=True)
    got, codes = run_and_get_code(traced, *args)
    code = "\n".join(codes)
    assert "_quantize_transposed_kernel" in code and "torch.ops.hf_switchback" not in code
    assert torch.equal(_bits(got[0]), _bits(eager[0])) and torch.equal(got[1], eager[1])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs a CUDA GPU with fp8 tensor cores (sm89+)")
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_gpu_compiled_layer_runs_our_kernels_and_matches_eager(memory_efficient):
    from torch._inductor.utils import run_and_get_code

    from hf_switchback import SwitchBackConfig, SwitchBackLinear

    torch.manual_seed(0)
    cfg = SwitchBackConfig(
        precision="fp8", wgrad_precision="fp8", min_tokens=0, memory_efficient=memory_efficient
    )
    eager = SwitchBackLinear(768, 1024, config=cfg).cuda().bfloat16()
    compiled = SwitchBackLinear(768, 1024, config=cfg).cuda().bfloat16()
    compiled.load_state_dict(eager.state_dict())
    x = torch.randn(8, 257, 768, device="cuda", dtype=torch.bfloat16)
    eager(x).float().square().sum().backward()
    torch._dynamo.reset()
    layer = torch.compile(compiled, fullgraph=True)
    _, codes = run_and_get_code(lambda: layer(x).float().square().sum().backward())  # compiles backward too
    assert "_quantize_transposed_kernel" in "\n".join(codes)
    # The fp8 operands are our kernels' in both; only the forward / grad-input quantizes Inductor fuses may
    # round a value the other way (test_wgrad.py's compiled-layer test), so the bound is that test's.
    assert snr_db(eager.weight.grad, compiled.weight.grad) > 25
