"""KernelOptions: how the GPU kernels run, as data a model's layers carry (not process-wide switches).

Every field is a choice between implementations that compute the same result (up to float32 rounding order),
so it is a run-time choice, not part of the model: `SwitchBackConfig.kernel_options` carries it, and it is
left out of config.json. Two models in one process may use different options. The torch reference path
(CPU, backend="torch") has one implementation of everything; there only `fused_bias_grad` changes which
reference functions run.

Defaults are the measured winners (BENCHMARKS.md, topics GEMM kernels, MLP block and Whole training step);
the non-default values stay for A/B benchmarks (benchmarks/bench_linear.py, bench_train.py) and for
setups where they win (use_tma under CUDA graphs). This module is a leaf: it imports nothing from the package,
and never triton.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

ACT_BACKWARD_IMPLS = ("auto", "tiles", "rows")
FP8_GEMMS = ("auto", "triton", "cublas")
# Seeds the default of KernelOptions.fp8_gemm; an explicit fp8_gemm= always wins.
FP8_GEMM_ENV = "HF_SWITCHBACK_FP8_GEMM"
# Seeds the default of KernelOptions.use_tma ("0" or "1"); an explicit use_tma= always wins.
TMA_ENV = "HF_SWITCHBACK_TMA"


def _tma_default() -> bool:
    value = os.environ.get(TMA_ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"environment variable {TMA_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def _fp8_gemm_default() -> str:
    value = os.environ.get(FP8_GEMM_ENV, "auto")
    if value not in FP8_GEMMS:
        raise ValueError(f"environment variable {FP8_GEMM_ENV} must be one of {FP8_GEMMS}, got {value!r}")
    return value


@dataclass(frozen=True)
class KernelOptions:
    """Which kernel implementation each step of a SwitchBack layer uses on CUDA (see the module docstring)."""

    # Backward computes the bias gradient inside the output-gradient quantize pass (quantize_rowwise_colsum)
    # instead of a separate column sum: one read of the gradient instead of two (BENCHMARKS.md, MLP block:
    # fused bias gradient). False: the two passes.
    fused_bias_grad: bool = True
    # Under torch.compile on CUDA, the quantize passes are plain torch ops that Inductor fuses into the op that
    # produced their input (kernels/compiled.py): faster compiled steps (BENCHMARKS.md, Whole training step).
    # False keeps our Triton quantize kernels under compile too.
    fuse_quantize_under_compile: bool = True
    # Under torch.compile, the 8-bit GEMM is a triton_op that Inductor launches from its generated code (no
    # Python dispatch per GEMM; BENCHMARKS.md, Whole training step). False: the opaque custom op. (Ignored with
    # use_tma, whose host-side setup is not traceable.)
    trace_gemm: bool = True
    # Under torch.compile, the output-gradient quantize + bias column sum stays our one-pass Triton kernel;
    # Inductor's version re-read the producer's inputs and was slower (BENCHMARKS.md, Whole training step).
    # False leaves it to Inductor like the other quantizes.
    triton_grad_quantize: bool = True
    # Under torch.compile, the fused MLP's two activation passes over its (M, 4d) hidden tensor (forward:
    # act + quantize for fc2; backward: act' + quantize + column sum for fc1) stay our Triton kernels, traced
    # into Inductor's code. Inductor's own code for them was slower, forward and backward, and so was the whole
    # step (BENCHMARKS.md, Memory). False leaves them to Inductor.
    triton_act_quantize: bool = True
    # In eager mode, call the Triton launchers directly instead of through the torch.library custom ops, whose
    # dispatcher only adds CPU time to every call (about ten per layer and step, which adds up in launch-bound
    # eager steps; BENCHMARKS.md, Whole training step). False: through the custom ops.
    direct_eager: bool = True
    # The fused MLP's activation backward + quantize on CUDA: "rows" (one pass, whole rows per program),
    # "tiles" (two 2-D tiled passes, full occupancy) or "auto" (rows up to the one-pass limit, 8,192 wide, tiles
    # above: rows measured faster at every CLIP width, BENCHMARKS.md, Whole training step). All three give
    # bitwise the same q and scale.
    act_backward_impl: str = "auto"
    # The persistent TMA 8-bit GEMM on Hopper (sm90) for M >= 1024 and aligned operands; elsewhere, or if it
    # cannot be built here (then a warning, once per device), the portable kernel. Off by default: alone it
    # is faster than the portable kernel, but its host-side setup makes launch-bound training steps slower;
    # under CUDA graphs (torch.compile mode="reduce-overhead") that setup is not replayed and it wins
    # (BENCHMARKS.md, GEMM kernels and Whole training step). The default comes from HF_SWITCHBACK_TMA (0 / 1).
    use_tma: bool = dataclasses.field(default_factory=_tma_default)
    # fp8 GEMMs (fp8 forward, fp8 grad-input) on cuBLAS's row-wise torch._scaled_mm (kernels/cublas.py) or on
    # our Triton kernels. "auto": cuBLAS on Hopper (sm90), where it was measured faster than our fp8 kernels at
    # every CLIP GEMM shape (BENCHMARKS.md, GEMM kernels), Triton elsewhere (sm89 unmeasured; sm80 has no
    # fp8). "cublas": wherever torch._scaled_mm runs (sm89+). Operands cuBLAS does not take (e5m2 x e5m2, K or
    # N not a multiple of 16) stay on Triton.
    # The default comes from HF_SWITCHBACK_FP8_GEMM.
    fp8_gemm: str = dataclasses.field(default_factory=_fp8_gemm_default)
    # Each swapped weight quantized once per weight update (an optimizer step, a load), its forward and
    # transposed 8-bit forms kept with the layer and refreshed as one CUDA graph (weight_operands.py), instead
    # of quantized inside the op at every forward and backward; 2 bytes of GPU memory per weight value, same
    # numerics. Off by default: measured no faster (ViT-B/16 b256 in 8 bits, per-layer compile: 1.03x on one
    # H200, within the spread on another; ViT-H/14 b192: 0.99x, +1.7 GiB), and no shorter first compile
    # (BENCHMARKS.md, Whole training step); meant for frozen weights (LoRA: never re-quantized) and gradient
    # accumulation, not yet measured there. Read by apply_switchback.
    cache_weight_operands: bool = False

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            choices = {"act_backward_impl": ACT_BACKWARD_IMPLS, "fp8_gemm": FP8_GEMMS}.get(f.name)
            if choices is not None:
                if value not in choices:
                    raise ValueError(f"KernelOptions.{f.name} must be one of {choices}, got {value!r}")
            elif not isinstance(value, bool):
                raise TypeError(f"KernelOptions.{f.name} must be a bool, got {type(value).__name__}")

    def replace(self, **changes: Any) -> KernelOptions:
        return dataclasses.replace(self, **changes)


__all__ = ["ACT_BACKWARD_IMPLS", "FP8_GEMMS", "FP8_GEMM_ENV", "TMA_ENV", "KernelOptions"]
