"""fp8 GEMMs through cuBLAS (`torch._scaled_mm`) with SwitchBack's row-wise scales.

    out = (a_q @ b_q.T) * a_scale[:, None] * b_scale[None, :] + bias      a_q (M, K), b_q (N, K) fp8

the contract of `reference.scaled_matmul`, for the fp8 GEMMs (fp8 forward, fp8 grad-input). cuBLAS's row-wise
fp8 GEMM takes scale_a (M, 1) and scale_b (1, N) float32, A row-major and B column-major, which is what
SwitchBack's operands already are: b_q (N, K) contiguous is B = b_q.T column-major, so no copy is made. A
per-tensor weight scale () is broadcast to (1, N) (cuBLAS takes both scales row-wise or both per-tensor).

Why: on the H100 at the per-call shapes of a CLIP training step cuBLAS fp8 row-wise beats cuBLAS bf16 at every
shape, by more than this package's Triton fp8 kernels do (BENCHMARKS.md, GEMM kernels). Under torch.compile the call stays `aten._scaled_mm`, an op Inductor knows (it can also fuse the
operand quantize into the producer), instead of an opaque kernel.

Accuracy: use_fast_accum=False, so cuBLAS promotes the fp8 tensor-core partial sums to float32 (Hopper's
fp8 accumulator keeps ~14 mantissa bits; the Triton kernel promotes once per K tile for the same reason).
The bias is added in bfloat16 inside cuBLAS's epilogue (row-wise scaling takes a bf16 bias only): one bf16
rounding of the bias more than the Triton kernel, the rounding nn.Linear's bias gets under autocast.

Which GEMMs come here (`use_cublas`): fp8 operands cuBLAS takes (e4m3 x e4m3, e4m3 x e5m2, not e5m2 x e5m2),
bfloat16 output (row-wise scaling supports no other), K and N multiples of 16 (cuBLAS's fp8 alignment), and
the policy `KernelOptions.fp8_gemm` allows it: "auto" = Hopper (sm90, where it was measured to win); "cublas"
= wherever torch._scaled_mm runs (sm89+ GPUs, and CPU for the tests); "triton" = never.
"""

from __future__ import annotations

import torch

_PAIRS = {
    (torch.float8_e4m3fn, torch.float8_e4m3fn),
    (torch.float8_e4m3fn, torch.float8_e5m2),
    (torch.float8_e5m2, torch.float8_e4m3fn),
}
MIXED_FP8_PAIRS = {pair for pair in _PAIRS if pair[0] != pair[1]}
ALIGN = 16  # cuBLAS fp8: leading dimensions multiples of 16 elements (16 bytes)


def has_fp8_tensor_cores(device_index: int) -> bool:
    """True when CUDA device `device_index` multiplies fp8 natively (compute capability 8.9 or newer)."""
    # get_device_properties, not get_device_capability: torch.compile constant-folds the former.
    props = torch.cuda.get_device_properties(device_index)
    return (props.major, props.minor) >= (8, 9)


def _capability(device: torch.device) -> tuple[int, int]:
    # get_device_properties, not get_device_capability: torch.compile constant-folds the former.
    props = torch.cuda.get_device_properties(device.index if device.index is not None else 0)
    return props.major, props.minor


def shapes_fit(a_q: torch.Tensor, b_q: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """True when cuBLAS's row-wise fp8 GEMM takes these operands (dtypes, output dtype, alignment)."""
    if (a_q.dtype, b_q.dtype) not in _PAIRS or out_dtype != torch.bfloat16:
        return False
    if a_q.dim() != 2 or b_q.dim() != 2 or a_q.shape[1] != b_q.shape[1]:
        return False
    k, n = a_q.shape[1], b_q.shape[0]
    return k % ALIGN == 0 and n % ALIGN == 0 and a_q.shape[0] > 0


def use_cublas(a_q: torch.Tensor, b_q: torch.Tensor, out_dtype: torch.dtype, policy: str) -> bool:
    """Whether this GEMM goes to cuBLAS under `policy` (KernelOptions.fp8_gemm: auto, cublas, triton)."""
    if policy == "triton" or not shapes_fit(a_q, b_q, out_dtype):
        return False
    if a_q.device.type != "cuda":
        return policy == "cublas"
    major, minor = _capability(a_q.device)
    if policy == "cublas":
        return (major, minor) >= (8, 9)
    return major == 9  # "auto": Hopper, where cuBLAS fp8 was measured ahead at every CLIP shape


def scales(a_scale: torch.Tensor, b_scale: torch.Tensor, m: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SwitchBack's scales, a (M,) and b (N,) or (), as cuBLAS's row-wise scale_a (M, 1) and scale_b (1, N)."""
    scale_a = a_scale.float().reshape(m, 1)
    scale_b = b_scale.float().reshape(1, -1).expand(1, n).contiguous()
    return scale_a, scale_b


def scaled_matmul(
    a_q: torch.Tensor,
    b_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """reference.scaled_matmul on cuBLAS: (M, K) @ (N, K).T fp8 -> (M, N) bfloat16 (see the module docstring)."""
    if not shapes_fit(a_q, b_q, out_dtype):
        raise ValueError(
            f"cublas.scaled_matmul: needs fp8 operands ({a_q.dtype}, {b_q.dtype}: e5m2 x e5m2 is not taken), "
            f"bfloat16 output (got {out_dtype}) and K, N multiples of {ALIGN} (got a {tuple(a_q.shape)}, "
            f"b {tuple(b_q.shape)}); check with cublas.shapes_fit first"
        )
    m, n = a_q.shape[0], b_q.shape[0]
    scale_a, scale_b = scales(a_scale, b_scale, m, n)
    return torch._scaled_mm(
        a_q.contiguous(),
        b_q.contiguous().t(),  # (K, N) column-major: the layout cuBLAS wants for B, no copy
        scale_a=scale_a,
        scale_b=scale_b,
        bias=None if bias is None else bias.to(torch.bfloat16),
        out_dtype=out_dtype,
        use_fast_accum=False,
    )


__all__ = ["scaled_matmul", "scales", "shapes_fit", "use_cublas"]
