"""The kernel set used while torch.compile traces a SwitchBack model on CUDA: which implementation of each
operator (kernels/library.py) the compiled graph holds.

The quantize functions are the torch reference ones (kernels/reference.py): plain tensor ops that Inductor
fuses into the op that produced their input (LayerNorm, GELU, the residual add), so a compiled model pays no
separate quantize pass and no Python launch overhead for them. The 8-bit GEMM stays our Triton kernel
(Inductor's own int8 matmul lowers to cuBLAS `_int_mm`, which is no faster than bf16 on Hopper), as a
`triton_op` whose launch Inductor records and makes from its generated code, with no Python call per GEMM.
With KernelOptions.use_tma (or trace_gemm off) it is the opaque operator instead: the TMA kernel's host-side
setup is not traceable. With KernelOptions.fuse_quantize_under_compile off, every quantize is our operator.

Four passes stay ours too, as traced triton_ops, where Inductor's code was measured slower:
- the output gradient's quantize (with the bias gradient's column sum). That tensor is written in 16 bits
  anyway (the grad-weight GEMM reads it), so fusing its quantize into the op that produced it saves nothing;
  Inductor's version re-read the producer's inputs instead (GELU backward: grad and h) in a slow persistent
  reduction that cost more for the fc1 gradients alone than our kernel for every gradient quantize of the step
  (BENCHMARKS.md, Whole training step). KernelOptions.triton_grad_quantize.
- the activation + quantize of fc1's output in forward (fused MLP) and the activation backward + quantize +
  column sum in backward (fused MLP, and fc1 + activation with fuse_activation: blocks/linear_activation.py):
  their input is a GEMM's output, with nothing for Inductor to fuse them into, and its code for them was
  slower than ours (BENCHMARKS.md, Memory). KernelOptions.triton_act_quantize.
- the fp8 grad-weight operands (wgrad_precision="fp8", kernels/wgrad.py: quantize_over_tokens and, from a
  memory_efficient saved input, requantize_over_tokens): a reduction over every token of each feature, written
  transposed and zero-padded. With the torch twin left to Inductor (a column reduction over a transposed view,
  a transposed copy, a padding copy of the 16-bit input) the quantize and casts took 59 ms of a 129 ms GPU
  step (ViT-B/16 b256, per-layer compile, H100) and left it host-bound; the input is a 16-bit tensor that
  backward holds anyway, so there is no producer for Inductor to fuse the pass into.

Known limit: Inductor tunes our GEMM's configs without its autotune key, so when Dynamo makes the token count
dynamic (a second shape, e.g. a short last batch), one tuned config serves every M. The layer-wise compile
in benchmarks/bench_train.py uses dynamic=False.

Numerics: the same formulas as the Triton quantize kernels (absmax / QMAX, round half to even, clamp), so
compiled and eager SwitchBack agree up to the float32 rounding of Inductor's generated code
(tests/test_compiled_kernels.py states the bound).
"""

from __future__ import annotations

from collections.abc import Callable

from . import cublas, library, ops, reference
from .library import KernelOp, KernelSet, Route, call_operator, call_twin, fixed
from .options import KernelOptions
from .quantize import colsum_in_one_pass

# Left to Inductor (the torch twins) unless options.fuse_quantize_under_compile is off.
_INDUCTOR_FUSES = {
    "quantize_rowwise",
    "quantize_tensorwise",
    "quantize_rowwise_transposed",
    "quantize_tensorwise_transposed",
}


def _gemm_traced(options: KernelOptions, a_q, b_q, out_dtype) -> bool:
    # cuBLAS's GEMM is traced as aten._scaled_mm whatever the Triton options say. The option test comes first:
    # it settles the default options without use_cublas's checks, which Dynamo would trace per GEMM.
    return (options.trace_gemm and not options.use_tma) or cublas.use_cublas(
        a_q, b_q, out_dtype, options.fp8_gemm
    )


def _policy(op: KernelOp) -> Route:
    # "ours" below: every pass our operator (options.fuse_quantize_under_compile off). A route returns the twin
    # itself, looked up per call (so a patched twin is the one that runs), not call_twin's wrapper: one frame
    # less for Dynamo to trace per quantize.
    name, operator = op.name, call_operator(op)
    if name in _INDUCTOR_FUSES:
        return lambda options, args: (
            getattr(reference, name) if options.fuse_quantize_under_compile else operator
        )

    if name == "quantize_rowwise_colsum":

        def colsum(options: KernelOptions, args: tuple) -> Callable:
            ours = not options.fuse_quantize_under_compile
            use_op = ours or (options.triton_grad_quantize and colsum_in_one_pass(args[0]))
            return operator if use_op else getattr(reference, name)

        return colsum

    if name in ("act_quantize_rowwise", "act_backward_quantize_colsum"):
        return lambda options, args: (
            operator
            if not options.fuse_quantize_under_compile or options.triton_act_quantize
            else getattr(reference, name)
        )

    if name == "scaled_matmul":
        opaque = call_operator(library.BY_NAME["scaled_matmul_recompute"])
        return lambda options, args: operator if _gemm_traced(options, args[0], args[1], args[5]) else opaque

    if name == "scaled_matmul_act_backward":

        def gemm_act_backward(options: KernelOptions, args: tuple) -> Callable:
            ours_act = not options.fuse_quantize_under_compile or options.triton_act_quantize
            if ours_act and _gemm_traced(options, args[0], args[1], args[4].dtype):
                return operator
            return _SPLIT_ACT_BACKWARD[ours_act]

        return gemm_act_backward

    # dequantize_rowwise, scaled_matmul_recompute, the producers that quantize (layernorm_quantize_rowwise,
    # act_and_quantize_rowwise: one read of their input, on for config.fuse_norm / fuse_activation) and the
    # fp8 grad-weight operands (quantize_over_tokens,
    # requantize_over_tokens: our traced kernels, see the module docstring): the operator itself
    return fixed(operator)


KERNELS = KernelSet("compiled", _policy)

# scaled_matmul_act_backward as the GEMM then the activation backward (ours or left to Inductor), where the
# GEMM cannot be traced into one operator with it
_ACT_BACKWARD = library.BY_NAME["act_backward_quantize_colsum"]
_SPLIT_ACT_BACKWARD = {
    True: ops.gemm_then_act_backward(KERNELS.scaled_matmul, call_operator(_ACT_BACKWARD)),
    False: ops.gemm_then_act_backward(KERNELS.scaled_matmul, call_twin(_ACT_BACKWARD)),
}


def __getattr__(name: str):
    if name in library.BY_NAME:
        return getattr(KERNELS, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["KERNELS"]
