"""kernels/cublas.py: SwitchBack's fp8 GEMM through torch._scaled_mm (cuBLAS on Hopper).

On the CPU torch._scaled_mm runs too, so the scale/layout logic (row-wise scale_a (M, 1), scale_b (1, N), a
per-tensor weight scale broadcast, B = b_q.T column-major, the bias) is checked against the reference
scaled_matmul (fp8 emulated in float32) without a GPU. The GPU test checks the dispatch and the result on
CUDA (skipped without sm89+).
"""

import pytest
import torch

from hf_switchback.kernels import cublas
from hf_switchback.kernels import reference as ref
from hf_switchback.kernels.options import KernelOptions

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HAS_FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _cpu_rowwise_scaled_mm() -> bool:
    """Whether this torch build's CPU torch._scaled_mm takes row-wise scales (older builds: per-tensor only)."""
    a = torch.ones(16, 16).to(E4M3)
    try:
        torch._scaled_mm(
            a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16
        )
    except (RuntimeError, NotImplementedError):
        return False
    return True


requires_cpu_rowwise = pytest.mark.skipif(
    not _cpu_rowwise_scaled_mm(), reason="this torch's CPU _scaled_mm has no row-wise scaling"
)


def operands(m, n, k, a_dtype=E4M3, b_dtype=E4M3, weight_scaling="row", device="cpu"):
    a = torch.randn(m, k, device=device) * torch.rand(m, 1, device=device) * 4
    w = torch.randn(n, k, device=device)
    a_q, a_scale = ref.quantize_rowwise(a, a_dtype)
    if weight_scaling == "row":
        b_q, b_scale = ref.quantize_rowwise(w, b_dtype)
    else:
        b_q, b_scale = ref.quantize_tensorwise(w, b_dtype)
    return a_q, b_q, a_scale, b_scale


def exact(a_q, b_q, a_scale, b_scale, bias):
    """float64: fp8 values and their products are exact there."""
    out = (a_q.double() @ b_q.double().t()) * a_scale.double()[:, None] * b_scale.double()
    return out if bias is None else out + bias.double()


def rel_err(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@requires_cpu_rowwise
@pytest.mark.parametrize("weight_scaling", ["row", "tensor"])
@pytest.mark.parametrize("pair", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_reference_on_cpu(weight_scaling, pair, with_bias):
    m, n, k = 37, 48, 64  # M not aligned: only K and N must be multiples of 16
    a_q, b_q, a_scale, b_scale = operands(m, n, k, *pair, weight_scaling=weight_scaling)
    bias = torch.randn(n) * 3 if with_bias else None
    got = cublas.scaled_matmul(a_q, b_q, a_scale, b_scale, bias, torch.bfloat16)
    want = exact(a_q, b_q, a_scale, b_scale, bias)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    # both compute the exact fp8 products in float32; the rest is the bf16 output (and bias) rounding
    assert rel_err(got, want) < 8e-3, rel_err(got, want)
    # a wrong scale layout (e.g. scale_b applied per row) would be off by far more than rounding
    wrong = exact(a_q, b_q, a_scale, b_scale.flip(0) if b_scale.dim() else b_scale * 2, bias)
    assert rel_err(got, wrong) > 0.05


def test_scales_layout():
    a_scale, b_row, b_tensor = torch.rand(5), torch.rand(32), torch.tensor(0.5)
    sa, sb = cublas.scales(a_scale, b_row, 5, 32)
    assert sa.shape == (5, 1) and sb.shape == (1, 32) and sb.is_contiguous()
    assert torch.equal(sa[:, 0], a_scale) and torch.equal(sb[0], b_row)
    _, sb = cublas.scales(a_scale, b_tensor, 5, 32)
    assert sb.shape == (1, 32) and torch.all(sb == 0.5)


def test_shapes_fit_and_policy():
    a_q, b_q, _, _ = operands(8, 32, 64)
    assert cublas.shapes_fit(a_q, b_q, torch.bfloat16)
    assert not cublas.shapes_fit(a_q, b_q, torch.float32)  # row-wise scaling outputs bf16 only
    assert not cublas.shapes_fit(a_q[:, :40], b_q[:, :40], torch.bfloat16)  # K % 16
    assert not cublas.shapes_fit(a_q, b_q[:24], torch.bfloat16)  # N % 16
    a5, b5, _, _ = operands(8, 32, 64, E5M2, E5M2)
    assert not cublas.shapes_fit(a5, b5, torch.bfloat16)  # cuBLAS has no e5m2 x e5m2
    i8 = torch.zeros(8, 64, dtype=torch.int8)
    assert not cublas.shapes_fit(i8, i8[:32], torch.bfloat16)
    # CPU tensors: only an explicit "cublas" policy uses it ("auto" means Hopper)
    assert cublas.use_cublas(a_q, b_q, torch.bfloat16, "cublas")
    assert not cublas.use_cublas(a_q, b_q, torch.bfloat16, "auto")
    assert not cublas.use_cublas(a_q, b_q, torch.bfloat16, "triton")
    with pytest.raises(ValueError, match="multiples of 16"):
        cublas.scaled_matmul(a_q[:, :40], b_q[:, :40], torch.ones(8), torch.ones(32), None, torch.bfloat16)


@pytest.mark.parametrize("path", ["ops-opaque", "compiled-tma"])
def test_the_opaque_gemm_op_keeps_the_fp8_gemm_choice(path):
    """fp8_gemm="triton" must reach the operator too: left at its "auto" default, the operator would send the
    GEMM to cuBLAS on Hopper (the opaque operator runs under compile with use_tma, and in eager with
    direct_eager off)."""
    pytest.importorskip("triton")
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_switchback.kernels import compiled, ops

    class OperatorCalls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "hf_switchback":
                self.calls.append((func._opname, args[6:]))
            return func(*args, **(kwargs or {}))

    a_q, b_q, a_scale, b_scale = operands(8, 32, 32)
    if path == "ops-opaque":
        kernels, options = ops.KERNELS, KernelOptions(fp8_gemm="triton", direct_eager=False, use_tma=True)
    else:
        kernels, options = compiled.KERNELS, KernelOptions(fp8_gemm="triton", use_tma=True)
    with OperatorCalls() as mode:
        kernels.scaled_matmul(a_q, b_q, a_scale, b_scale, None, torch.bfloat16, options=options)
    assert mode.calls == [("scaled_matmul_recompute", (True, "triton"))]


def test_fp8_gemm_option():
    assert KernelOptions().fp8_gemm == "auto"
    with pytest.raises(ValueError, match="fp8_gemm"):
        KernelOptions(fp8_gemm="cutlass")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs a CUDA GPU with fp8 tensor cores (sm89+)")
@pytest.mark.parametrize("weight_scaling", ["row", "tensor"])
def test_gpu_matches_reference_and_ops_dispatch(weight_scaling):
    from hf_switchback.kernels import ops

    m, n, k = 4099, 1280, 1280
    a_q, b_q, a_scale, b_scale = operands(m, n, k, weight_scaling=weight_scaling, device="cuda")
    bias = torch.randn(n, device="cuda")
    want = exact(a_q, b_q, a_scale, b_scale, bias)
    got = cublas.scaled_matmul(a_q, b_q, a_scale, b_scale, bias, torch.bfloat16)
    assert rel_err(got, want) < 8e-3
    triton = KernelOptions(fp8_gemm="triton")
    triton_out = ops.scaled_matmul(a_q, b_q, a_scale, b_scale, bias, torch.bfloat16, options=triton)
    forced = KernelOptions(fp8_gemm="cublas")
    cublas_out = ops.scaled_matmul(a_q, b_q, a_scale, b_scale, bias, torch.bfloat16, options=forced)
    assert rel_err(triton_out, want) < 8e-3 and rel_err(cublas_out, want) < 8e-3
    assert torch.equal(cublas_out, got)
    # the opaque custom op (the fused MLP's recompute under compile) dispatches the same way
    op_out = torch.ops.hf_switchback.scaled_matmul(
        a_q, b_q, a_scale, b_scale, bias, torch.bfloat16, False, "cublas"
    )
    assert torch.equal(op_out, got)
