"""Triton 8-bit GEMM with the SwitchBack dequantize epilogue: out = (a @ b.T) * a_scale x b_scale + bias.

Operands are K-major, a (M, K) and b (N, K), which is what 8-bit tensor-core instructions want for both
operands (wgmma on Hopper takes 8-bit inputs K-major only). int8 accumulates in int32 (exact), fp8 in float32,
promoted from the tensor cores' reduced-precision accumulator once per BLOCK_K tile.
The epilogue multiplies in the same order as `reference.scaled_matmul` ((acc * a_scale) * b_scale + bias), so
int8 results match the reference up to an FMA contraction (one fp32 rounding) before the output cast.

Coverage:
- Hopper (sm90) and Ada (sm89) run fp8 `tl.dot` natively; Ampere (sm80) has no fp8 tensor cores, so fp8 tiles are
  upcast to fp16 in registers (exact: every e4m3/e5m2 value is an fp16 value) and multiplied in fp16.
- Any M, N, K: rows and columns past the edge are read modulo M / N (valid addresses, results masked at the
  store), the K tail is masked with zeros. Any strides. M = 0, N = 0 or K = 0 never reach the kernel.
- Large M (>= _AUTOTUNE_MIN_M) launches the config measured for its (M bucket, N, K) on this GPU where
  kernels/gemm_configs has one (no autotuning), else is autotuned per (M bucket, N, K); small M uses one fixed
  small-tile config (fast to compile, and autotuning every odd test shape would cost more than it saves).
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch
import triton
import triton.language as tl

from .gemm_configs import measured_tile
from .kernel_access import declare_access, when
from .quantize import launch_directly

_AUTOTUNE_MIN_M = 1024
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) below _AUTOTUNE_MIN_M
_SMALL_M_TILE = (64, 64, 128, 4, 3)
logger = logging.getLogger(__name__)


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the portable kernel's autotuning.
_TILE_SHAPES = (
    (128, 256, 128, 8, 3),
    (128, 256, 128, 8, 4),
    (256, 128, 128, 8, 3),
    (256, 128, 128, 8, 4),
    (128, 128, 128, 8, 4),
    (128, 128, 128, 4, 4),
    (128, 256, 64, 8, 4),
    (64, 128, 128, 4, 4),
)
# On the H100 these three come within a few percent of the fastest of all eight at every per-call shape of
# ViT-B/16, L/14 and H/14 training steps (BENCHMARKS.md, GEMM kernels). Every config compiles and is benchmarked
# at each new shape, so tuning three instead of eight shortens a compiled run's first step (BENCHMARKS.md,
# compile warm-up).
_SM90_TILE_SHAPES = ((128, 256, 128, 8, 3), (128, 256, 128, 8, 4), (64, 128, 128, 4, 4))


def _configs(shapes=_TILE_SHAPES) -> list[triton.Config]:
    # 8-bit tiles: BLOCK_K=128 is one 128-byte row per operand line. Shared memory per stage is
    # (BM + BN) * BK bytes; configs that do not fit (e.g. 4 stages of 128x256 on sm80) are skipped by the tuner.
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in shapes
    ]


def _tma_configs() -> list[triton.Config]:
    # (BM, BN, BK, warps, stages, epilogue subtile). Shared memory: stages * (BM + BN) * BK bytes for the
    # operands plus BM * BN(/2) * 2 for the bf16 store staging, under Hopper's 227 KiB.
    shapes = [
        (128, 256, 128, 8, 3, True),
        (128, 256, 128, 8, 4, True),
        (128, 128, 128, 8, 4, False),
        (256, 128, 128, 8, 3, True),
        (128, 128, 256, 8, 3, False),
        (128, 256, 64, 8, 6, True),
    ]
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "EPILOGUE_SUBTILE": sub},
            num_warps=w,
            num_stages=st,
            pre_hook=_set_block_shapes,
        )
        for bm, bn, bk, w, st, sub in shapes
    ]


def _set_block_shapes(nargs: dict) -> None:
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk]
    nargs["c_desc"].block_shape = [bm, bn // 2 if nargs["EPILOGUE_SUBTILE"] else bn]


@declare_access(reads=("a_ptr", "b_ptr", "as_ptr", "bs_ptr", when("HAS_BIAS", "bias_ptr")), writes=("c_ptr",))
@triton.jit
def _scaled_mm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    as_ptr,
    bs_ptr,
    bias_ptr,
    M,
    N,
    K,
    M_BUCKET,
    stride_am,
    stride_ak,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    B_SCALE_PER_ROW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_INT: tl.constexpr,
    UPCAST: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped tile order: GROUP_M row-tiles share each column tile of b while it is hot in L2.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Modulo instead of masks keeps the main loop's loads unmasked (better pipelining); the store is masked.
    offs_am = offs_m % M
    offs_bn = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_am[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_bn[:, None].to(tl.int64) * stride_bn + offs_k[None, :] * stride_bk

    if IS_INT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            # other=0.0 (not 0): an int literal cannot be cast to the fp8 element types.
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        if UPCAST:
            a = a.to(tl.float16)
            b = b.to(tl.float16)
        if IS_INT:
            acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
        elif UPCAST:
            acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.float32)
        else:
            # Hopper's fp8 tensor cores accumulate with ~14 truncated mantissa bits, and Triton's sm90 default
            # never promotes to fp32: the bias grew with K (errors up to 16% of sum|a*b| at K=1280). Promote
            # once per K tile (DeepSeek-V3 does the same every 128 elements).
            acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.float32, max_num_imprecise_acc=BLOCK_K)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    # Epilogue: dequantize with the row scale of a and the (per-row or single) scale of b, add bias, cast.
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_scale = tl.load(as_ptr + offs_m, mask=mask_m, other=0.0)
    out = acc.to(tl.float32) * a_scale[:, None]
    if B_SCALE_PER_ROW:
        out = out * tl.load(bs_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    else:
        out = out * tl.load(bs_ptr)
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _tile_pid(tile_id, num_pid_in_group, num_pid_m, GROUP_M: tl.constexpr):
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _dequant_store(
    c_desc,
    out,
    off_m,
    off_n,
    N,
    bs_ptr,
    bias_ptr,
    B_SCALE_PER_ROW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WIDTH: tl.constexpr,
):
    # out: (BM, WIDTH) float32 already multiplied by the row scales; columns off_n + [0, WIDTH).
    offs_n = off_n + tl.arange(0, WIDTH)
    mask_n = offs_n < N
    if B_SCALE_PER_ROW:
        out = out * tl.load(bs_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    else:
        out = out * tl.load(bs_ptr)
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c_desc.store([off_m, off_n], out.to(c_desc.dtype))


@triton.jit
def _scaled_mm_tma_kernel(
    a_desc,
    b_desc,
    c_desc,
    as_ptr,
    bs_ptr,
    bias_ptr,
    a_ptr,
    c_ptr,
    M,
    N,
    K,
    M_BUCKET,
    B_SCALE_PER_ROW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_INT: tl.constexpr,
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EPILOGUE_SUBTILE: tl.constexpr,
):
    # Hopper variant of _scaled_mm_kernel: persistent (one program per SM walks the output tiles, so one tile's
    # epilogue overlaps the next tile's loads) with TMA descriptors for a, b and c. TMA zero-fills reads past
    # M, N, K and clips stores, so no masks or modulo in the main loop; same epilogue arithmetic and order.
    # a_ptr and c_ptr (the tensors behind a_desc and c_desc) are not read: they are passed so that the
    # autotuner, which keys on the dtypes of tensor arguments, tunes int8 / fp8 and each output dtype apart.
    start_pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_M * num_pid_n
    # A second tile counter for the epilogue keeps it independent of the loop-carried one (pipelining).
    tile_id_c = start_pid - NUM_SMS
    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile_pid(tile_id, num_pid_in_group, num_pid_m, GROUP_M)
        off_am = pid_m * BLOCK_M
        off_bn = pid_n * BLOCK_N
        if IS_INT:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([off_am, ki * BLOCK_K])
            b = b_desc.load([off_bn, ki * BLOCK_K])
            if IS_INT:
                acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
            else:
                acc = tl.dot(a, b.T, acc, out_dtype=tl.float32, max_num_imprecise_acc=BLOCK_K)

        tile_id_c += NUM_SMS
        pid_m, pid_n = _tile_pid(tile_id_c, num_pid_in_group, num_pid_m, GROUP_M)
        off_cm = pid_m * BLOCK_M
        off_cn = pid_n * BLOCK_N
        offs_m = off_cm + tl.arange(0, BLOCK_M)
        a_scale = tl.load(as_ptr + offs_m, mask=offs_m < M, other=0.0)
        out = acc.to(tl.float32) * a_scale[:, None]
        if EPILOGUE_SUBTILE:
            # Two (BM, BN/2) halves: half the shared memory for the store staging, left to the main loop.
            halves = tl.permute(tl.reshape(out, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            out0, out1 = tl.split(halves)
            half: tl.constexpr = BLOCK_N // 2
            _dequant_store(c_desc, out0, off_cm, off_cn, N, bs_ptr, bias_ptr, B_SCALE_PER_ROW, HAS_BIAS, half)
            _dequant_store(
                c_desc, out1, off_cm, off_cn + half, N, bs_ptr, bias_ptr, B_SCALE_PER_ROW, HAS_BIAS, half
            )
        else:
            _dequant_store(
                c_desc, out, off_cm, off_cn, N, bs_ptr, bias_ptr, B_SCALE_PER_ROW, HAS_BIAS, BLOCK_N
            )


def _autotune_cache_kwargs() -> dict:
    # Autotuning benchmarks every config at every new (M bucket, N, K) once per process: part of what SwitchBack
    # adds to a first step. cache_results keeps the timings in Triton's on-disk cache (keyed by the kernel's
    # source, the key values, the configs and the GPU), so a resumed or repeated run skips the benchmarking.
    # Triton does not cache configs with a pre-hook (the TMA kernel's), and releases before the parameter
    # existed tune in every process.
    if "cache_results" in inspect.signature(triton.autotune).parameters:
        return {"cache_results": True}
    return {}


# The autotuned launchers: the portable kernel over every config, or over Hopper's measured winners (one
# autotuner each, as module globals: torch.compile hashes the kernels a triton_op can reach into its cache keys).
# The TMA one's pre-hook sets each config's block shapes on the descriptors.
_PORTABLE_KEY = ["M_BUCKET", "N", "K", "stride_am", "stride_bn"]
_autotuned_kernel = triton.autotune(configs=_configs(), key=_PORTABLE_KEY, **_autotune_cache_kwargs())(
    _scaled_mm_kernel
)
_sm90_autotuned_kernel = triton.autotune(
    configs=_configs(_SM90_TILE_SHAPES), key=_PORTABLE_KEY, **_autotune_cache_kwargs()
)(_scaled_mm_kernel)
_tma_autotuned_kernel = triton.autotune(configs=_tma_configs(), key=["M_BUCKET", "N", "K"])(
    _scaled_mm_tma_kernel
)


# Launchers.


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def portable_tuner(device_index: int):
    """The portable kernel's autotuner for a CUDA device: Hopper's measured configs on sm90, all elsewhere."""
    return _sm90_autotuned_kernel if _capability(device_index) == (9, 0) else _autotuned_kernel


def _table_tile(a_q: torch.Tensor, b_q: torch.Tensor, c: torch.Tensor):
    """The tile measured for this GEMM on this GPU (kernels/gemm_configs), or None (then it is autotuned).
    Only concrete sizes and the measured layout (K-major a and b) are looked up."""
    m, k = a_q.shape
    n = b_q.shape[0]
    if not all(isinstance(size, int) for size in (m, n, k)) or a_q.stride(1) != 1 or b_q.stride(1) != 1:
        return None
    return _tile_for(a_q.device.index or 0, a_q.dtype, c.dtype, m, n, k)


@functools.lru_cache(maxsize=4096)
def _tile_for(device_index: int, a_dtype: torch.dtype, out_dtype: torch.dtype, m: int, n: int, k: int):
    # cached: eager launches pay one dict lookup, not the string and bucket work
    name = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
    return measured_tile(_capability(device_index), name(a_dtype), name(out_dtype), m, n, k)


def _launch_tile(wrap, tile, args: tuple, flags: dict, m: int, n: int, k: int) -> None:
    """The portable kernel with one given config (no autotuner)."""
    bm, bn, bk, warps, stages = tile
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    wrap(_scaled_mm_kernel)[grid](
        *args,
        **flags,
        EVEN_K=k % bk == 0,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=8,
        num_warps=warps,
        num_stages=stages,
    )


def _needs_fp8_upcast(device_index: int) -> bool:
    # fp8 tensor cores exist from sm89 (Ada) on.
    return _capability(device_index) < (8, 9)


# Devices (CUDA indices) where the TMA kernel failed to build: the portable kernel runs there from then on.
# A per-device cache, not a setting: KernelOptions.use_tma stays what the caller asked for.
_tma_failed: set[int] = set()


def _tma_applies(a_q: torch.Tensor, b_q: torch.Tensor, c: torch.Tensor) -> bool:
    """Hopper (sm90), large M, contiguous operands, TMA's 16-byte alignment of every row stride and base, and
    the kernel not known to fail on this device."""
    device = a_q.device.index or 0
    if a_q.shape[0] < _AUTOTUNE_MIN_M or _capability(device)[0] != 9 or device in _tma_failed:
        return False
    tensors = (a_q, b_q, c)
    return all(
        t.is_contiguous() and t.data_ptr() % 16 == 0 and (t.shape[1] * t.element_size()) % 16 == 0
        for t in tensors
    )


def _scaled_mm_tma(a_q, b_q, c, a_scale, b_scale, bias, flags) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = a_q.shape
    n = b_q.shape[0]
    # Block shapes are placeholders: each config's pre_hook sets its own before the launch.
    a_desc = TensorDescriptor.from_tensor(a_q, [1, 16])
    b_desc = TensorDescriptor.from_tensor(b_q, [1, 16])
    c_desc = TensorDescriptor.from_tensor(c, [1, 16])
    num_sms = _num_sms(a_q.device.index or 0)

    def grid(meta):
        return (min(num_sms, triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])),)

    _tma_autotuned_kernel[grid](
        a_desc,
        b_desc,
        c_desc,
        a_scale,
        b_scale,
        # Without bias any pointer will do; c's keeps the tuning key (tensor dtypes) of the biased call.
        bias if bias is not None else c,
        a_q,
        c,
        m,
        n,
        k,
        triton.next_power_of_2(m),
        NUM_SMS=num_sms,
        B_SCALE_PER_ROW=flags["B_SCALE_PER_ROW"],
        HAS_BIAS=flags["HAS_BIAS"],
        IS_INT=flags["IS_INT"],
    )


def _run_tma(a_q, b_q, c, a_scale, b_scale, bias, flags) -> bool:
    """Launch the TMA kernel; if it cannot be built here (a Triton version without tensor descriptors, or a
    compiler bug), warn, remember the device and return False: the caller then runs the portable kernel,
    which computes the same result."""
    try:
        _scaled_mm_tma(a_q, b_q, c, a_scale, b_scale, bias, flags)
    except Exception as err:  # compile errors surface as many exception types across Triton versions
        if isinstance(err, torch.cuda.OutOfMemoryError):
            raise
        device = a_q.device.index or 0
        logger.warning(
            "hf_switchback: TMA GEMM unavailable on cuda:%d (%s: %s); using the portable kernel there",
            device,
            type(err).__name__,
            err,
        )
        _tma_failed.add(device)
        return False
    return True


def scaled_matmul(
    a_q: torch.Tensor,
    b_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    wrap=None,
    use_tma: bool = False,
) -> torch.Tensor:
    """a_q (M, K), b_q (N, K) both int8 or both float8; a_scale (M,) float32; b_scale (N,) or () float32;
    bias (N,) or None -> (M, N) out_dtype. Same contract as `reference.scaled_matmul`.

    wrap: None launches the kernels here; `torch.library.wrap_triton` (inside a `triton_op`, see ops.py)
    records the launch for torch.compile instead, which then calls the portable kernel straight from its
    generated code (the TMA kernel's host-side descriptors and tuning pre-hook are not traceable, so it is
    skipped there). use_tma (KernelOptions.use_tma): the persistent TMA kernel where it applies.
    """
    if a_q.dtype != b_q.dtype:
        raise TypeError(f"scaled_matmul: operands must share a dtype, got {a_q.dtype} and {b_q.dtype}")
    m, k = a_q.shape
    n = b_q.shape[0]
    if m == 0 or n == 0 or k == 0:
        out = torch.zeros((m, n), dtype=torch.float32, device=a_q.device)
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype)
    is_int = a_q.dtype == torch.int8
    c = torch.empty((m, n), dtype=out_dtype, device=a_q.device)
    a_scale = a_scale.float().contiguous()
    b_scale = b_scale.float().contiguous()
    bias = bias.contiguous() if bias is not None else None
    args = (
        a_q,
        b_q,
        c,
        a_scale,
        b_scale,
        # Any valid pointer when HAS_BIAS is False; c's keeps the autotuning key (tensor dtypes) of the biased
        # call of the same shape, so forward and grad-input GEMMs of one shape share one tuning run. A traced
        # launch gets a_scale instead: c passed twice would alias the kernel's output in the recorded call.
        bias if bias is not None else (c if wrap is None else a_scale),
        m,
        n,
        k,
        triton.next_power_of_2(m),
        a_q.stride(0),
        a_q.stride(1),
        b_q.stride(0),
        b_q.stride(1),
        c.stride(0),
        c.stride(1),
    )
    flags = dict(
        B_SCALE_PER_ROW=b_scale.dim() == 1,
        HAS_BIAS=bias is not None,
        IS_INT=is_int,
        UPCAST=not is_int and _needs_fp8_upcast(a_q.device.index or 0),
    )
    tma = use_tma and wrap is None and not flags["UPCAST"] and _tma_applies(a_q, b_q, c)
    if tma and _run_tma(a_q, b_q, c, a_scale, b_scale, bias, flags):
        return c
    wrap = wrap or launch_directly
    if m < _AUTOTUNE_MIN_M:
        _launch_tile(wrap, _SMALL_M_TILE, args, flags, m, n, k)
        return c
    tile = _table_tile(a_q, b_q, c)
    if tile is not None:
        _launch_tile(wrap, tile, args, flags, m, n, k)
        return c
    # One EVEN_K for every config: K a multiple of 128 is a multiple of each config's BLOCK_K (64 or 128).
    flags["EVEN_K"] = k % 128 == 0
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    wrap(portable_tuner(a_q.device.index or 0))[grid](*args, **flags)
    return c


__all__ = ["scaled_matmul"]
