"""The two ways the Triton kernel set is reached: directly in eager mode, through Inductor under torch.compile.

- Eager (kernels/ops.py): the public functions call the Triton launchers directly, not through the custom-op
  dispatcher; the result must be bitwise what the custom op returns.
- torch.compile (kernels/compiled.py): quantization is left to Inductor as plain tensor ops (so it fuses into
  the op before it); its generated kernels must agree with our Triton quantize kernels. Row-wise int8 must
  match exactly except where a value sits on a rounding tie that Inductor's float32 division rounds the other
  way: at most 1 code apart, on at most 0.1% of elements; scales must match to float32 rounding.
GPU tests skip cleanly without CUDA + triton (the kernel-set contract itself is checked on the CPU, in
test_kernel_options.py).
"""

from __future__ import annotations

import pytest
import torch

from hf_switchback import KernelOptions
from hf_switchback.kernels import reference as ref


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn])
def test_direct_eager_call_equals_custom_op(qdtype):
    from hf_switchback.kernels import ops

    torch.manual_seed(0)
    x = torch.randn(300, 1280, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 1280, device="cuda", dtype=torch.bfloat16)
    q_direct, s_direct = ops.quantize_rowwise(x, qdtype)
    q_op, s_op = torch.ops.hf_switchback.quantize_rowwise(x, qdtype)
    assert torch.equal(q_direct.view(torch.int8), q_op.view(torch.int8)) and torch.equal(s_direct, s_op)
    wq, ws = ops.quantize_tensorwise(w, qdtype)
    out_direct = ops.scaled_matmul(q_direct, wq, s_direct, ws, None, torch.bfloat16)
    out_op = torch.ops.hf_switchback.scaled_matmul(q_op, wq, s_op, ws, None, torch.bfloat16, False)
    assert torch.equal(out_direct, out_op)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["quantize_rowwise", "quantize_tensorwise"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_inductor_quantize_matches_triton_kernels(name, dtype):
    from hf_switchback.kernels import ops

    torch.manual_seed(0)
    x = (torch.randn(4096, 1280, device="cuda") * 3).to(dtype)
    x[1] = 0  # an all-zero row: scale 0, q 0, never NaN
    torch._dynamo.reset()
    q_ind, s_ind = torch.compile(getattr(ref, name), fullgraph=True)(x, torch.int8)
    q_tri, s_tri = getattr(ops, name)(x, torch.int8)
    torch.testing.assert_close(s_ind, s_tri, rtol=2e-7, atol=0)
    diff = (q_ind.int() - q_tri.int()).abs()
    assert diff.max().item() <= 1
    assert (diff > 0).float().mean().item() <= 1e-3
    assert not torch.isnan(s_ind).any()
    assert (q_ind[1] == 0).all()  # the zero row quantizes to zeros
    if name == "quantize_rowwise":
        assert s_ind[1] == 0 and (s_ind[torch.arange(len(s_ind)) != 1] > 0).all()
    else:  # one scale for the tensor, set by its nonzero rows
        assert s_ind.item() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("m", [64, 4096])  # the fixed small-tile launch and the autotuned one
@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("with_bias", [False, True])
def test_traced_gemm_under_compile_matches_eager_gemm(m, qdtype, with_bias):
    """The GEMM operator (a triton_op on CUDA) is launched by Inductor's code and computes what the eager
    launcher does."""
    from torch._inductor.utils import run_and_get_code

    from hf_switchback.kernels import ops

    torch.manual_seed(0)
    a, b = torch.randn(m, 1024, device="cuda"), torch.randn(768, 1024, device="cuda")
    a_q, a_s = ops.quantize_rowwise(a, qdtype)
    b_q, b_s = ops.quantize_rowwise(b, qdtype)
    bias = torch.randn(768, device="cuda", dtype=torch.bfloat16) if with_bias else None
    # our eager Triton launcher (fp8_gemm="triton": on Hopper "auto" would send fp8 to cuBLAS, another kernel)
    eager = ops.scaled_matmul(
        a_q, b_q, a_s, b_s, bias, torch.bfloat16, options=KernelOptions(fp8_gemm="triton")
    )
    torch._dynamo.reset()
    traced = torch.compile(
        lambda *args: torch.ops.hf_switchback.scaled_matmul(*args, torch.bfloat16, False, "triton"),
        fullgraph=True,
    )
    out, codes = run_and_get_code(traced, a_q, b_q, a_s, b_s, bias)
    code = "\n".join(codes)  # Inductor's code launches the kernel itself, not through an op
    assert ("_scaled_mm_kernel" in code) and "torch.ops.hf_switchback" not in code
    # Same kernel source; Inductor may pick another tile config. int8 accumulates exactly in int32, fp8 per
    # 128-wide K tile in float32, so the only allowed difference is the last bf16 bit of the output cast.
    torch.testing.assert_close(out, eager, rtol=2**-7, atol=0)
    assert (out != eager).float().mean().item() <= (0 if qdtype == torch.int8 else 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(50, 768), (4099, 3072)])
@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_traced_grad_quantize_under_compile_matches_eager_kernel(shape, qdtype):
    """The quantize_rowwise_colsum operator (launched by Inductor's code) is the eager kernel: q and
    scale bitwise, the column sum to float32 summation order."""
    from torch._inductor.utils import run_and_get_code

    from hf_switchback.kernels import ops

    torch.manual_seed(0)
    x = (torch.randn(*shape, device="cuda") * 5).to(torch.bfloat16)
    x[3] = 0
    q, s, cs = ops.quantize_rowwise_colsum(x, qdtype)
    torch._dynamo.reset()
    traced = torch.compile(
        lambda t: torch.ops.hf_switchback.quantize_rowwise_colsum(t, qdtype), fullgraph=True
    )
    (q_t, s_t, cs_t), codes = run_and_get_code(traced, x)
    code = "\n".join(codes)
    assert "_rowwise_colsum_kernel" in code and "torch.ops.hf_switchback" not in code
    assert q_t.dtype == qdtype and torch.equal(q_t.view(torch.int8), q.view(torch.int8))
    assert torch.equal(s_t, s)
    torch.testing.assert_close(cs_t, cs, rtol=1e-5, atol=1e-3 * shape[0] ** 0.5)


def _switchback_block(options: KernelOptions | None = None) -> torch.nn.Sequential:
    """fc1 -> GELU -> fc2 of SwitchBack linears (Triton backend, `options`), bf16 on the GPU, seeded."""
    from hf_switchback import SwitchBackConfig
    from hf_switchback.modules import SwitchBackLinear

    torch.manual_seed(0)
    cfg = SwitchBackConfig(backend="triton", kernel_options=options or KernelOptions())
    return torch.nn.Sequential(
        SwitchBackLinear.from_linear(torch.nn.Linear(256, 1024), cfg),
        torch.nn.GELU(),
        SwitchBackLinear.from_linear(torch.nn.Linear(1024, 256), cfg),
    ).to("cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("triton_grad_quantize", [True, False])
def test_compiled_block_backward_matches_eager(triton_grad_quantize):
    """Compiled backward of a SwitchBack block: the output-gradient quantize runs our kernel (default) or
    Inductor's, and every gradient agrees with eager SwitchBack to quantization-tie noise."""
    from torch._inductor.utils import run_and_get_code

    block = _switchback_block(KernelOptions(triton_grad_quantize=triton_grad_quantize))
    x = torch.randn(8, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(8, 128, 256, device="cuda", dtype=torch.bfloat16)

    def grads(model):
        x.grad = None
        model.zero_grad(set_to_none=True)
        model(x).backward(g)
        return [x.grad] + [p.grad for p in block.parameters()]

    torch._dynamo.reset()
    compiled_block = torch.compile(block, fullgraph=True)
    _, codes = run_and_get_code(lambda: grads(compiled_block))
    code = "\n".join(codes)
    assert ("_rowwise_colsum_kernel" in code) == triton_grad_quantize
    got, want = grads(compiled_block), grads(block)
    for a, b in zip(got, want, strict=True):
        err = (a.float() - b.float()).pow(2).mean() / b.float().pow(2).mean()
        assert err.item() < 1e-3, err.item()  # > 30 dB: only rounding ties of the quantizes differ


@pytest.mark.gpu
@pytest.mark.parametrize("trace_gemm", [True, False])
def test_compiled_block_uses_inductor_quantize_and_matches_eager(trace_gemm):
    """Under torch.compile the block's generated code holds no hf_switchback quantize op. The GEMM is launched
    by Inductor's code itself (default) or, with KernelOptions.trace_gemm off, through the opaque custom op."""
    from torch._inductor.utils import run_and_get_code

    block = _switchback_block(KernelOptions(trace_gemm=trace_gemm))
    x = torch.randn(8, 128, 256, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled_block = torch.compile(block, fullgraph=True)
    out, codes = run_and_get_code(compiled_block, x)
    code = "\n".join(codes)
    assert "hf_switchback.quantize_rowwise" not in code
    if trace_gemm:
        assert "_scaled_mm_kernel" in code and "torch.ops.hf_switchback" not in code
    else:
        assert "hf_switchback.scaled_matmul" in code
    eager = block(x)
    err = (out.float() - eager.float()).pow(2).mean() / eager.float().pow(2).mean()
    assert err.item() < 1e-4  # ~40 dB: the two differ only in rare rounding ties of the quantize


@pytest.mark.gpu
@pytest.mark.parametrize("triton_act_quantize", [True, False])
@pytest.mark.parametrize("width", [1024, 5120])  # 5120: ViT-H's fc1 width
def test_compiled_fused_mlp_activation_passes_match_eager(triton_act_quantize, width):
    """A compiled fused SwitchBack MLP (memory_efficient) runs its two activation passes as our Triton kernels
    launched from Inductor's code (default) or as Inductor's own; either way output and every gradient agree
    with eager SwitchBack to quantization-tie noise (> 30 dB)."""
    from torch._inductor.utils import run_and_get_code
    from transformers import CLIPVisionConfig
    from transformers.models.clip.modeling_clip import CLIPMLP

    from hf_switchback import SwitchBackConfig, apply_switchback

    torch.manual_seed(0)
    mlp = CLIPMLP(
        CLIPVisionConfig(hidden_size=256, intermediate_size=width, hidden_act="gelu", num_attention_heads=4)
    )
    options = KernelOptions(triton_act_quantize=triton_act_quantize)
    cfg = SwitchBackConfig(backend="triton", memory_efficient=True, min_tokens=0, kernel_options=options)
    block = apply_switchback(mlp, cfg).to("cuda", torch.bfloat16)
    x = torch.randn(8, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(8, 128, 256, device="cuda", dtype=torch.bfloat16)

    def outputs(model):
        x.grad = None
        block.zero_grad(set_to_none=True)
        out = model(x)
        out.backward(g)
        return [out.detach(), x.grad] + [p.grad for p in block.parameters()]

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    _, codes = run_and_get_code(lambda: outputs(compiled))
    code = "\n".join(codes)
    assert ("_rowwise_kernel" in code) == triton_act_quantize
    from hf_switchback.kernels.quantize import act_backward_impl

    tiled = act_backward_impl(width) == "tiles"
    backward_kernel = "_act_backward_tiles_kernel" if tiled else "_act_backward_rows_kernel"
    assert (backward_kernel in code) == triton_act_quantize
    assert "torch.ops.hf_switchback.act" not in code  # traced launches, no opaque op call per step
    got, want = outputs(compiled), outputs(block)
    for a, b in zip(got, want, strict=True):
        err = (a.float() - b.float()).pow(2).mean() / b.float().pow(2).mean()
        assert err.item() < 1e-3, err.item()
